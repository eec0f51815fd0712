"""AudioLDM2 (PyPI ``audioldm2``; GitHub haoheliu/AudioLDM2).

Checkpoint. ``audioldm2.latent_diffusion.modules.diffusionmodules.util`` defines the V1 checkpoint;
``modules.attention`` and ``diffusionmodules.openaimodel`` rebind it and force it on, as in AudioLDM.

Native sampling (``gradpatch.sampling.families.ldm``), in ``audioldm2.latent_diffusion.models``:
``DDIMSampler.sample``/``encode``/``decode``/``stochastic_encode``, ``PLMSSampler.sample`` and
``LatentDiffusion.sample``/``p_sample_loop``/``progressive_denoising``/``sample_log`` (and
``DDPM.sample``/``p_sample_loop``) take ``cache``/``grad_steps``/``checkpoint_steps``; the decorated
loops and steps they reach run undecorated inside ``cache=False`` calls. A step is one
``p_sample_ddim`` call (which evaluates the model twice with guidance: unconditional, then
conditional; both count for that step), one ``p_sample_plms`` call, or one ``p_sample`` call
(ancestral). ``decode_first_stage``/``encode_first_stage`` hold an in-body ``with torch.no_grad():``;
their ``cache=False`` runs a copy with it lifted (``gradpatch.sampling.lifting.lift``). ``generate_batch``/
``generate_sample`` refuse ``cache=False``; ``ema_scope`` is guarded. ``PLMSSampler.register_buffer``
moves every buffer to CUDA and ``DDIMSampler`` defaults to ``device=cuda``: both samplers' buffers
follow the model's device instead, so they work on CPU (a CUDA model gets upstream's buffers).

Fingerprints were computed (``python -m gradpatch.patching.fingerprint``) on PyPI audioldm2 0.1.0, which equals
GitHub haoheliu/AudioLDM2@b5786c5 for every target. The hashes AudioSR and the AudioLDM training
repository share are declared again in their modules (other module paths). Tested against PyPI
audioldm2 0.1.0 (which needs ``HF_HUB_OFFLINE=1`` without network: it loads a tokenizer at import).
"""
from ._families import checkpoint_family
from ._ldm import ldm_sampling

PATCHES = checkpoint_family("audioldm2", "audioldm2.latent_diffusion.modules.diffusionmodules.util", {
    # The repository's two versions (cd8a405b, f2987b24, 2023-08-04) differ by an unused import.
    "78fc3e61f1317c31": "V1 · audioldm2 0.1.0 = haoheliu/AudioLDM2@f2987b24",
}, requires="audioldm2<1")

_M = "audioldm2.latent_diffusion.models"
PATCHES += ldm_sampling("audioldm2", {
    f"{_M}.ddim:DDIMSampler": "register_buffer sample encode decode stochastic_encode ddim_sampling p_sample_ddim",
    f"{_M}.plms:PLMSSampler": "register_buffer sample plms_sampling p_sample_plms",
    f"{_M}.ddpm:DDPM": "sample p_sample_loop p_sample ema_scope log_images",
    f"{_M}.ddpm:LatentDiffusion":
        "on_train_batch_start sample p_sample_loop p_sample progressive_denoising sample_log "
        "decode_first_stage:lifted encode_first_stage:lifted generate_batch generate_sample",
}, requires="audioldm2<1")
