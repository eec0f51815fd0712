"""ControlNet's own package ``cldm`` (GitHub lllyasviel/ControlNet only; its ``ldm`` copy is SD2's and is
declared in :mod:`gradpatch.patches.ldm`).

``cldm.cldm.ControlLDM`` (a ``LatentDiffusion`` whose ``apply_model`` runs the control network and the
locked UNet) decorates ``sample_log``, ``get_input``, ``get_unconditional_conditioning`` and
``log_images``; ``cldm.ddim_hacked.DDIMSampler`` (what ``sample_log`` and the demos use) is SD2's
sampler with a hacked ``p_sample_ddim`` (guidance by two ``apply_model`` calls) and ``encode``, and a
``register_buffer`` that moves every buffer to CUDA. The same fixes as for ``ldm``
(``gradpatch.sampling.families.ldm``): ``sample_log``/``DDIMSampler.sample``/... take ``cache=False``,
``grad_steps``, ``checkpoint_steps``; a step is one ``p_sample_ddim``; only ``apply_model`` (control
network included) is recomputed; the buffers follow the model's device.

Fingerprints from lllyasviel/ControlNet@ed85cd1 (``cldm/`` last changed at 2d12a1b). No installable
package carries ``cldm``: ``DDIMSampler.sample``, ``ddim_sampling``, ``decode`` and
``stochastic_encode`` equal stable-diffusion-sdkit 2.1.5's (tested there); ``p_sample_ddim``,
``encode`` and the ``ControlLDM`` methods are hashes of their own, with the roles and arguments of
their ``ldm`` counterparts, not tested here.
"""
from ._ldm import ldm_sampling

_M = "cldm"
PATCHES = ldm_sampling("controlnet", {
    f"{_M}.ddim_hacked:DDIMSampler":
        "register_buffer sample encode decode stochastic_encode ddim_sampling p_sample_ddim",
    f"{_M}.cldm:ControlLDM": "sample_log get_input get_unconditional_conditioning log_images",
})
