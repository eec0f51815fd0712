"""The ``GRADPATCH*`` environment variables, parsed once per call with one clear warning per bad value.

``GRADPATCH``            unset, empty or ``0``: nothing happens. ``1``/``all``: every patch. Otherwise a
                         comma-separated list of patch or upstream names (``audioldm,f5_tts``).
``GRADPATCH_EXCLUDE``    comma-separated names to leave out.
``GRADPATCH_STRICT``     ``1``: raise instead of warning.
``GRADPATCH_CHECKPOINT`` ``respect`` (default), ``always``, ``never`` or ``budget:<size>`` (``budget:2GiB``).
``GRADPATCH_LOG``        a :mod:`logging` level name or number for the ``gradpatch`` logger.
"""
from __future__ import annotations

import logging
import os
from typing import NamedTuple

from gradpatch import settings
from gradpatch.errors import ConfigWarning, complain

_OFF = {"", "0", "false", "no", "off"}
_ALL = {"1", "all", "true", "yes", "on"}


class Environment(NamedTuple):
    enabled: bool
    names: tuple[str, ...]  # empty: every patch
    exclude: tuple[str, ...]
    strict: bool
    checkpoint: str | None
    log_level: int | None


def _names(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _flag(variable: str) -> bool:
    value = os.environ.get(variable, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ALL:
        return True
    complain(ConfigWarning, f"gradpatch: {variable}={os.environ[variable]!r} is not a boolean; "
             f"use 1 or 0 (treating it as 0)")
    return False


def read() -> Environment:
    raw = os.environ.get("GRADPATCH", "").strip()
    enabled = raw.lower() not in _OFF
    names = () if raw.lower() in _ALL or not enabled else _names(raw)
    checkpoint = os.environ.get("GRADPATCH_CHECKPOINT", "").strip().lower() or None
    if checkpoint is not None and checkpoint not in settings.CHECKPOINT_POLICIES:
        from gradpatch.budget import check_policy

        try:
            checkpoint = check_policy(checkpoint, settings.CHECKPOINT_POLICIES)
        except ValueError as error:
            reason = str(error).partition(": ")[2] if checkpoint.startswith("budget:") else ""
            complain(ConfigWarning, f"gradpatch: GRADPATCH_CHECKPOINT={checkpoint!r} is not one of "
                     f"{', '.join(settings.CHECKPOINT_POLICIES)} or budget:<size>"
                     f"{'; ' + reason if reason else ''}; using 'respect'")
            checkpoint = None
    return Environment(enabled, names, _names(os.environ.get("GRADPATCH_EXCLUDE", "")),
                       _flag("GRADPATCH_STRICT"), checkpoint, _log_level())


def _log_level() -> int | None:
    value = os.environ.get("GRADPATCH_LOG", "").strip()
    if not value:
        return None
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    if isinstance(level, int):
        return level
    complain(ConfigWarning, f"gradpatch: GRADPATCH_LOG={value!r} is not a logging level; "
             "use debug, info, warning or error")
    return None
