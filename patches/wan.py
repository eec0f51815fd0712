"""Wan2.2 (GitHub Wan-Video/Wan2.2, package ``wan``; Wan-Animate and Wan-S2V included): ``generate`` runs its
sampling loop inside a multi-item ``with (torch.amp.autocast(...), torch.no_grad(), no_sync...):``, and
Wan-Animate's motion encoder checkpoints ``enc_motion`` with ``use_reentrant=True`` on face frames that
never require grad (its parameters get no gradient when trained).

``generate(..., cache=False, grad_steps=K, checkpoint_steps=True)`` runs the method with its ``no_grad``
items lifted (:class:`~gradpatch.sampling.lifting.lift.Liftable`: recognised by the fingerprint of the
source its code object points at; autocast and ``no_sync`` stay); a step is the run of denoiser
evaluations (a forward of ``low_noise_model``/``high_noise_model``, ``model`` or ``noise_model``) at one
timestep, ``sampling_steps`` of them (:mod:`gradpatch.sampling.families.wan`). ``Generator.get_motion``
runs with that checkpoint non-reentrant. Fingerprints: every version of the methods in the repository's
history (Wan-Video/Wan2.2@fa96d09, 2025-07-28, to 42bf4cf, 2026-03-17). ``WanT2V.generate`` and
``Generator.get_motion`` are tested on a replica in ``tests/upstream/test_wan_replica.py`` (GitHub only: no
package carries ``wan``); the other ``generate`` methods have the same loop shape (one multi-item ``with``,
denoisers called with ``t=timestep``) and are declared by fingerprint, not replicated.
"""
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch
from gradpatch.sampling.lifting.lift import Liftable

_REPO = "Wan-Video/Wan2.2"
_GENERATE = "gradpatch.sampling.families.wan:generate"
_SUMMARY = "cache=False: gradients through the sampling loop (no_grad lifted); grad_steps, checkpoint_steps"


def _generate(module: str, qualname: str, known: dict[str, str]) -> Patch:
    return Patch(f"wan.{qualname}", f"wan.{module}:{qualname}", _GENERATE, Liftable(known), "wan",
                 f"{qualname}(cache=False): {_SUMMARY}")


PATCHES = [
    _generate("text2video", "WanT2V.generate", {"d675efac63523335": f"{_REPO}@fa96d09 (2025-07-28) to 42bf4cf"}),
    _generate("image2video", "WanI2V.generate", {"4cf367c5c07b043b": f"{_REPO}@fa96d09 (2025-07-28)",
                                                 "4f88e50992115cb1": f"{_REPO}@8691b0d (2025-07-29) to 42bf4cf"}),
    _generate("textimage2video", "WanTI2V.t2v", {"1061cc9d687f24c6": f"{_REPO}@fa96d09 (2025-07-28) to 42bf4cf"}),
    _generate("textimage2video", "WanTI2V.i2v", {"d9582ac37b026b26": f"{_REPO}@fa96d09 (2025-07-28) to 42bf4cf"}),
    _generate("speech2video", "WanS2V.generate", {"70d4325bc3280661": f"{_REPO}@d18200b (2025-08-26)",
                                                  "cf55d1469562ed15": f"{_REPO}@4a5cf46 (2025-09-05) to 42bf4cf"}),
    _generate("animate", "WanAnimate.generate", {"d3e40066146880d3": f"{_REPO}@29d4a35 (2025-09-19) to 42bf4cf"}),
    Patch("wan.Generator.get_motion", "wan.modules.animate.motion_encoder:Generator.get_motion",
          "gradpatch.sampling.families.wan:motion_non_reentrant",
          Fingerprints({"acafb96d29d86c02": f"{_REPO}@29d4a35 (2025-09-19) to 42bf4cf"}), "wan",
          "Wan-Animate motion encoder checkpoint non-reentrant: its parameters get gradients"),
]
