"""Run-time settings shared by the engine and the fixes.

Plain module attributes, read on every call by the fixes (one attribute lookup), written by
:func:`gradpatch.apply`, the ``GRADPATCH_*`` environment variables and :func:`set_checkpoint_policy`
(process-wide), and overridden for one context (thread or asyncio task) by :func:`scope`
(:func:`checkpoint_policy_scope`, :func:`gradpatch.applied`). Write them through these functions,
not by assignment. This module must never import torch.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from contextvars import ContextVar, Token
from typing import Any, Iterator

CHECKPOINT_POLICIES = ("respect", "always", "never")

#: How the fixed OpenAI/CompVis ``checkpoint(func, inputs, params, flag)`` treats ``flag``:
#: ``"respect"`` recomputes exactly when the caller asks, ``"always"`` recomputes even where the
#: caller passed ``flag=False``, ``"never"`` runs ``func`` directly (faster, more memory).
#: ``"budget:<size>"`` (``"budget:512MiB"``) keeps, among the blocks the caller asks to recompute,
#: those that save the most time while keeping at most ``<size>`` bytes more activations than
#: recomputing all of them (:mod:`gradpatch.checkpointing.budget`). ``"peak:<size>"`` (``"peak:6GiB"``)
#: keeps the training step's peak memory, from its forward's start to its backward's end, at or under
#: ``<size>``, choosing per block to keep or recompute it
#: (:mod:`gradpatch.checkpointing.budget.peak`).
checkpoint_policy = "respect"

#: Raise :class:`gradpatch.GradpatchError` instead of warning (``apply(strict=True)``,
#: ``GRADPATCH_STRICT=1``). Strict mode lets a hook's failure propagate into the ``import``.
strict = False

# Scoped overrides. While no scope overrides a name, it is a plain module attribute holding the
# process-wide value: reading it costs one attribute lookup, as before. While one does, the attribute
# is removed, so reads reach the module ``__getattr__`` below, which answers with this context's
# override or the process-wide value kept in ``_process`` (one Python call more per read: measured
# 0.14 us against 2.4 us per read on a busy machine, small beside a checkpointed block's call).
_SCOPABLE = ("checkpoint_policy", "strict")
_process: dict[str, Any] = {}
_scopes = dict.fromkeys(_SCOPABLE, 0)
_overrides: ContextVar[dict[str, Any]] = ContextVar("gradpatch_settings", default={})
_lock = threading.Lock()
_UNSET = object()
_applied: tuple[str, str] | None = None  # (the policy before apply() set one, the one it set last)


def _reset_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_in_child)


def __getattr__(name: str) -> Any:
    if name not in _SCOPABLE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    override = _overrides.get()
    if name in override:
        return override[name]
    value = _process.get(name, _UNSET)
    return globals()[name] if value is _UNSET else value  # the last scope ended meanwhile


def _set_process_wide(name: str, value: Any) -> Any:
    with _lock:
        namespace = _process if name in _process else globals()
        previous, namespace[name] = namespace[name], value
    return previous


def check_policy(policy: str) -> str:
    """``policy`` as stored (``"respect"``, ``"always"``, ``"never"``, ``"budget:<size>"`` or ``"peak:<size>"``, stripped);
    ``ValueError`` saying what is accepted for anything else."""
    if policy in CHECKPOINT_POLICIES:
        return policy
    return _check_budget(policy, CHECKPOINT_POLICIES)


# --- budget:<size> ---------------------------------------------------------------------------------
# ``<size>`` is a number of bytes with an optional unit: ``B``; decimal ``kB``, ``MB``, ``GB``, ``TB``
# (powers of 1000); binary ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024). Units are case-insensitive,
# since ``GRADPATCH_CHECKPOINT`` is read lower-cased; the number may be a decimal or in exponent form
# (``1.5e9``, ``0.5GiB``). Fractions of a byte are dropped.

PREFIX = "budget:"
EXAMPLE = "budget:512MiB"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


PEAK_PREFIX = "peak:"
PEAK_EXAMPLE = "peak:6GiB"


def is_budget(policy: str) -> bool:
    return policy[:len(PREFIX)].lower() == PREFIX


def is_peak(policy: str) -> bool:
    return policy[:len(PEAK_PREFIX)].lower() == PEAK_PREFIX


@functools.lru_cache(maxsize=64)
def parse_size(text: str) -> int:
    """Bytes meant by ``text`` (``"512MiB"``, ``"2GB"``, ``"1.5e9"``); ``ValueError`` with the reason
    and the accepted forms otherwise."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write bytes with an optional unit (B, kB, MB, GB, "
                         f"KiB, MiB, GiB), as in {EXAMPLE}, budget:2GB or budget:1.5e9")
    value = float(match.group(1)) * _UNITS[unit]
    if value >= 2**63:
        raise ValueError(f"{text!r} is too large a size; at most 8 EiB")
    return int(value)


