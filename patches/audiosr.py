"""AudioSR (PyPI ``audiosr`` 0.0.7; its maintained fork PyPI ``kagayoi-audiosr`` 1.0.2, same package name).

``audiosr.latent_diffusion.models`` is a copy of AudioLDM2's: the same native-sampling fixes as
:mod:`gradpatch.patches.audioldm2` (``gradpatch.sampling.families.ldm``), declared on AudioSR's module
paths. A step is one ``p_sample_ddim`` call (with guidance: the conditional, then the unconditional
evaluation), one ``p_sample_plms`` call, or one ``p_sample`` call (ancestral). ``decode_first_stage``/
``encode_first_stage`` hold an in-body ``with torch.no_grad():`` (lifted for ``cache=False``);
``generate_batch`` (super-resolution post-processing in numpy) refuses ``cache=False``; ``ema_scope`` is
guarded; ``PLMSSampler.register_buffer`` (forced CUDA) and ``DDIMSampler`` (``device=cuda`` default)
follow the model's device.

Fingerprints were computed on both wheels (``python -m gradpatch.patching.fingerprint``): they agree on every
target except ``DDPM.sample`` and ``LatentDiffusion.generate_batch``. Where a hash equals AudioLDM2's the
provenance says so. Tested against PyPI audiosr 0.0.7, installed ``--no-deps`` (it pins numpy<=1.23.5
and transformers==4.30.2; its modules import on current versions).
"""
from ._ldm import ldm_sampling

_M = "audiosr.latent_diffusion.models"
PATCHES = ldm_sampling("audiosr", {
    f"{_M}.ddim:DDIMSampler": "register_buffer sample encode decode stochastic_encode ddim_sampling p_sample_ddim",
    f"{_M}.plms:PLMSSampler": "register_buffer sample plms_sampling p_sample_plms",
    f"{_M}.ddpm:DDPM": "sample p_sample_loop p_sample ema_scope log_images",
    f"{_M}.ddpm:LatentDiffusion":
        "on_train_batch_start sample p_sample_loop p_sample progressive_denoising sample_log "
        "decode_first_stage:lifted encode_first_stage:lifted generate_batch",
})
