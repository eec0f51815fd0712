"""The families of code copied into many codebases, and declaration helpers (no logic, no torch)."""
from __future__ import annotations

from typing import Mapping

from gradpatch.patching.families import AutogradFunctionShape, Family, FunctionShape, Member
from gradpatch.patching.fingerprint import IsObject
from gradpatch.patching.registry import Patch

_FIX = "gradpatch.checkpointing.checkpoint"
_SUMMARY = "fixed checkpoint: frozen params, None inputs, dropout RNG, autocast, double backward"
_PAIR = ("checkpoint", "CheckpointFunction")
_MIXED = _PAIR + ("mixed_checkpoint", "MixedCheckpointFunction")

#: The OpenAI/CompVis gradient checkpoint (guided-diffusion's ``nn.py``), copied into AudioLDM,
#: latent/stable diffusion, sgm, ComfyUI and hundreds of research repositories, often as
#: ``util.py``. ``checkpoint`` is replaced (and every module that did ``from ... import
#: checkpoint`` rebound) so the policy and the no-grad fast path apply; ``CheckpointFunction`` too,
#: because upstream looks it up in its module globals at call time, which fixes callers still
#: holding the original function. sgm adds ``mixed_checkpoint`` (dict inputs), whose
#: ``MixedCheckpointFunction`` is only reached through it.
CHECKPOINT = Family(
    "openai_checkpoint",
    members=(
        Member("checkpoint", FunctionShape(("func", "inputs", "params", "flag")),
               f"{_FIX}:replace_checkpoint", _SUMMARY),
        Member("CheckpointFunction", AutogradFunctionShape(("ctx", "run_function", "length")),
               f"{_FIX}:replace_checkpoint_function", _SUMMARY, marks_copy=True),
        Member("mixed_checkpoint", FunctionShape(("func", "inputs", "params", "flag")),
               f"{_FIX}:replace_mixed_checkpoint", "fixed mixed_checkpoint (dict inputs)"),
        Member("MixedCheckpointFunction", AutogradFunctionShape(
            ("ctx", "run_function", "length_tensors", "length_non_tensors", "tensor_keys", "non_tensor_keys")),
            marks_copy=True),
    ),
    fingerprints=(
        # Every version the catalogue's declared paths name (patches/*.py say where each came from).
        (_MIXED, {"280d31d70068a93a": "V2+M (sgm, generative-models)"}),
        (_PAIR, {
            "78fc3e61f1317c31": "V1 (OpenAI/CompVis: audioldm, audioldm2, ldm SD1, guided/improved-diffusion)",
            "929fce4a31ca8b21": "V2 (V1 + CUDA autocast replay: SD2, ControlNet, ComfyUI)",
            "f4a39d1f50f6fc11": "V3 (saved tensors, filters frozen parameters: guided-diffusion-sdk)",
        }),
    ),
)

FAMILIES = [CHECKPOINT]


def checkpoint_family(upstream: str, module: str, known: Mapping[str, str], *,
                      requires: str | None = None, mixed: bool = False) -> list[Patch]:
    """The :data:`CHECKPOINT` family's patches for ``module``, a path where ``upstream`` is known
    to define it, recognised by the fingerprints ``known`` (with their provenance); ``mixed`` adds
    sgm's ``mixed_checkpoint``. Fingerprints cover all the definitions."""
    return CHECKPOINT.patches(upstream, module, known, over=_MIXED if mixed else _PAIR, requires=requires)


def torch_checkpoint_default(name: str, upstream: str, module: str, provenance: str) -> Patch:
    """``module`` bound ``torch.utils.checkpoint.checkpoint`` and calls it without ``use_reentrant``:
    its calls become non-reentrant (torch's default elsewhere in the program is unchanged)."""
    return Patch(name, f"{module}:checkpoint",
                 f"{_FIX}:replace_torch_checkpoint",
                 IsObject("torch.utils.checkpoint:checkpoint", provenance), upstream,
                 "torch checkpoint made non-reentrant: gradients reach parameters when no input requires grad")
