"""Warning categories and the one exception gradpatch raises.

Every problem gradpatch meets at run time is reported once, as a warning of one of these categories
(filter them with the standard :mod:`warnings` machinery, e.g.
``warnings.filterwarnings("ignore", category=gradpatch.UnknownCodeWarning)``), and logged on the
``gradpatch`` logger. In strict mode (``apply(strict=True)`` or ``GRADPATCH_STRICT=1``) the same
message is raised as :class:`GradpatchError` instead.
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
    """A target exists but its code matches no known fingerprint, so it was left alone."""


class PatchFailedWarning(GradpatchWarning):
    """Applying a fix raised; the target was left as it was."""


class RevertWarning(GradpatchWarning):
    """On revert, something other than gradpatch had replaced a patched object since."""


class StartupWarning(GradpatchWarning):
    """``GRADPATCH`` is set, but this interpreter did not run gradpatch's startup file."""


class GradpatchError(RuntimeError):
    """Raised instead of a warning in strict mode."""


def _caller_outside_gradpatch() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside gradpatch."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("gradpatch"):
        frame, level = frame.f_back, level + 1
    return level


def complain(category: type[GradpatchWarning], message: str) -> None:
    """Warn (or raise :class:`GradpatchError` in strict mode) with one self-explanatory message."""
    if settings.strict:
        raise GradpatchError(message)
    logger.debug("%s: %s", category.__name__, message)
    warnings.warn(message, category, stacklevel=_caller_outside_gradpatch())
