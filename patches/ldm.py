"""Codebases that ship the package ``ldm``: CompVis latent-diffusion and stable-diffusion (SD1),
Make-An-Audio and Make-An-Audio-2 (V1); Stability-AI/stablediffusion (SD2), ControlNet and PyPI
``stable-diffusion-sdkit`` (V2: V1 plus CUDA-autocast replay).

The name ``ldm`` is shared, so only the fingerprint tells them apart. ``ldm.modules.attention`` and
``ldm.modules.diffusionmodules.openaimodel`` rebind ``checkpoint``; SD1's ``BasicTransformerBlock`` always
checkpoints, and ``AttentionBlock`` passes ``True`` everywhere. Tested against stable-diffusion-sdkit
2.1.5 (V2); V1 is tested through audioldm, which has the same fingerprint.

Native sampling (``gradpatch.sampling.families.ldm``), in ``ldm.models.diffusion``: ``DDIMSampler.sample``/
``encode``/``decode``/``stochastic_encode``, ``PLMSSampler.sample``, ``DPMSolverSampler.sample`` and
``LatentDiffusion.sample``/``p_sample_loop``/``progressive_denoising``/``sample_log``/
``decode_first_stage``/``encode_first_stage`` (and ``DDPM.sample``/``p_sample_loop``) take
``cache``/``grad_steps``/``checkpoint_steps``; the decorated loops and steps they reach run undecorated
inside ``cache=False`` calls. A step is one ``p_sample_ddim``, ``p_sample_plms`` or ``p_sample``
(ancestral) call, or one call of DPM-Solver's model function: ``DPM_Solver.sample`` runs its solver
inside an in-body ``with torch.no_grad():``, lifted for ``cache=False`` calls
(``gradpatch.sampling.families.ldm_dpm_solver``). ``ema_scope`` is guarded. SD1's and ControlNet's samplers move
their buffers to CUDA in ``register_buffer`` and SD2's default to ``device=cuda``: the buffers follow the
model's device instead (sdkit's copy already does). SD1's undecorated
``differentiable_decode_first_stage`` needs nothing.

Fingerprints (``python -m gradpatch.patching.fingerprint``) from PyPI stable-diffusion-sdkit 2.1.5 and the
GitHub snapshots Stability-AI/stablediffusion@cf1d67a (SD2), lllyasviel/ControlNet@ed85cd1,
CompVis/stable-diffusion@21f890f (SD1) and CompVis/latent-diffusion@a506df5 (no DPM-Solver). Only
sdkit is installable: SD2/ControlNet/SD1 code is recognised by fingerprint and the fix is tested on
sdkit, which shares SD2's hashes for most targets (it differs in ``DPMSolverSampler.sample``,
``DPM_Solver.sample``, ``DDIMSampler.decode`` and the ``register_buffer`` methods, which already follow
the model's device there); the SD1 variants are separate hashes of the same shape.
"""
from ._families import checkpoint_family
from ._ldm import ldm_sampling

PATCHES = checkpoint_family("ldm", "ldm.modules.diffusionmodules.util", {
    # CompVis/latent-diffusion and CompVis/stable-diffusion share history (e66308c7, 171cf29f; LF);
    # Text-to-Audio/Make-An-Audio@42de53e9 and bytedance/Make-An-Audio-2@b1570562 are CRLF copies.
    "78fc3e61f1317c31": "V1 · CompVis/latent-diffusion@171cf29f = CompVis/stable-diffusion@171cf29f "
                        "= Make-An-Audio@42de53e9",
    # Stability-AI/stablediffusion ca86da3a, 8ec7903d, cddd65d5 (comment-only differences),
    # lllyasviel/ControlNet@e38d22aa, PyPI stable-diffusion-sdkit 2.1.5.
    "929fce4a31ca8b21": "V2 · Stability-AI/stablediffusion@cddd65d5 = ControlNet@e38d22aa "
                        "= stable-diffusion-sdkit 2.1.5",
}, requires="stable-diffusion-sdkit<3")

_M = "ldm.models.diffusion"
PATCHES += ldm_sampling("ldm", {
    f"{_M}.ddim:DDIMSampler": "register_buffer sample encode decode stochastic_encode ddim_sampling p_sample_ddim",
    f"{_M}.plms:PLMSSampler": "register_buffer sample plms_sampling p_sample_plms",
    f"{_M}.dpm_solver.sampler:DPMSolverSampler": "register_buffer sample",
    f"{_M}.ddpm:DDPM": "sample p_sample_loop p_sample ema_scope init_from_ckpt validation_step log_images",
    f"{_M}.ddpm:LatentDiffusion":
        "on_train_batch_start get_input get_unconditional_conditioning log_images to_rgb sample p_sample_loop "
        "p_sample progressive_denoising sample_log decode_first_stage encode_first_stage",
    f"{_M}.ddpm:LatentUpscaleDiffusion": "get_input log_images",
    f"{_M}.ddpm:LatentFinetuneDiffusion": "log_images",
    f"{_M}.ddpm:LatentInpaintDiffusion": "get_input log_images",
    f"{_M}.ddpm:LatentDepth2ImageDiffusion": "get_input log_images",
    f"{_M}.ddpm:LatentUpscaleFinetuneDiffusion": "get_input log_images",
    f"{_M}.dpm_solver.dpm_solver:DPM_Solver": "sample",
}, requires="stable-diffusion-sdkit<3")
