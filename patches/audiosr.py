"""AudioSR (PyPI ``audiosr`` 0.0.7; its maintained fork PyPI ``kagayoi-audiosr`` 1.0.2, same package name).

``audiosr.latent_diffusion.models`` is a copy of AudioLDM2's: the same native-sampling fixes as
:mod:`gradpatch.patches.audioldm2` (``gradpatch.sampling.ldm``), declared on AudioSR's module
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
from ._ldm import DEVICE, EMA, ENTRY, INNER, LIFTED, REFUSE, STEP_BY_INDEX, STEP_BY_TIMESTEP, ldm_sampling

_M = "audiosr.latent_diffusion.models"
_DDIM, _PLMS = f"{_M}.ddim:DDIMSampler", f"{_M}.plms:PLMSSampler"
_DDPM, _LDM = f"{_M}.ddpm:DDPM", f"{_M}.ddpm:LatentDiffusion"
_SR = "audiosr 0.0.7 = kagayoi-audiosr 1.0.2"
_A2 = f"{_SR} = audioldm2 0.1.0"

PATCHES = ldm_sampling("audiosr", [
    (f"{_DDIM}.register_buffer", DEVICE, {"3f4b78d1e34d1fff": _A2}),
    (f"{_DDIM}.sample", ENTRY, {"7ca1a34f1dab2c6c": _A2}),
    (f"{_DDIM}.encode", ENTRY, {"0911282aa5e02fb3": f"{_A2} = stable-diffusion-sdkit 2.1.5"}),
    (f"{_DDIM}.decode", ENTRY, {"6151b2dde2ccd6a0": _A2}),
    (f"{_DDIM}.stochastic_encode", ENTRY, {"882c839e9f195098": _SR}),
    (f"{_DDIM}.ddim_sampling", INNER, {"88300a195ac38551": f"{_A2} = stable-diffusion-sdkit 2.1.5"}),
    (f"{_DDIM}.p_sample_ddim", STEP_BY_INDEX, {"db4b71d42a33cc23": _SR}),
    (f"{_PLMS}.register_buffer", DEVICE, {"890b0198f7cc2775": _A2}),
    (f"{_PLMS}.sample", ENTRY, {"fc84eb8f72062b19": _A2}),
    (f"{_PLMS}.plms_sampling", INNER, {"f6f07c2392b8ea7b": _A2}),
    (f"{_PLMS}.p_sample_plms", STEP_BY_INDEX, {"4121f2ab875e9708": _SR}),
    (f"{_DDPM}.sample", ENTRY, {"dcb4a96c8599bb02": "audiosr 0.0.7 = audioldm2 0.1.0",
                                "a055a63ddb4a5cf0": "kagayoi-audiosr 1.0.2"}),
    (f"{_DDPM}.p_sample_loop", ENTRY, {"e3bcd5dbeee5d564": _A2}),
    (f"{_DDPM}.p_sample", STEP_BY_TIMESTEP, {"3471205f0f28053f": _SR}),
    (f"{_DDPM}.ema_scope", EMA, {"c3f74c6f1df1147b": _A2}),
    # Training and logging helpers, also @torch.no_grad(): declared so that none is left cutting a graph.
    (f"{_DDPM}.log_images", INNER, {"eed93ef04f3a6366": _A2}),
    (f"{_LDM}.on_train_batch_start", INNER, {"80bc9a4a9521658d": _A2}),
    (f"{_LDM}.sample", ENTRY, {"3480a2d7a886028b": _A2}),
    (f"{_LDM}.p_sample_loop", ENTRY, {"a5521aa3be654c4a": _A2}),
    (f"{_LDM}.p_sample", STEP_BY_TIMESTEP, {"e4e358fbd7268a44": _SR}),
    (f"{_LDM}.progressive_denoising", ENTRY, {"e33ecb5c31e60221": _A2}),
    (f"{_LDM}.sample_log", ENTRY, {"dc1b3b56e4a80772": _SR}),
    (f"{_LDM}.decode_first_stage", LIFTED, {"e4f7a6e779beb2bd": _A2}),
    (f"{_LDM}.encode_first_stage", LIFTED, {"f1d4b5ea526b470e": _A2}),
    (f"{_LDM}.generate_batch", REFUSE, {"44f84f9fb9bb8284": "audiosr 0.0.7",
                                         "018639dfb1f61985": "kagayoi-audiosr 1.0.2"}),
])
