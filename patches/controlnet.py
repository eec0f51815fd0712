"""ControlNet's own package ``cldm`` (GitHub lllyasviel/ControlNet only; its ``ldm`` copy is SD2's and is
declared in :mod:`gradpatch.patches.ldm`).

``cldm.cldm.ControlLDM`` (a ``LatentDiffusion`` whose ``apply_model`` runs the control network and the
locked UNet) decorates ``sample_log``, ``get_input``, ``get_unconditional_conditioning`` and
``log_images``; ``cldm.ddim_hacked.DDIMSampler`` (what ``sample_log`` and the demos use) is SD2's
sampler with a hacked ``p_sample_ddim`` (guidance by two ``apply_model`` calls) and ``encode``, and a
``register_buffer`` that moves every buffer to CUDA. The same fixes as for ``ldm``
(``gradpatch.sampling.ldm``): ``sample_log``/``DDIMSampler.sample``/... take ``cache=False``,
``grad_steps``, ``checkpoint_steps``; a step is one ``p_sample_ddim``; only ``apply_model`` (control
network included) is recomputed; the buffers follow the model's device.

Fingerprints from lllyasviel/ControlNet@ed85cd1 (``cldm/`` last changed at 2d12a1b). No installable
package carries ``cldm``: ``DDIMSampler.sample``, ``ddim_sampling``, ``decode`` and
``stochastic_encode`` equal stable-diffusion-sdkit 2.1.5's (tested there); ``p_sample_ddim``,
``encode`` and the ``ControlLDM`` methods are hashes of their own, with the roles and arguments of
their ``ldm`` counterparts, not tested here.
"""
from ._ldm import DEVICE, ENTRY, INNER, STEP_BY_INDEX, ldm_sampling

_DDIM, _CLDM = "cldm.ddim_hacked:DDIMSampler", "cldm.cldm:ControlLDM"
_CN = "lllyasviel/ControlNet@ed85cd1"
_SD = f"{_CN} = stable-diffusion-sdkit 2.1.5"

PATCHES = ldm_sampling("controlnet", [
    (f"{_DDIM}.register_buffer", DEVICE, {"890b0198f7cc2775": f"{_CN} = CompVis/stable-diffusion@21f890f"}),
    (f"{_DDIM}.sample", ENTRY, {"fbd4c5b88ce267f0": _SD}),
    (f"{_DDIM}.encode", ENTRY, {"bf3de183dca5fec9": _CN}),
    (f"{_DDIM}.decode", ENTRY, {"6151b2dde2ccd6a0": f"{_CN} = audioldm2 0.1.0"}),
    (f"{_DDIM}.stochastic_encode", ENTRY, {"b556a97de0174ae3": _SD}),
    (f"{_DDIM}.ddim_sampling", INNER, {"88300a195ac38551": _SD}),
    (f"{_DDIM}.p_sample_ddim", STEP_BY_INDEX, {"e0e7187123aa0c31": _CN}),
    (f"{_CLDM}.sample_log", ENTRY, {"1fd0ffa50de1ae99": _CN}),
    (f"{_CLDM}.get_input", INNER, {"11b4d37b8a71569b": _CN}),
    (f"{_CLDM}.get_unconditional_conditioning", INNER, {"6c81c8fcc23aae22": _CN}),
    (f"{_CLDM}.log_images", INNER, {"c5aaf17787e529ee": _CN}),
])
