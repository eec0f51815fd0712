"""Declaration helpers for code copied into many codebases (no logic, no torch)."""
from __future__ import annotations

from typing import Mapping

from gradpatch.fingerprint import Fingerprints, IsObject
from gradpatch.registry import Patch

_FIX = "gradpatch.fixes.checkpoint"


def checkpoint_family(upstream: str, module: str, known: Mapping[str, str], *,
                      requires: str | None = None, mixed: bool = False) -> list[Patch]:
    """The OpenAI/CompVis ``checkpoint`` + ``CheckpointFunction`` pair defined in ``module``.

    ``checkpoint`` is replaced (and every module that did ``from ... import checkpoint`` rebound) so
    the policy and the no-grad fast path apply; ``CheckpointFunction`` too, because upstream looks it up
    in its module globals at call time, which fixes callers still holding the original function.
    ``mixed`` adds sgm's ``mixed_checkpoint`` (dict inputs). Fingerprints cover all the definitions.
    """
    names = ("checkpoint", "CheckpointFunction") + (("mixed_checkpoint", "MixedCheckpointFunction") if mixed else ())
    recognise = Fingerprints(dict(known), over=names)
    summary = "fixed checkpoint: frozen params, None inputs, dropout RNG, autocast, double backward"
    patches = [
        Patch(f"{upstream}.checkpoint", f"{module}:checkpoint", f"{_FIX}:replace_checkpoint",
              recognise, upstream, summary, requires),
        Patch(f"{upstream}.CheckpointFunction", f"{module}:CheckpointFunction",
              f"{_FIX}:replace_checkpoint_function", recognise, upstream, summary, requires),
    ]
    if mixed:
        patches.append(Patch(f"{upstream}.mixed_checkpoint", f"{module}:mixed_checkpoint",
                             f"{_FIX}:replace_mixed_checkpoint", recognise, upstream,
                             "fixed mixed_checkpoint (dict inputs)", requires))
    return patches


def torch_checkpoint_default(name: str, upstream: str, module: str, provenance: str) -> Patch:
    """``module`` bound ``torch.utils.checkpoint.checkpoint`` and calls it without ``use_reentrant``:
    its calls become non-reentrant (torch's default elsewhere in the program is unchanged)."""
    return Patch(name, f"{module}:checkpoint",
                 f"{_FIX}:replace_torch_checkpoint",
                 IsObject("torch.utils.checkpoint:checkpoint", provenance), upstream,
                 "torch checkpoint made non-reentrant: gradients reach parameters when no input requires grad")
