"""AudioLDM (PyPI ``audioldm``; GitHub haoheliu/AudioLDM), and the identical copies tango vendors.

Checkpoint. ``audioldm.latent_diffusion.util`` defines the OpenAI/CompVis checkpoint (variant V1);
``attention`` and ``openaimodel`` rebind it, and ``BasicTransformerBlock``/``AttentionBlock`` force it on
whatever ``use_checkpoint`` says. Unpatched, freezing any parameter of a transformer block makes
``backward()`` raise "One of the differentiated Tensors does not require grad".

Native sampling (``gradpatch.sampling.ldm``). ``DDIMSampler.sample``/``decode``/
``stochastic_encode`` and ``LatentDiffusion.sample``/``p_sample_loop``/``progressive_denoising``/
``sample_log``/``decode_first_stage``/``encode_first_stage`` (and ``DDPM.sample``/``p_sample_loop``)
take ``cache``/``grad_steps``/``checkpoint_steps``; the decorated loops and steps they reach run
undecorated inside ``cache=False`` calls; a step is one ``p_sample_ddim`` (DDIM) or ``p_sample``
(ancestral) call. ``generate_sample*`` refuse ``cache=False``; ``ema_scope`` is guarded;
``DDIMSampler.register_buffer`` (which moves every buffer to CUDA) follows the model's device, so
sampling works on CPU. Upstream's ``DDPM.sample`` reads ``channels`` before assigning it and raises
``UnboundLocalError`` in every mode; it is patched like its siblings and still raises.

Fingerprints were computed (``python -m gradpatch.patching.fingerprint``) from PyPI audioldm 0.1.1 and from every
commit of haoheliu/AudioLDM (0d68895, 2023-01-30, to HEAD 4054cb4, 2025-06-25) and declare-lab/tango
(which vendors the package three times: @ceb8bd5 audioldm/, @bc247dd mustango/audioldm/, @6ec558c
tango2/audioldm/). Each label names the commit range over which a hash holds. PyPI audioldm 0.1.1 and
the three tango copies have the hash current at HEAD for every method except two: tango's
``ddim_sampling`` passes ``leave=False`` to tqdm (its own hash, same fix), and HEAD's
``register_buffer`` (unreleased) moves buffers to the model's device itself ("fixed upstream").
Tested against PyPI audioldm 0.1.1.
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
_PYPI = "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4 (HEAD) = declare-lab/tango (3 copies)"
_PYPI_LDM = "audioldm 0.1.1 = haoheliu/AudioLDM@e7665a0..4054cb4 (HEAD) = declare-lab/tango (3 copies)"
_TANGO = ("declare-lab/tango@ceb8bd5 audioldm/, @bc247dd mustango/audioldm/, @6ec558c tango2/audioldm/ "
          "(tqdm leave=False)")

PATCHES += ldm_sampling("audioldm", [
    (f"{_DDIM}.register_buffer", DEVICE, {"890b0198f7cc2775": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..8e7e477 "
                                                              "= declare-lab/tango (3 copies)"},
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
    (f"{_LDM}.sample", ENTRY, {"3480a2d7a886028b": _PYPI_LDM}),
    (f"{_LDM}.p_sample_loop", ENTRY, {"a5521aa3be654c4a": _PYPI_LDM}),
    (f"{_LDM}.progressive_denoising", ENTRY, {"e33ecb5c31e60221": _PYPI_LDM}),
    (f"{_LDM}.sample_log", ENTRY, {"4ad859a7a3178e04": _PYPI_LDM}),
    (f"{_LDM}.decode_first_stage", ENTRY, {"52a5254b04e9b09b": _PYPI_LDM}),
    (f"{_LDM}.encode_first_stage", ENTRY, {"70a353ecaa2bb405": _PYPI_LDM}),
    (f"{_LDM}.get_input", INNER, {"3c35a123bd019eb1": _PYPI_LDM}),
    (f"{_LDM}.p_sample", STEP_BY_TIMESTEP, {"e196f815c8789b72": _PYPI_LDM}),
    (f"{_LDM}.generate_sample", REFUSE, {
        "81ef16b0e6bff025": "audioldm 0.1.1 = haoheliu/AudioLDM@7ec3062..4054cb4 = declare-lab/tango (3 copies)",
        "fab3ebfebeb65993": "haoheliu/AudioLDM@aec8adc..fd21faf (2023-02-25..03-01)",
        "faeeadfe78c3a0fe": "haoheliu/AudioLDM@c8244f6..aee27ee (2023-02-02..02-23)",
        "1a06a0aea99afeb5": "haoheliu/AudioLDM@e7665a0..73f1e9c (2023-01-30; saves files)"}),
    (f"{_LDM}.generate_sample_masked", REFUSE, {
        "ed99071f34ec696f": "audioldm 0.1.1 = haoheliu/AudioLDM@89e38d8..4054cb4 = declare-lab/tango (3 copies)"}),
], requires="audioldm<1")
