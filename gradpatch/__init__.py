"""gradpatch: make gradients flow through other people's diffusion code.

Upstream diffusion code breaks gradient flow in a few well-known ways: the OpenAI/CompVis
``checkpoint(func, inputs, params, flag)`` copied into AudioLDM, Stable Diffusion and many more (fails
on frozen parameters, silently wrong with dropout, autocast and double backward), samplers wrapped in
``@torch.no_grad()`` (F5-TTS, E2-TTS, diffusers pipelines), and reentrant ``torch.utils.checkpoint``
defaults. gradpatch recognises that code when it is imported and swaps in fixed versions, without
editing any upstream file::

    import gradpatch
    gradpatch.apply()              # or apply("audioldm"), apply(exclude=["diffusers"])
    import audioldm                # patched the moment it is imported
    print(gradpatch.report())      # what was applied, deferred, skipped or failed, and why
    gradpatch.revert()             # everything back exactly as it was

or, with no code change: ``GRADPATCH=1 python train.py`` (also reaches torchrun, accelerate and
DataLoader workers), ``gradpatch run -- CMD``, or ``import gradpatch.auto``.

Importing gradpatch does not import torch or any target; everything below is loaded on first use.
"""
from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # spares importing typing: this module is imported at interpreter start

__version__ = "0.1.0"

_EXPORTS = {
    "apply": "gradpatch.activation",
    "revert": "gradpatch.activation",
    "applied": "gradpatch.activation",
    "report": "gradpatch.activation",
    "known_patches": "gradpatch.activation",
    "Patch": "gradpatch.registry",
    "Record": "gradpatch.registry",
    "Report": "gradpatch.registry",
    "Status": "gradpatch.registry",
    "set_checkpoint_policy": "gradpatch.settings",
    "checkpoint_policy_scope": "gradpatch.settings",
    "GradpatchError": "gradpatch.errors",
    "GradpatchWarning": "gradpatch.errors",
    "ConfigWarning": "gradpatch.errors",
    "UnknownCodeWarning": "gradpatch.errors",
    "PatchFailedWarning": "gradpatch.errors",
    "RevertWarning": "gradpatch.errors",
    "StartupWarning": "gradpatch.errors",
    "checkpoint": "gradpatch.fixes.checkpoint",  # these import torch
    "checkpoint_plan": "gradpatch.fixes.checkpoint_budget",
    "trainable": "gradpatch.selective",
    "explain_grads": "gradpatch.doctor",
    "grad_doctor": "gradpatch.doctor",
    "TrainableSummary": "gradpatch.selective",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from gradpatch.activation import applied, apply, known_patches, report, revert
    from gradpatch.errors import (ConfigWarning, GradpatchError, GradpatchWarning, PatchFailedWarning,
                                  RevertWarning, StartupWarning, UnknownCodeWarning)
    from gradpatch.fixes.checkpoint import checkpoint
    from gradpatch.fixes.checkpoint_budget import checkpoint_plan
    from gradpatch.registry import Patch, Record, Report, Status
    from gradpatch.doctor import explain_grads, grad_doctor
    from gradpatch.selective import TrainableSummary, trainable
    from gradpatch.settings import checkpoint_policy_scope, set_checkpoint_policy


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gradpatch' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _warn_if_startup_file_missing() -> None:
    if os.environ.get("GRADPATCH", "").strip() in ("", "0"):
        return
    if not sys.flags.no_site and any(os.path.isfile(os.path.join(entry, "gradpatch.pth"))
                                     for entry in sys.path if entry):
        return
    from gradpatch.errors import StartupWarning, complain

    complain(StartupWarning, "gradpatch: GRADPATCH is set but gradpatch's startup file (gradpatch.pth) "
             "is not installed in this environment, so new Python processes are not patched "
             "automatically. Reinstall gradpatch with pip, or call gradpatch.apply() / "
             "`import gradpatch.auto` in your program.")


_warn_if_startup_file_missing()
