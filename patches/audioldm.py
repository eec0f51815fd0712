"""AudioLDM (PyPI ``audioldm``; GitHub haoheliu/AudioLDM), and the identical copies tango vendors.

Checkpoint. ``audioldm.latent_diffusion.util`` defines the OpenAI/CompVis checkpoint (variant V1);
``attention`` and ``openaimodel`` rebind it, and ``BasicTransformerBlock``/``AttentionBlock`` force it on
whatever ``use_checkpoint`` says. Unpatched, freezing any parameter of a transformer block makes
``backward()`` raise "One of the differentiated Tensors does not require grad".

Native sampling (``gradpatch.fixes.ldm_sampling``). ``DDIMSampler.sample``/``decode``/
``stochastic_encode`` and ``LatentDiffusion.sample``/``p_sample_loop``/``progressive_denoising``/
``sample_log``/``decode_first_stage``/``encode_first_stage`` (and ``DDPM.sample``/``p_sample_loop``)
take ``cache``/``grad_steps``/``checkpoint_steps``; the decorated loops and steps they reach run
undecorated inside ``cache=False`` calls; a step is one ``p_sample_ddim`` (DDIM) or ``p_sample``
(ancestral) call. ``generate_sample*`` refuse ``cache=False``; ``ema_scope`` is guarded;
``DDIMSampler.register_buffer`` (which moves every buffer to CUDA) follows the model's device, so
sampling works on CPU. Upstream's ``DDPM.sample`` reads ``channels`` before assigning it and raises
``UnboundLocalError`` in every mode; it is patched like its siblings and still raises.

Fingerprints were computed (``python -m gradpatch.fingerprint``) from PyPI audioldm 0.1.1 and from every
commit of haoheliu/AudioLDM and declare-lab/tango touching these files (tango vendors the package three
times: audioldm/, mustango/audioldm/, tango2/audioldm/). Unless noted, a method has one fingerprint
everywhere: audioldm 0.1.1 = haoheliu/AudioLDM@67151c6 (2023-04-10, the last change to ldm.py and
ddpm.py; earlier commits share the sampler hashes) = declare-lab/tango@ceb8bd5 (audioldm/), @bc247dd (mustango/), @6ec558c (tango2/). Tango's
``ddim_sampling`` passes ``leave=False`` to tqdm (its own hash); AudioLDM's git HEAD (4054cb4,
2025-06-25, unreleased) moved ``register_buffer`` to the model's device itself: "fixed upstream".
Tested against PyPI audioldm 0.1.1; tango's copies share every other hash and the unwrapping fix does
not depend on the tqdm call.
"""
from ._families import checkpoint_family
from ._ldm import DEVICE, EMA, ENTRY, INNER, REFUSE, STEP_BY_INDEX, STEP_BY_TIMESTEP, ldm_sampling

PATCHES = checkpoint_family("audioldm", "audioldm.latent_diffusion.util", {
    # Same bytes in every commit of haoheliu/AudioLDM (ce91b11d, 2023-01-29, onwards; before that at
    # audioldm/model/latent_diffusion/util.py), in PyPI audioldm 0.1.1 and in declare-lab/tango's
    # audioldm/, mustango/audioldm/ and tango2/audioldm/ (ceb8bd5f, bc247ddc, 6ec558ca).
    "78fc3e61f1317c31": "V1 · audioldm 0.1.1 = haoheliu/AudioLDM@ce91b11d = declare-lab/tango@ceb8bd5f",
}, requires="audioldm<1")

_DDIM = "audioldm.latent_diffusion.ddim:DDIMSampler"
_DDPM = "audioldm.latent_diffusion.ddpm:DDPM"
_LDM = "audioldm.ldm:LatentDiffusion"
_PYPI = "audioldm 0.1.1 = haoheliu/AudioLDM@67151c6 = declare-lab/tango (3 copies)"
_TANGO = "declare-lab/tango@ceb8bd5 audioldm/, @bc247dd mustango/audioldm/, @6ec558c tango2/audioldm/ (tqdm leave=False)"

PATCHES += ldm_sampling("audioldm", [
    (f"{_DDIM}.register_buffer", DEVICE, {"890b0198f7cc2775": _PYPI},
     {"b9d2a5ec0550e9a1": "haoheliu/AudioLDM@4054cb4 (2025-06-25, unreleased): moves to self.model.device"}),
    (f"{_DDIM}.sample", ENTRY, {"81cd664aac1147ea": _PYPI}),
    (f"{_DDIM}.decode", ENTRY, {"eb20bc6d347a0d73": _PYPI}),
    (f"{_DDIM}.stochastic_encode", ENTRY, {"56620495bcdadd57": _PYPI}),
    (f"{_DDIM}.ddim_sampling", INNER, {"3dc729d70dfed2bf": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4",
                                       "56696c323a52dcfc": _TANGO}),
    (f"{_DDIM}.p_sample_ddim", STEP_BY_INDEX, {"7a771e2410f3352b": _PYPI}),
    (f"{_DDPM}.sample", ENTRY, {"65121dff17f0534d": _PYPI}),
    (f"{_DDPM}.p_sample_loop", ENTRY, {"e3bcd5dbeee5d564": _PYPI}),
    (f"{_DDPM}.p_sample", STEP_BY_TIMESTEP, {"55d951dfc17ebc2a": _PYPI}),
    (f"{_DDPM}.ema_scope", EMA, {"516818d47320aa7d": _PYPI}),
    (f"{_LDM}.sample", ENTRY, {"3480a2d7a886028b": _PYPI}),
    (f"{_LDM}.p_sample_loop", ENTRY, {"a5521aa3be654c4a": _PYPI}),
    (f"{_LDM}.progressive_denoising", ENTRY, {"e33ecb5c31e60221": _PYPI}),
    (f"{_LDM}.sample_log", ENTRY, {"4ad859a7a3178e04": _PYPI}),
    (f"{_LDM}.decode_first_stage", ENTRY, {"52a5254b04e9b09b": _PYPI}),
    (f"{_LDM}.encode_first_stage", ENTRY, {"70a353ecaa2bb405": _PYPI}),
    (f"{_LDM}.get_input", INNER, {"3c35a123bd019eb1": _PYPI}),
    (f"{_LDM}.p_sample", STEP_BY_TIMESTEP, {"e196f815c8789b72": _PYPI}),
    (f"{_LDM}.generate_sample", REFUSE, {"81ef16b0e6bff025": _PYPI,
                                         "fab3ebfebeb65993": "haoheliu/AudioLDM@aec8adc, 89e38d8 (2023-02-25)",
                                         "faeeadfe78c3a0fe": "haoheliu/AudioLDM@c8244f6, d2cd73d (2023-02-02)"}),
    (f"{_LDM}.generate_sample_masked", REFUSE, {"ed99071f34ec696f": _PYPI}),
], requires="audioldm<1")
