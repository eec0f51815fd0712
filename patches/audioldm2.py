"""AudioLDM2 (PyPI ``audioldm2``; GitHub haoheliu/AudioLDM2).

Checkpoint. ``audioldm2.latent_diffusion.modules.diffusionmodules.util`` defines the V1 checkpoint;
``modules.attention`` and ``diffusionmodules.openaimodel`` rebind it and force it on, as in AudioLDM.

Native sampling (``gradpatch.sampling.ldm``), in ``audioldm2.latent_diffusion.models``:
``DDIMSampler.sample``/``encode``/``decode``/``stochastic_encode``, ``PLMSSampler.sample`` and
``LatentDiffusion.sample``/``p_sample_loop``/``progressive_denoising``/``sample_log`` (and
``DDPM.sample``/``p_sample_loop``) take ``cache``/``grad_steps``/``checkpoint_steps``; the decorated
loops and steps they reach run undecorated inside ``cache=False`` calls. A step is one
``p_sample_ddim`` call (which evaluates the model twice with guidance: unconditional, then
conditional; both count for that step), one ``p_sample_plms`` call, or one ``p_sample`` call
(ancestral). ``decode_first_stage``/``encode_first_stage`` hold an in-body ``with torch.no_grad():``;
their ``cache=False`` runs a copy with it lifted (``gradpatch.sampling.lift``). ``generate_batch``/
``generate_sample`` refuse ``cache=False``; ``ema_scope`` is guarded. ``PLMSSampler.register_buffer``
moves every buffer to CUDA and ``DDIMSampler`` defaults to ``device=cuda``: both samplers' buffers
follow the model's device instead, so they work on CPU (a CUDA model gets upstream's buffers).

Fingerprints were computed (``python -m gradpatch.patching.fingerprint``) on PyPI audioldm2 0.1.0, which equals
GitHub haoheliu/AudioLDM2@b5786c5 for every target. The hashes AudioSR and the AudioLDM training
repository share are declared again in their modules (other module paths). Tested against PyPI
audioldm2 0.1.0 (which needs ``HF_HUB_OFFLINE=1`` without network: it loads a tokenizer at import).
"""
from ._families import checkpoint_family
from ._ldm import DEVICE, EMA, ENTRY, INNER, LIFTED, REFUSE, STEP_BY_INDEX, STEP_BY_TIMESTEP, ldm_sampling

PATCHES = checkpoint_family("audioldm2", "audioldm2.latent_diffusion.modules.diffusionmodules.util", {
    # The repository's two versions (cd8a405b, f2987b24, 2023-08-04) differ by an unused import.
    "78fc3e61f1317c31": "V1 · audioldm2 0.1.0 = haoheliu/AudioLDM2@f2987b24",
}, requires="audioldm2<1")

_M = "audioldm2.latent_diffusion.models"
_DDIM, _PLMS = f"{_M}.ddim:DDIMSampler", f"{_M}.plms:PLMSSampler"
_DDPM, _LDM = f"{_M}.ddpm:DDPM", f"{_M}.ddpm:LatentDiffusion"
_A2 = "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5"
_SHARED = f"{_A2} = audiosr 0.0.7 = kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638"

PATCHES += ldm_sampling("audioldm2", [
    (f"{_DDIM}.register_buffer", DEVICE, {"3f4b78d1e34d1fff": f"{_A2} = audiosr 0.0.7"}),
    (f"{_DDIM}.sample", ENTRY, {"7ca1a34f1dab2c6c": f"{_A2} = audiosr 0.0.7"}),
    (f"{_DDIM}.encode", ENTRY, {"0911282aa5e02fb3": f"{_SHARED} = Stability-AI/stablediffusion@cf1d67a"}),
    (f"{_DDIM}.decode", ENTRY, {"6151b2dde2ccd6a0": f"{_SHARED} = Stability-AI/stablediffusion@cf1d67a"}),
    (f"{_DDIM}.stochastic_encode", ENTRY, {"47fd9e33268d70d7": _A2}),
    (f"{_DDIM}.ddim_sampling", INNER, {"88300a195ac38551": f"{_SHARED} = Stability-AI/stablediffusion@cf1d67a "
                                                          "= stable-diffusion-sdkit 2.1.5"}),
    (f"{_DDIM}.p_sample_ddim", STEP_BY_INDEX, {"0e88abd52f764f59": _A2}),
    (f"{_PLMS}.register_buffer", DEVICE, {"890b0198f7cc2775": f"{_SHARED} = CompVis/stable-diffusion@21f890f"}),
    (f"{_PLMS}.sample", ENTRY, {"fc84eb8f72062b19": f"{_SHARED} = CompVis/stable-diffusion@21f890f"}),
    (f"{_PLMS}.plms_sampling", INNER, {"f6f07c2392b8ea7b": f"{_SHARED} = CompVis/stable-diffusion@21f890f"}),
    (f"{_PLMS}.p_sample_plms", STEP_BY_INDEX, {"5c3282b0ca2918d9": _A2}),
    (f"{_DDPM}.sample", ENTRY, {"dcb4a96c8599bb02": f"{_A2} = audiosr 0.0.7"}),
    (f"{_DDPM}.p_sample_loop", ENTRY, {"e3bcd5dbeee5d564": f"{_SHARED} = CompVis/stable-diffusion@21f890f"}),
    (f"{_DDPM}.p_sample", STEP_BY_TIMESTEP, {"f3a209378c74b0da": _A2}),
    (f"{_DDPM}.ema_scope", EMA, {"c3f74c6f1df1147b": f"{_A2} = audiosr 0.0.7 = kagayoi-audiosr 1.0.2"}),
    # Training and logging helpers, also @torch.no_grad(): declared so that none is left cutting a graph.
    (f"{_DDPM}.log_images", INNER, {"eed93ef04f3a6366": f"{_SHARED} = stable-diffusion-sdkit 2.1.5"}),
    (f"{_LDM}.on_train_batch_start", INNER, {"80bc9a4a9521658d": f"{_A2} = audiosr 0.0.7 = kagayoi-audiosr 1.0.2"}),
    (f"{_LDM}.sample", ENTRY, {"3480a2d7a886028b": _SHARED}),
    (f"{_LDM}.p_sample_loop", ENTRY, {"a5521aa3be654c4a": f"{_SHARED} = CompVis/stable-diffusion@21f890f"}),
    (f"{_LDM}.p_sample", STEP_BY_TIMESTEP, {"7ecab5fe7f9c0840": _A2}),
    (f"{_LDM}.progressive_denoising", ENTRY, {"e33ecb5c31e60221": f"{_SHARED} = CompVis/stable-diffusion@21f890f"}),
    (f"{_LDM}.sample_log", ENTRY, {"c0842813ca23e6f1": _A2}),
    (f"{_LDM}.decode_first_stage", LIFTED, {"e4f7a6e779beb2bd": _SHARED}),
    (f"{_LDM}.encode_first_stage", LIFTED, {"f1d4b5ea526b470e": _SHARED}),
    (f"{_LDM}.generate_batch", REFUSE, {"ffbaae944ea9e2b8": _A2}),
    (f"{_LDM}.generate_sample", REFUSE, {"c9c2f5f3024f41ba": _A2}),
], requires="audioldm2<1")