def budget_bytes(policy: str) -> int:
    """The size in a ``budget:<size>`` policy."""
    return parse_size(policy[len(PREFIX):])


def peak_bytes(policy: str) -> int:
    """The size in a ``peak:<size>`` policy."""
    return parse_size(policy[len(PEAK_PREFIX):])


def _check_budget(policy: object, choices: tuple[str, ...]) -> str:
    """``policy``, stripped, if it is one of ``choices`` or a valid ``budget:<size>`` or
    ``peak:<size>``; otherwise ``ValueError`` saying what is accepted."""
    if isinstance(policy, str):
        text = policy.strip()
        if text in choices:
            return text
        for prefix, test in ((PREFIX, is_budget), (PEAK_PREFIX, is_peak)):
            if test(text):
                try:
                    parse_size(text[len(prefix):])
                except ValueError as error:
                    raise ValueError(f"checkpoint policy {policy!r}: {error}") from None
                return prefix + text[len(prefix):].strip()
    raise ValueError(f"unknown checkpoint policy {policy!r}; use one of {', '.join(choices)}, "
                     f"budget:<size> ({EXAMPLE}) or peak:<size> ({PEAK_EXAMPLE})")


def set_checkpoint_policy(policy: str, *, by_apply: bool = False) -> str:
    """Set the process-wide checkpoint policy; return the previous one. Takes effect on the next call,
    except in contexts inside a :func:`checkpoint_policy_scope`, which keep their scope's policy.
    ``"budget:<size>"`` plans which blocks to recompute (:mod:`gradpatch.checkpointing.plan`).
    ``by_apply``: set by :func:`gradpatch.apply`, so that :func:`undo_applied_policy` (a ``revert()``
    that leaves nothing applied) puts back the policy from before the first such ``apply``."""
    global _applied
    checked = check_policy(policy)
    with _lock:
        namespace = _process if "checkpoint_policy" in _process else globals()
        previous, namespace["checkpoint_policy"] = namespace["checkpoint_policy"], checked
        _applied = ((previous if _applied is None else _applied[0]), checked) if by_apply else None
    return previous


def undo_applied_policy() -> None:
    """The process-wide policy back to what it was before :func:`gradpatch.apply` set one, if it is
    still the one ``apply`` set (a :func:`set_checkpoint_policy` since is the user's choice: it stays)."""
    global _applied
    with _lock:
        namespace = _process if "checkpoint_policy" in _process else globals()
        if _applied is not None and namespace["checkpoint_policy"] == _applied[1]:
            namespace["checkpoint_policy"] = _applied[0]
        _applied = None


def set_strict(value: bool) -> bool:
    """Set process-wide strictness; return the previous value (contexts inside a :func:`scope` that
    overrides it keep theirs)."""
    return _set_process_wide("strict", bool(value))


class scope:
    """Override settings (``checkpoint_policy``, ``strict``) in this context only, for the ``with``
    block. The context is the thread or asyncio task that enters the block: other threads, and
    threads started inside it, keep the process-wide values; nested scopes stack. Each is entered once.
    (A class, not a generator-based context manager: gradpatch enters one around every checkpointed
    sampler step's evaluation and again around its recompute.)"""

    __slots__ = ("values", "token")

    def __init__(self, **values: Any) -> None:
        unknown = set(values) - set(_SCOPABLE)
        if unknown:
            raise TypeError(f"settings that can be scoped: {', '.join(_SCOPABLE)}; not {', '.join(sorted(unknown))}")
        self.values = values
        self.token: Token[dict[str, Any]] | None = None

    def __enter__(self) -> None:
        if self.token is not None:
            raise RuntimeError("a settings.scope is entered once; make another for another block")
        with _lock:
            for name in self.values:
                if _scopes[name] == 0:
                    _process[name] = globals()[name]
                    del globals()[name]  # reads now reach __getattr__
                _scopes[name] += 1
        self.token = _overrides.set({**_overrides.get(), **self.values})

    def __exit__(self, *exc: Any) -> None:
        assert self.token is not None
        _overrides.reset(self.token)
        with _lock:
            for name in self.values:
                _scopes[name] -= 1
                if _scopes[name] == 0:
                    globals()[name] = _process.pop(name)


@contextlib.contextmanager
def checkpoint_policy_scope(policy: str) -> Iterator[None]:
    """Use ``policy`` inside the ``with`` block, in this context (thread or asyncio task) only; other
    threads keep theirs, and the previous policy holds again after the block, whatever other blocks
    did meanwhile."""
    with scope(checkpoint_policy=check_policy(policy)):
        yield
