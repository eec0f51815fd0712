"""Warning categories and the exceptions gradpatch raises.

Every problem gradpatch meets at run time is reported once, as a warning of one of these categories
(filter them with the standard :mod:`warnings` machinery, e.g.
``warnings.filterwarnings("ignore", category=gradpatch.UnknownCodeWarning)``), and logged on the
``gradpatch`` logger. In strict mode (``apply(strict=True)`` or ``GRADPATCH_STRICT=1``) the same
message is raised as :class:`GradpatchError` instead. A sampler or pipeline asked for ``cache=False``
that cannot give gradients raises :class:`NotDifferentiableError`, in every mode.
"""
from __future__ import annotations

import logging
import sys
import warnings

from gradpatch import settings

logger = logging.getLogger("gradpatch")


class GradpatchWarning(UserWarning):
    """Base class of every warning gradpatch issues."""


class ConfigWarning(GradpatchWarning):
    """A bad argument or environment value: unknown patch name, unparseable ``GRADPATCH_*`` value."""


class UnknownCodeWarning(GradpatchWarning):
    """A target exists but its code matches no known fingerprint, is not what its source defines (a
    wrapper), or cannot be read (no source), so it was left alone; the message says which, and what to do."""


class PatchFailedWarning(GradpatchWarning):
    """Applying a fix raised; the target was left as it was."""


class RevertWarning(GradpatchWarning):
    """On revert, something other than gradpatch had replaced a patched object since."""


class StartupWarning(GradpatchWarning):
    """``GRADPATCH`` is set, but this interpreter did not run gradpatch's startup file."""


class GradpatchError(RuntimeError):
    """Raised instead of a warning in strict mode."""


class NotDifferentiableError(TypeError):
    """``cache=False`` (or ``grad_steps``/``checkpoint_steps``) was asked of a sampler or pipeline that
    gradpatch cannot make differentiable; the message says why, and what to call instead."""


# Frames a warning should not point at: gradpatch itself, and the import machinery between the user's
# ``import`` line and gradpatch's post-import hook (importlib).
_MACHINERY = ("gradpatch", "importlib", "_frozen_importlib", "_frozen_importlib_external")


def _is_machinery(frame: object) -> bool:
    name = frame.f_globals.get("__name__", "")  # type: ignore[attr-defined]
    return any(name == prefix or name.startswith(prefix + ".") for prefix in _MACHINERY)


def _skipped_by_warnings(frame: object) -> bool:
    # warnings.warn does not count importlib._bootstrap frames when walking stacklevel frames up.
    filename = frame.f_code.co_filename  # type: ignore[attr-defined]
    return "importlib" in filename and "_bootstrap" in filename


def _caller_outside_gradpatch() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside gradpatch and the import
    machinery: the user's ``import`` line or call (or, at start-up, ``site``)."""
    frame, level = sys._getframe(1), 1  # complain()
    while True:
        back = frame.f_back
        while back is not None and _skipped_by_warnings(back):
            back = back.f_back
        if back is None:
            return level
        frame, level = back, level + 1
        if not _is_machinery(frame):
            return level


_issued: set[tuple[type, str]] = set()


def complain(category: type[GradpatchWarning], message: str, *, once: bool = False) -> None:
    """Warn (or raise :class:`GradpatchError` in strict mode) with one self-explanatory message.

    ``once=True``: a message already issued in this process is not repeated (for what the environment
    says, read again by every ``apply()``: start-up activation, ``import gradpatch.auto``, user code).
    """
    if settings.strict:
        raise GradpatchError(message)
    if once:
        if (category, message) in _issued:
            return
        _issued.add((category, message))
    logger.debug("%s: %s", category.__name__, message)
    warnings.warn(message, category, stacklevel=_caller_outside_gradpatch())
