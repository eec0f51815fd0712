"""stable-audio-tools (PyPI ``stable-audio-tools``; GitHub Stability-AI/stable-audio-tools): its
samplers cannot be differentiated.

* 0.0.19: ``stable_audio_tools.inference.sampling.sample_discrete_euler``, ``sample_rk4``,
  ``sample_flow_dpmpp``, ``sample_flow_pingpong`` and ``sample`` (v-diffusion DDIM) are
  ``@torch.no_grad()``; ``sample_k`` calls ``k_diffusion.sampling`` (``patches/k_diffusion.py``).
* 0.0.20: ``sample_diffusion`` is ``@torch.no_grad()`` and calls the module's own (undecorated) RF and
  v samplers, or, for k-diffusion sampler types, the samplers of the vendored
  ``stable_audio_tools.inference.k_diffusion.sampling`` (9 of k-diffusion's, all ``@torch.no_grad()``,
  same fingerprints as k-diffusion 0.1.1.post1), which are patched too.

The fix is k-diffusion's (``gradpatch/sampling/families/functions.py``): ``cache=True`` (the original),
``cache=False``, ``grad_steps=K`` (RK4: four evaluations per step), ``checkpoint_steps=True``. Inside
``sample_diffusion(cache=False)``, the vendored samplers follow its options and count the steps; for
those sampler types the unit under ``no_grad`` or checkpointed is their denoiser, ``VDenoiser(model)``. Without
the patch, ``sample_diffusion(..., cache=False)`` would pass ``cache`` on to the model silently.
The samplers ``sample_diffusion`` calls in its module are not part of its fingerprint: their step loops
are checked as they run (an evaluation outside the loop, or a second loop, raises under ``grad_steps``).
Decoding (``decode=True`` with a pretransform) stays differentiable: the autoencoder's
weights are frozen unless the pretransform was built with ``enable_grad=True``. ``cond_fn`` guidance
(``make_cond_model_fn``) detaches the denoiser's output by design.

AudioX (GitHub ZeyueT/AudioX, distribution ``AudioX``) installs its copy of the early sampling module *as*
``stable_audio_tools``: its ``sample_discrete_euler`` and ``sample`` (ThinkSound's, ``patches/thinksound.py``)
are recognised here by their fingerprints (no stable-audio-tools distribution: the fingerprint decides);
it defines none of 0.0.19's other samplers, whose patches are then skipped.

0.0.20 declares Python < 3.11 and pins torch 2.7.1; both releases import and run on Python 3.11 with
current torch when installed with ``--no-deps``.
"""
from __future__ import annotations

from gradpatch.patching.fingerprint import Fingerprints, has_parameter
from gradpatch.patching.patch import Patch

from .k_diffusion import k_diffusion_samplers

_FIX = "gradpatch.sampling.families.functions:fixed_step_sampler"
_MODULE = "stable_audio_tools.inference.sampling"
_DIST = "stable-audio-tools"
# 0.0.20 kept the names of 0.0.19's samplers but dropped their decorators: the ranges keep those (and
# the absent ``sample``) out of 0.0.20's report instead of warning that they are unknown.
_OWN, _UNIFIED = f"{_DIST}<0.0.20", f"{_DIST}>=0.0.20"

OWN_SAMPLERS = {  # 0.0.19
    "sample_discrete_euler": "92f7a6392f3eb022",
    "sample_rk4": "cbf86ce855fb3570",
    "sample_flow_dpmpp": "0e2045eaba227455",
    "sample_flow_pingpong": "9f3472baabfd2802",
    "sample": "571ca2fe28b532ae",
}
VENDORED = ["sample_heun", "sample_dpm_2", "sample_lms", "sample_dpm_fast", "sample_dpm_adaptive",
            "sample_dpmpp_2s_ancestral", "sample_dpmpp_2m", "sample_dpmpp_2m_sde", "sample_dpmpp_3m_sde"]

AUDIOX = {  # ZeyueT/AudioX stable_audio_tools/inference/sampling.py, git 1bf5691 (2025-04-03) to ca179cc
    "sample_discrete_euler": "2d571fb5ea424c4e",
    "sample": "de7672e3f6585259",
}
_AUDIOX = "AudioX git 1bf5691 (2025-04-03) to ca179cc (2025-04-17) · GitHub ZeyueT/AudioX"

PATCHES = [
    *(Patch(f"stable_audio_tools.{name}", f"{_MODULE}:{name}", _FIX,
            Fingerprints({digest: "stable-audio-tools 0.0.19 · PyPI stable-audio-tools 0.0.19",
                          **({AUDIOX[name]: _AUDIOX} if name in AUDIOX else {})},
                         fixed_if=has_parameter("cache")),
            "stable_audio_tools", f"{name}(cache=False): gradients through the sampler; grad_steps, "
                                  "checkpoint_steps", _OWN)
      for name, digest in OWN_SAMPLERS.items()),
    Patch("stable_audio_tools.sample_diffusion", f"{_MODULE}:sample_diffusion", _FIX,
          Fingerprints({"d628b9e652fa82fb": "stable-audio-tools 0.0.20 · PyPI stable-audio-tools 0.0.20"},
                       fixed_if=has_parameter("cache")),
          "stable_audio_tools", "sample_diffusion(cache=False): gradients through every sampler type; "
                                "grad_steps, checkpoint_steps", _UNIFIED),
    *k_diffusion_samplers("stable_audio_tools", "stable_audio_tools.inference.k_diffusion.sampling", VENDORED,
                          dict.fromkeys(VENDORED, _UNIFIED), prefix="k_diffusion."),
]
