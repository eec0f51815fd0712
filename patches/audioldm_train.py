"""The AudioLDM training and fine-tuning repository (GitHub haoheliu/AudioLDM-training-finetuning only).

``audioldm_train.utilities.diffusion_util`` holds the V1 checkpoint, rebound by
``audioldm_train.modules.diffusionmodules.attention`` and ``openaimodel``. (A second V1 copy in
``modules/diffusionmodules/nn.py`` is imported by nothing.) No installable package carries this code:
the fix is tested on PyPI audioldm, whose checkpoint has the same fingerprint.

Native sampling (``gradpatch.sampling.families.ldm``, ``gradpatch.sampling.families.ldm_dpm_solver``) in
``audioldm_train.modules.latent_diffusion``: AudioLDM2's samplers, ``LatentDiffusion`` (in-body ``no_grad``
in ``decode_first_stage``/``encode_first_stage``) and SD1's DPM-Solver, declared as for those codebases.
Fingerprints from haoheliu/AudioLDM-training-finetuning@702a638 (the repository as of 2024-12-13). No
installable package carries this code, so the fixes are tested on the installable code with the same
fingerprint where there is one: ``ddim_sampling``, ``encode``, ``decode``, ``plms_sampling``,
``PLMSSampler.sample``, ``LatentDiffusion.sample``/``p_sample_loop``/``progressive_denoising``/
``decode_first_stage``/``encode_first_stage`` and ``DDPM.p_sample_loop`` equal audioldm2 0.1.0's,
``DDPM.sample`` audioldm 0.1.1's, ``ema_scope`` and the ``register_buffer`` methods sdkit's or SD1's
copies' shapes. ``DDIMSampler.sample``/``p_sample_ddim``/``stochastic_encode``, ``p_sample_plms``, the
``p_sample`` methods, ``sample_log``, ``generate_sample`` and the DPM-Solver pair are hashes of their
own (small edits of the AudioLDM2 and SD1 bodies: the same roles and arguments), not tested here.
"""
from ._families import checkpoint_family
from ._ldm import ldm_sampling

PATCHES = checkpoint_family("audioldm_train", "audioldm_train.utilities.diffusion_util", {
    "78fc3e61f1317c31": "V1 · haoheliu/AudioLDM-training-finetuning@f34e6fb9",
})

_M = "audioldm_train.modules.latent_diffusion"
PATCHES += ldm_sampling("audioldm_train", {
    f"{_M}.ddim:DDIMSampler": "register_buffer sample encode decode stochastic_encode ddim_sampling p_sample_ddim",
    f"{_M}.plms:PLMSSampler": "register_buffer sample plms_sampling p_sample_plms",
    f"{_M}.dpm_solver.sampler:DPMSolverSampler": "register_buffer sample",
    f"{_M}.ddpm:DDPM": "sample p_sample_loop p_sample ema_scope validation_step log_images",
    f"{_M}.ddpm:LatentDiffusion":
        "on_train_batch_start sample p_sample_loop p_sample progressive_denoising sample_log "
        "decode_first_stage:lifted encode_first_stage:lifted generate_sample",
    f"{_M}.dpm_solver.dpm_solver:DPM_Solver": "sample",
})
