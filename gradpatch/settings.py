"""Run-time settings shared by the engine and the fixes.

Plain module attributes, read on every call by the fixes (one attribute lookup), written by
:func:`gradpatch.apply`, the ``GRADPATCH_*`` environment variables and :func:`set_checkpoint_policy`
(process-wide), and overridden for one context (thread or asyncio task) by :func:`scope`
(:func:`checkpoint_policy_scope`, :func:`gradpatch.applied`). Write them through these functions,
not by assignment. This module must never import torch.
"""
from __future__ import annotations

import contextlib
import os
import threading
from contextvars import ContextVar
from typing import Any, Iterator

CHECKPOINT_POLICIES = ("respect", "always", "never")

#: How the fixed OpenAI/CompVis ``checkpoint(func, inputs, params, flag)`` treats ``flag``:
#: ``"respect"`` recomputes exactly when the caller asks, ``"always"`` recomputes even where the
#: caller passed ``flag=False``, ``"never"`` runs ``func`` directly (faster, more memory).
#: ``"budget:<size>"`` (``"budget:512MiB"``) keeps, among the blocks the caller asks to recompute,
#: those that save the most time while keeping at most ``<size>`` bytes more activations than
#: recomputing all of them (:mod:`gradpatch.fixes.checkpoint_budget`).
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
    """``policy`` as stored (``"respect"``, ``"always"``, ``"never"`` or ``"budget:<size>"``, stripped);
    ``ValueError`` saying what is accepted for anything else."""
    if policy in CHECKPOINT_POLICIES:
        return policy
    from gradpatch.budget import check_policy as check_with_budget

    return check_with_budget(policy, CHECKPOINT_POLICIES)


def set_checkpoint_policy(policy: str) -> str:
    """Set the process-wide checkpoint policy; return the previous one. Takes effect on the next call,
    except in contexts inside a :func:`checkpoint_policy_scope`, which keep their scope's policy.
    ``"budget:<size>"`` plans which blocks to recompute (:mod:`gradpatch.budget`)."""
    return _set_process_wide("checkpoint_policy", check_policy(policy))


def set_strict(value: bool) -> bool:
    """Set process-wide strictness; return the previous value (contexts inside a :func:`scope` that
    overrides it keep theirs)."""
    return _set_process_wide("strict", bool(value))


@contextlib.contextmanager
def scope(**values: Any) -> Iterator[None]:
    """Override settings (``checkpoint_policy``, ``strict``) in this context only, for the ``with``
    block. The context is the thread or asyncio task that enters the block: other threads, and
    threads started inside it, keep the process-wide values; nested scopes stack."""
    unknown = set(values) - set(_SCOPABLE)
    if unknown:
        raise TypeError(f"settings that can be scoped: {', '.join(_SCOPABLE)}; not {', '.join(sorted(unknown))}")
    with _lock:
        for name in values:
            if _scopes[name] == 0:
                _process[name] = globals()[name]
                del globals()[name]  # reads now reach __getattr__
            _scopes[name] += 1
    token = _overrides.set({**_overrides.get(), **values})
    try:
        yield
    finally:
        _overrides.reset(token)
        with _lock:
            for name in values:
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
