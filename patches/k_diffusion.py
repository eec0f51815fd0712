"""k-diffusion (PyPI ``k-diffusion``; GitHub crowsonkb/k-diffusion): the ``sample_*`` functions of
``k_diffusion.sampling`` cannot be differentiated.

Every sampler is decorated with ``@torch.no_grad()``; the bodies themselves differentiate (the
denoiser is the ``model`` argument, called as ``model(x, sigma * s_in, **extra_args)``). The fix
(``gradpatch/fixes/function_sampler.py``) adds, keyword-only, ``cache=True`` (the original function),
``cache=False`` (the undecorated body with gradients on), ``grad_steps=K`` (the last K iterations of
the step loop build a graph; Heun, DPM-2, DPM-2 ancestral, DPM++ 2S ancestral and DPM++ SDE evaluate
the denoiser twice per step) and ``checkpoint_steps=True``. ``sample_dpm_fast`` and
``sample_dpm_adaptive`` choose their steps as they go: ``cache`` and ``checkpoint_steps`` only;
``grad_steps`` raises ValueError. ``log_likelihood`` is not a sampler and is left alone.

Recognition is by the fingerprint of each function. k-diffusion 0.1.1.post1 (PyPI) and the copy
stable-audio-tools 0.0.20 vendors as ``stable_audio_tools.inference.k_diffusion.sampling`` (9 of the
13 samplers, declared in ``patches/stable_audio_tools.py``) hash alike. Importing ``k_diffusion``
needs ``pkg_resources`` (its dependency clip-anytorch imports it): setuptools < 81.
"""
from __future__ import annotations

from gradpatch.fingerprint import Fingerprints, has_parameter
from gradpatch.registry import Patch

_FIX = "gradpatch.fixes.function_sampler"

SAMPLERS = {  # name -> fingerprint of the decorated function in k-diffusion 0.1.1.post1
    "sample_euler": "fef165ba8653872b",
    "sample_euler_ancestral": "4ed37b6fc19cf5eb",
    "sample_heun": "b607e9138a180fbb",
    "sample_dpm_2": "4c452d57d5945221",
    "sample_dpm_2_ancestral": "4674908552b16fb4",
    "sample_lms": "f7db9d290006835a",
    "sample_dpm_fast": "e19e035f4a695e2b",
    "sample_dpm_adaptive": "3873f404b2301a6b",
    "sample_dpmpp_2s_ancestral": "02fac56c796c84ed",
    "sample_dpmpp_sde": "3f1638295761e1f3",
    "sample_dpmpp_2m": "777ab9f6a51029bf",
    "sample_dpmpp_2m_sde": "ffc174e48b37ef1a",
    "sample_dpmpp_3m_sde": "223bf4e00a59b96c",
}
ADAPTIVE = frozenset({"sample_dpm_fast", "sample_dpm_adaptive"})
PROVENANCE = "k-diffusion 0.1.1 · PyPI k-diffusion 0.1.1.post1; stable-audio-tools 0.0.20 (vendored)"


def k_diffusion_samplers(upstream: str, module: str, names: list[str], requires: str | None,
                         prefix: str = "") -> list[Patch]:
    """One patch per sampler function ``names`` of ``module`` (a copy of ``k_diffusion.sampling``)."""
    return [
        Patch(f"{upstream}.{prefix}{name}", f"{module}:{name}",
              f"{_FIX}:{'adaptive_sampler' if name in ADAPTIVE else 'fixed_step_sampler'}",
              Fingerprints({SAMPLERS[name]: PROVENANCE}, fixed_if=has_parameter("cache")), upstream,
              f"{name}(cache=False): gradients through the sampler; "
              + ("checkpoint_steps (adaptive: no grad_steps)" if name in ADAPTIVE else "grad_steps, checkpoint_steps"),
              requires)
        for name in names
    ]


PATCHES = k_diffusion_samplers("k_diffusion", "k_diffusion.sampling", list(SAMPLERS), "k-diffusion")
