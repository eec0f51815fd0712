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
    gradpatch.adopt("myproject.util:checkpoint", like="audioldm.checkpoint")  # your own copy

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
    "apply": "gradpatch.patching.activation",
    "adopt": "gradpatch.patching.activation",
    "revert": "gradpatch.patching.activation",
    "applied": "gradpatch.patching.activation",
    "report": "gradpatch.patching.activation",
    "known_patches": "gradpatch.patching.activation",
    "Patch": "gradpatch.patching.patch",
    "Record": "gradpatch.patching.patch",
    "Report": "gradpatch.patching.patch",
    "Status": "gradpatch.patching.patch",
    "set_checkpoint_policy": "gradpatch.settings",
    "checkpoint_policy_scope": "gradpatch.settings",
    "GradpatchError": "gradpatch.errors",
    "NotDifferentiableError": "gradpatch.errors",
    "GradpatchWarning": "gradpatch.errors",
    "ConfigWarning": "gradpatch.errors",
    "UnknownCodeWarning": "gradpatch.errors",
    "PatchFailedWarning": "gradpatch.errors",
    "RevertWarning": "gradpatch.errors",
    "StartupWarning": "gradpatch.errors",
    "checkpoint": "gradpatch.checkpointing.checkpoint",  # these import torch
    "checkpoint_plan": "gradpatch.checkpointing.budget",
    "differentiable": "gradpatch.sampling.generic.any_sampler",
    "trainable": "gradpatch.selective",
    "explain_grads": "gradpatch.doctor",
    "grad_doctor": "gradpatch.doctor",
    "TrainableSummary": "gradpatch.selective",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from types import FrameType

    from gradpatch.patching.activation import adopt, applied, apply, known_patches, report, revert
    from gradpatch.errors import (ConfigWarning, GradpatchError, GradpatchWarning,
                                  NotDifferentiableError, PatchFailedWarning, RevertWarning,
                                  StartupWarning, UnknownCodeWarning)
    from gradpatch.checkpointing.checkpoint import checkpoint
    from gradpatch.checkpointing.budget import checkpoint_plan
    from gradpatch.patching.patch import Patch, Record, Report, Status
    from gradpatch.sampling.generic.any_sampler import differentiable
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


from gradpatch.switch import OFF as _OFF, enabled as _enabled  # noqa: E402, F401 (start-up, tests)


def _imported_by_site() -> bool:
    """Whether site.py (a .pth line, or a ``.start`` entry on 3.15+) is importing gradpatch right now."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "site":
            return True
        frame = frame.f_back
    return False


def _warn_if_startup_file_missing() -> None:
    """Warn when ``GRADPATCH`` asks for patches but gradpatch's startup file did not run in this
    interpreter, so nothing was patched at start-up; say why."""
    if not _enabled() or _imported_by_site():  # from site: the startup file runs right after this
        return
    startup = sys.modules.get("gradpatch._startup")
    if startup is not None and getattr(startup, "done", False):
        return
    if sys.flags.no_site:
        why = "this interpreter was started with -S (no site), so no startup file runs"
    else:
        import site

        found = [entry for entry in sys.path if entry and os.path.isfile(os.path.join(entry, "gradpatch.pth"))]
        site_dirs = {os.path.normcase(os.path.abspath(d)) for d in
                     [*getattr(site, "getsitepackages", list)(), getattr(site, "USER_SITE", None) or ""] if d}
        outside = [entry for entry in found if os.path.normcase(os.path.abspath(entry)) not in site_dirs]
        if outside:
            why = (f"its startup file is in {outside[0]}, which is not a site directory (pip install "
                   "--target, used through PYTHONPATH): Python reads .pth files only in site-packages. "
                   "Install gradpatch into the environment with pip, or call site.addsitedir() on that "
                   "folder in a sitecustomize module")
        elif found:
            why = "GRADPATCH was set after this interpreter had started, when its startup file had already run"
        else:
            why = "gradpatch's startup file (gradpatch.pth) is not installed in this environment; reinstall gradpatch with pip"
    from gradpatch.errors import StartupWarning, complain

    complain(StartupWarning, f"gradpatch: GRADPATCH is set but nothing was patched at start-up: {why}. "
             "Python processes started from here are not patched either; in this one, call "
             "gradpatch.apply() or `import gradpatch.auto`.")


_warn_if_startup_file_missing()
