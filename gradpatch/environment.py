"""The ``GRADPATCH*`` environment variables, parsed once per call.

``GRADPATCH``            unset, empty, ``0``, ``false``, ``no`` or ``off`` (any case): nothing happens.
                         ``1``/``all``/``true``/``yes``/``on``: every patch. Otherwise a comma-separated
                         list of patch or upstream names (``audioldm,f5_tts``); a value that names
                         nothing (``,``) is reported and leaves gradpatch off.
``GRADPATCH_EXCLUDE``    comma-separated names to leave out.
``GRADPATCH_STRICT``     ``1``: raise instead of warning.
``GRADPATCH_CHECKPOINT`` ``respect`` (default), ``always``, ``never``, ``budget:<size>`` (``budget:2GiB``) or ``peak:<size>`` (``peak:6GiB``).
``GRADPATCH_LOG``        a :mod:`logging` level name or number for the ``gradpatch`` logger.
``GRADPATCH_SCAN``       ``0`` (or another off value): do not look for copies of known-broken code at
                         undeclared paths (:mod:`gradpatch.patching.scan`); on by default.
``GRADPATCH_ADOPT``      ``module:Qual.name=patch`` (comma-separated): patch code gradpatch does not
                         recognise with a catalogued patch's fix (:mod:`gradpatch.patching.adoption`).

:func:`read` never warns and never raises: a bad value is ignored and described in
``Environment.problems``, which the caller reports once it knows whether it is strict (so
``GRADPATCH_STRICT=1`` makes every bad value an error).
"""
from __future__ import annotations

import logging
import os
from typing import NamedTuple

from gradpatch import settings
from gradpatch.switch import OFF as _OFF

_ALL = {"1", "all", "true", "yes", "on"}


class Environment(NamedTuple):
    enabled: bool
    names: tuple[str, ...]  # empty: every patch
    exclude: tuple[str, ...]
    strict: bool
    checkpoint: str | None
    log_level: int | None
    problems: tuple[str, ...] = ()  # one message per bad value, which was ignored
    scan: bool = True


def _names(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _flag(variable: str, problems: list[str], default: bool = False) -> bool:
    value = os.environ.get(variable, "").strip().lower()
    if not value:
        return default
    if value in _OFF:
        return False
    if value in _ALL:
        return True
    problems.append(f"gradpatch: {variable}={os.environ[variable]!r} is not a boolean; use 1 or 0 "
                    f"(treating it as {int(default)})")
    return default


def read() -> Environment:
    problems: list[str] = []
    raw = os.environ.get("GRADPATCH", "").strip()
    enabled = raw.lower() not in _OFF
    names = () if raw.lower() in _ALL or not enabled else _names(raw)
    if enabled and not names and raw.lower() not in _ALL:
        problems.append(f"gradpatch: GRADPATCH={raw!r} names no patch, so gradpatch stays off; use 1 "
                        "for every patch or a comma list of names (`gradpatch list` shows them)")
        enabled = False
    checkpoint = os.environ.get("GRADPATCH_CHECKPOINT", "").strip().lower() or None
    if checkpoint is not None and checkpoint not in settings.CHECKPOINT_POLICIES:
        try:
            checkpoint = settings.check_policy(checkpoint)
        except ValueError as error:
            reason = str(error).partition(": ")[2] if checkpoint.startswith(("budget:", "peak:")) else ""
            problems.append(f"gradpatch: GRADPATCH_CHECKPOINT={checkpoint!r} is not one of "
                            f"{', '.join(settings.CHECKPOINT_POLICIES)}, budget:<size> or peak:<size>"
                            f"{'; ' + reason if reason else ''}; using 'respect'")
            checkpoint = None
    strict = _flag("GRADPATCH_STRICT", problems)
    scan = _flag("GRADPATCH_SCAN", problems, default=True)
    return Environment(enabled, names, _names(os.environ.get("GRADPATCH_EXCLUDE", "")), strict, checkpoint,
                       _log_level(problems), tuple(problems), scan)


def _log_level(problems: list[str]) -> int | None:
    value = os.environ.get("GRADPATCH_LOG", "").strip()
    if not value:
        return None
    if value.isascii() and value.isdigit():  # '²'.isdigit() is true too, and int() rejects it
        return int(value)
    level = logging.getLevelName(value.upper())
    if isinstance(level, int):
        return level
    problems.append(f"gradpatch: GRADPATCH_LOG={value!r} is not a logging level; "
                    "use debug, info, warning or error")
    return None
