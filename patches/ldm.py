"""Codebases that ship the package ``ldm``: CompVis latent-diffusion and stable-diffusion (SD1),
Make-An-Audio and Make-An-Audio-2 (V1); Stability-AI/stablediffusion (SD2), ControlNet and PyPI
``stable-diffusion-sdkit`` (V2: V1 plus CUDA-autocast replay).

The name ``ldm`` is shared, so only the fingerprint tells them apart. ``ldm.modules.attention`` and
``ldm.modules.diffusionmodules.openaimodel`` rebind ``checkpoint``; SD1's ``BasicTransformerBlock`` always
checkpoints, and ``AttentionBlock`` passes ``True`` everywhere. Tested against stable-diffusion-sdkit
2.1.5 (V2); V1 is tested through audioldm, which has the same fingerprint.

Native sampling (``gradpatch.sampling.ldm``), in ``ldm.models.diffusion``: ``DDIMSampler.sample``/
``encode``/``decode``/``stochastic_encode``, ``PLMSSampler.sample``, ``DPMSolverSampler.sample`` and
``LatentDiffusion.sample``/``p_sample_loop``/``progressive_denoising``/``sample_log``/
``decode_first_stage``/``encode_first_stage`` (and ``DDPM.sample``/``p_sample_loop``) take
``cache``/``grad_steps``/``checkpoint_steps``; the decorated loops and steps they reach run undecorated
inside ``cache=False`` calls. A step is one ``p_sample_ddim``, ``p_sample_plms`` or ``p_sample``
(ancestral) call, or one call of DPM-Solver's model function: ``DPM_Solver.sample`` runs its solver
inside an in-body ``with torch.no_grad():``, lifted for ``cache=False`` calls
(``gradpatch.sampling.ldm_dpm_solver``). ``ema_scope`` is guarded. SD1's and ControlNet's samplers move
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
from gradpatch.sampling.lift import Liftable
from gradpatch.patching.registry import Patch

from ._families import checkpoint_family
from ._ldm import DEVICE, EMA, ENTRY, INNER, STEP_BY_INDEX, STEP_BY_TIMESTEP, ldm_sampling

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
_DDIM, _PLMS = f"{_M}.ddim:DDIMSampler", f"{_M}.plms:PLMSSampler"
_DDPM, _LDM = f"{_M}.ddpm:DDPM", f"{_M}.ddpm:LatentDiffusion"
_DPMS = f"{_M}.dpm_solver.sampler:DPMSolverSampler"
_SDKIT, _SD2, _CN = "stable-diffusion-sdkit 2.1.5", "Stability-AI/stablediffusion@cf1d67a", "ControlNet@ed85cd1"
_SD1 = "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5"
_V2 = f"{_SDKIT} = {_SD2} = {_CN}"
_ALL = f"{_V2} = {_SD1}"

_SDKIT_DEVICE = {"920459e7fe10e930": f"{_SDKIT}: buffers already follow the model's device"}

PATCHES += ldm_sampling("ldm", [
    (f"{_DDIM}.register_buffer", DEVICE, {"2b2f59529f4c5212": _SD2, "890b0198f7cc2775": f"{_SD1} = {_CN}"},
     _SDKIT_DEVICE),
    (f"{_PLMS}.register_buffer", DEVICE, {"2b2f59529f4c5212": _SD2, "890b0198f7cc2775": f"{_SD1} = {_CN}"},
     _SDKIT_DEVICE),
    (f"{_DPMS}.register_buffer", DEVICE, {"2b2f59529f4c5212": _SD2,
                                          "890b0198f7cc2775": f"CompVis/stable-diffusion@21f890f = {_CN}"},
     _SDKIT_DEVICE),
    (f"{_DDIM}.sample", ENTRY, {"fbd4c5b88ce267f0": _V2, "52b6ad2bb29ace22": _SD1}),
    (f"{_DDIM}.encode", ENTRY, {"0911282aa5e02fb3": f"{_V2} = audioldm2 0.1.0"}),
    (f"{_DDIM}.decode", ENTRY, {"3e53d7a188c1eb9b": _SDKIT, "6151b2dde2ccd6a0": f"{_SD2} = {_CN}",
                                 "121d67b33f0b4ad7": "CompVis/stable-diffusion@21f890f"}),
    (f"{_DDIM}.stochastic_encode", ENTRY, {"b556a97de0174ae3": f"{_V2} = CompVis/stable-diffusion@21f890f"}),
    (f"{_DDIM}.ddim_sampling", INNER, {"88300a195ac38551": f"{_V2} = audioldm2 0.1.0", "fb839a0830195150": _SD1}),
    (f"{_DDIM}.p_sample_ddim", STEP_BY_INDEX, {"114306ab3d893a69": _V2, "1a96824c9eb1f804": _SD1}),
    (f"{_PLMS}.sample", ENTRY, {"e4cf24e891857d32": _V2, "fc84eb8f72062b19": f"{_SD1} = audioldm2 0.1.0"}),
    (f"{_PLMS}.plms_sampling", INNER, {"aad84645ba548e07": _V2, "f6f07c2392b8ea7b": f"{_SD1} = audioldm2 0.1.0"}),
    (f"{_PLMS}.p_sample_plms", STEP_BY_INDEX, {"3b180813a01cd7d2": _V2, "3ff2abcd8aacdb12": _SD1}),
    (f"{_DPMS}.sample", ENTRY, {"1b9a2d39476e03c2": _SDKIT, "7cb87b3cb416a588": _SD2, "df0b06b6289208bb": _CN,
                                "2cd2704987415efd": "CompVis/stable-diffusion@21f890f"}),
    (f"{_DDPM}.sample", ENTRY, {"0a42b13e3068607d": _ALL}),
    (f"{_DDPM}.p_sample_loop", ENTRY, {"e3bcd5dbeee5d564": f"{_ALL} = audioldm2 0.1.0"}),
    (f"{_DDPM}.p_sample", STEP_BY_TIMESTEP, {"abab388d99dfabbc": _ALL}),
    (f"{_DDPM}.ema_scope", EMA, {"afccb50b09441242": _ALL}),
    # Training, logging and conditioning helpers, also @torch.no_grad(): declared so that none is left
    # cutting the graph of a cache=False call that reaches it (get_input, get_unconditional_conditioning).
    (f"{_DDPM}.init_from_ckpt", INNER, {"fe5c5acf54a9df62": _V2, "611beab222b9e378": _SD1}),
    (f"{_DDPM}.validation_step", INNER, {"e5f1ec1460b49f7a": _ALL}),
    (f"{_DDPM}.log_images", INNER, {"eed93ef04f3a6366": _ALL}),
    (f"{_LDM}.on_train_batch_start", INNER, {"ef021d4fe66ada8f": _ALL}),
    (f"{_LDM}.get_input", INNER, {"c971238ed02912d2": _V2, "9244524c46e38cc0": _SD1}),
    (f"{_LDM}.get_unconditional_conditioning", INNER, {"6542b0bda67b1282": _V2}),
    (f"{_LDM}.log_images", INNER, {"05f323c7ab13ed5a": _V2, "247d7cc82c4f47db": _SD1}),
    (f"{_LDM}.to_rgb", INNER, {"9d592911e2cae0d7": _ALL}),
    # SD2's LatentDiffusion subclasses (upscaling, inpainting, depth): their own decorated helpers.
    (f"{_M}.ddpm:LatentUpscaleDiffusion.get_input", INNER, {"bf247bd3116c202a": _V2}),
    (f"{_M}.ddpm:LatentUpscaleDiffusion.log_images", INNER, {"04e8ca09043c9296": _V2}),
    (f"{_M}.ddpm:LatentFinetuneDiffusion.log_images", INNER, {"b4b32928b82c5883": _V2}),
    (f"{_M}.ddpm:LatentInpaintDiffusion.get_input", INNER, {"713f9ed031d6b0c3": _V2}),
    (f"{_M}.ddpm:LatentInpaintDiffusion.log_images", INNER, {"1761a574f367544a": _V2}),
    (f"{_M}.ddpm:LatentDepth2ImageDiffusion.get_input", INNER, {"8bd72d2c030b6ef7": _V2}),
    (f"{_M}.ddpm:LatentDepth2ImageDiffusion.log_images", INNER, {"5803f1b358f5f022": _V2}),
    (f"{_M}.ddpm:LatentUpscaleFinetuneDiffusion.get_input", INNER, {"f1d76bf23b71d15a": _V2}),
    (f"{_M}.ddpm:LatentUpscaleFinetuneDiffusion.log_images", INNER, {"c22a7fc169e74394": _V2}),
    (f"{_LDM}.sample", ENTRY, {"f1f7fa1a8735aeb7": _ALL}),
    (f"{_LDM}.p_sample_loop", ENTRY, {"a5521aa3be654c4a": f"{_ALL} = audioldm2 0.1.0"}),
    (f"{_LDM}.p_sample", STEP_BY_TIMESTEP, {"adb1d047f721fa58": _ALL}),
    (f"{_LDM}.progressive_denoising", ENTRY, {"e33ecb5c31e60221": f"{_ALL} = audioldm2 0.1.0"}),
    (f"{_LDM}.sample_log", ENTRY, {"0c7dfc0227c95ea0": _ALL}),
    (f"{_LDM}.decode_first_stage", ENTRY, {"17cc3466967e0137": _V2, "987d86812a20cf8e": _SD1}),
    (f"{_LDM}.encode_first_stage", ENTRY, {"70a353ecaa2bb405": _V2, "a169a9f3b7c09e4c": _SD1}),
], requires="stable-diffusion-sdkit<3")

PATCHES.append(Patch(
    "ldm.DPM_Solver.sample", f"{_M}.dpm_solver.dpm_solver:DPM_Solver.sample",
    "gradpatch.sampling.ldm_dpm_solver:solver_sample",
    Liftable({"1b5e3a7b72346eba": _SDKIT, "2a7a5ecd0d1a2b72": f"{_SD2} = {_CN}",
              "80d4a48b32df4647": "CompVis/stable-diffusion@21f890f = AudioLDM-training-finetuning@702a638"}),
    "ldm", "runs with its in-body no_grad lifted inside a cache=False call; one step per model-function call",
    "stable-diffusion-sdkit<3"))
