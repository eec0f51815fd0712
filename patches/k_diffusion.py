"""k-diffusion (PyPI ``k-diffusion``; GitHub crowsonkb/k-diffusion): the ``sample_*`` functions of
``k_diffusion.sampling`` cannot be differentiated.

Every sampler is decorated with ``@torch.no_grad()``; the bodies themselves differentiate (the
denoiser is the ``model`` argument, called as ``model(x, sigma * s_in, **extra_args)``). The fix
(``gradpatch/sampling/families/functions.py``) adds, keyword-only, ``cache=True`` (the original function),
``cache=False`` (the undecorated body with gradients on), ``grad_steps=K`` (the last K iterations of
the step loop build a graph; Heun, DPM-2, DPM-2 ancestral, DPM++ 2S ancestral and DPM++ SDE evaluate
the denoiser twice per step) and ``checkpoint_steps=True``. ``sample_dpm_fast`` and
``sample_dpm_adaptive`` choose their steps as they go: ``cache`` and ``checkpoint_steps`` only;
``grad_steps`` raises ValueError. ``log_likelihood`` is not a sampler and is left alone.

Recognition is by the fingerprint of each function: every PyPI release (0.0.3 to 0.1.1.post1; 0.0.16
on share one set), and the copy stable-audio-tools 0.0.20 vendors as
``stable_audio_tools.inference.k_diffusion.sampling`` (9 of the 13 samplers, declared in
``patches/stable_audio_tools.py``), which hashes as 0.1.1.post1. GitHub trees with changed samplers
(crowsonkb/k-diffusion@0c72379: a ``decorate_sigma_hat`` parameter on Euler, Heun and DPM-2) are
unknown code until fingerprinted. ComfyUI's ``comfy.k_diffusion.sampling`` is a different copy, not
installable to test against, and is not declared. Importing ``k_diffusion`` needs ``pkg_resources``
(its dependency clip-anytorch imports it): setuptools < 81.
"""
from __future__ import annotations

from gradpatch.patching.fingerprint import Fingerprints, has_parameter
from gradpatch.patching.patch import Patch

_FIX = "gradpatch.sampling.families.functions"

_VENDORED = "; stable-audio-tools 0.0.20 (vendored)"
_LATEST = "0.0.16–0.1.1.post1"

KNOWN = {  # sampler -> {fingerprint: the PyPI releases whose function it is}; every release 0.0.3 on
    "sample_euler": {"fef165ba8653872b": "0.0.3–0.1.1.post1"},
    "sample_euler_ancestral": {"b4b846305fe684e4": "0.0.3–0.0.10", "4ed37b6fc19cf5eb": "0.0.11–0.1.1.post1"},
    "sample_heun": {"b607e9138a180fbb": "0.0.3–0.1.1.post1" + _VENDORED},
    "sample_dpm_2": {"4c452d57d5945221": "0.0.3–0.1.1.post1" + _VENDORED},
    "sample_dpm_2_ancestral": {"d1328245d1d57161": "0.0.3–0.0.10", "4674908552b16fb4": "0.0.11–0.1.1.post1"},
    "sample_lms": {"f7db9d290006835a": "0.0.3–0.1.1.post1" + _VENDORED},
    "sample_dpm_fast": {"0a66dfc67635efa8": "0.0.3–0.0.5", "d5198d0d199f395e": "0.0.6–0.0.10",
                        "e19e035f4a695e2b": "0.0.11–0.1.1.post1" + _VENDORED},
    "sample_dpm_adaptive": {"2446b2f84776d58f": "0.0.3–0.0.5", "031954baaefb1831": "0.0.6–0.0.7",
                            "ddfaf25b23fa4c76": "0.0.8–0.0.10", "3873f404b2301a6b": "0.0.11–0.1.1.post1" + _VENDORED},
    "sample_dpmpp_2s_ancestral": {"b904bcc77964a265": "0.0.10", "02fac56c796c84ed": "0.0.11–0.1.1.post1" + _VENDORED},
    "sample_dpmpp_2m": {"777ab9f6a51029bf": "0.0.10–0.1.1.post1" + _VENDORED},
    "sample_dpmpp_sde": {"3f1638295761e1f3": "0.0.11–0.1.1.post1"},
    "sample_dpmpp_2m_sde": {"3091a588576d0e39": "0.0.15", "ffc174e48b37ef1a": _LATEST + _VENDORED},
    "sample_dpmpp_3m_sde": {"223bf4e00a59b96c": _LATEST + _VENDORED},
}
SINCE = {"sample_dpmpp_2s_ancestral": "0.0.10", "sample_dpmpp_2m": "0.0.10", "sample_dpmpp_sde": "0.0.11",
         "sample_dpmpp_2m_sde": "0.0.15", "sample_dpmpp_3m_sde": "0.0.16"}
"""The first release defining each newer sampler: older ones are out of that patch's range, not failures."""
ADAPTIVE = frozenset({"sample_dpm_fast", "sample_dpm_adaptive"})


def _label(span: str) -> str:
    versions, _, vendored = span.partition(";")
    return f"k-diffusion {versions} · PyPI k-diffusion {versions}" + (f";{vendored}" if vendored else "")


def k_diffusion_samplers(upstream: str, module: str, names: list[str], requires: dict[str, str | None],
                         prefix: str = "") -> list[Patch]:
    """One patch per sampler function ``names`` of ``module`` (a copy of ``k_diffusion.sampling``);
    ``requires[name]`` is its distribution requirement."""
    return [
        Patch(f"{upstream}.{prefix}{name}", f"{module}:{name}",
              f"{_FIX}:{'adaptive_sampler' if name in ADAPTIVE else 'fixed_step_sampler'}",
              Fingerprints({digest: _label(span) for digest, span in KNOWN[name].items()},
                           fixed_if=has_parameter("cache")), upstream,
              f"{name}(cache=False): gradients through the sampler; "
              + ("checkpoint_steps (adaptive: no grad_steps)" if name in ADAPTIVE else "grad_steps, checkpoint_steps"),
              requires[name])
        for name in names
    ]


PATCHES = k_diffusion_samplers("k_diffusion", "k_diffusion.sampling", list(KNOWN),
                               {name: "k-diffusion" + (f">={SINCE[name]}" if name in SINCE else "") for name in KNOWN})
