"""Choosing, per call, between the fast path (:mod:`gradpatch.checkpointing.recompute`) and the
graph path (:mod:`gradpatch.checkpointing.graph_path`), and remembering the functions that needed
the graph path once. Every policy that recomputes ends here: ``checkpoint()`` directly, the
``budget:<size>`` plan (:mod:`gradpatch.checkpointing.budget`) for the blocks it recomputes;
:func:`graph_path_reason` tells the plan why a block went to the graph path at once.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from gradpatch.checkpointing.compat import is_compiling
from gradpatch.checkpointing.graph_path import graph_path
from gradpatch.checkpointing.recompute import ESCAPED, attempt
from gradpatch.checkpointing.sharding import engine_loaded, sharded_inside

# What a block whose recompute builds another graph than its forward is told (torch's checkpoint
# raises too, on another count of saved tensors).
_BLOCK = ("checkpoint: a checkpointed block", "run it without recompute (gradpatch.checkpoint_policy_scope"
          "(\"never\"), GRADPATCH_CHECKPOINT=never or its own flag=False), or keep state its forward "
          "fills out of what it differentiates")

# Functions that took the graph path once: module -> {function}, or code object -> {None}. Weak
# keys: a module or code object that goes away takes its entry with it; nothing else is held.
_ESCAPED: weakref.WeakKeyDictionary[Any, set] = weakref.WeakKeyDictionary()


def run(func: Callable[..., Any], args: tuple, kwargs: dict | None) -> Any:
    """``func(*args, **kwargs)``, recomputed in backward by the fast path, or by the graph path where
    the fast path cannot serve this call (or could not serve this function before)."""
    if is_compiling():
        return graph_path(func, args, kwargs)
    owner, tag = _escape_key(func)
    if isinstance(owner, torch.nn.Module) and owner.__dict__.get("_is_replica"):
        return graph_path(func, args, kwargs)  # DataParallel: parameters computed in another thread
    if sharded_inside(func, args, kwargs):  # FSDP2/FSDP1/ZeRO-3 hooks inside: recompute within the graph
        return graph_path(func, args, kwargs, rebind=False)
    try:
        escaped = tag in _ESCAPED.get(owner, ())
    except TypeError:  # not weak-referenceable: nothing is remembered
        escaped = False
    if not escaped:
        out = attempt(func, args, kwargs, _BLOCK)
        if out is not ESCAPED:
            return out
        try:
            _ESCAPED.setdefault(owner, set()).add(tag)
        except TypeError:
            pass
    return graph_path(func, args, kwargs)


def graph_path_reason(func: Callable[..., Any], args: tuple, kwargs: dict | None) -> str:
    """Why :func:`run` sends this call to the graph path at once (for the ``budget:<size>`` plan's
    report of a block it cannot measure, as torch's checkpoint runs it)."""
    if is_compiling():
        return "inside torch.compile"
    owner, tag = _escape_key(func)
    if isinstance(owner, torch.nn.Module) and owner.__dict__.get("_is_replica"):
        return "a DataParallel replica"
    sharded = sharded_inside(func, args, kwargs)
    if sharded:
        return f"holds modules a sharding engine manages ({sharded})"
    return "an earlier call needed torch's checkpoint (it read a tensor it was not given, or returned an input)"


def _escape_key(func: Callable[..., Any]) -> tuple[Any, Any]:
    """(module, function) for methods of modules (upstream's ``self._forward``); otherwise (code or
    callable, None): closures of one code may differ, and the graph path is right for all."""
    owner = getattr(func, "__self__", None)
    if isinstance(owner, torch.nn.Module) and hasattr(func, "__func__"):
        return owner, func.__func__
    return getattr(func, "__code__", func), None


def fast_path(func: Callable[..., Any], args: tuple, kwargs: dict | None = None, *,
              verify: tuple[str, str] | None = None, reuse: bool = False) -> Any:
    """The fast path alone, for a caller with a recompute of its own to fall back on (gradpatch's
    sampler steps; public as ``gradpatch.checkpointing.checkpoint.fast_path``): ``func``'s result
    through the fast path's node, or ``ESCAPED`` (nothing run, or the RNG rewound) where the recompute
    must run inside the graph: while compiling, wherever a sharding engine could manage modules inside
    the call (:func:`gradpatch.checkpointing.sharding.engine_loaded`), and for the fast path's own
    reasons. ``verify=(what, instead)``: raise in backward, saying what and what to do instead, if the
    recompute builds another graph than the forward (:func:`gradpatch.checkpointing.recompute.attempt`).
    ``reuse``: the caller keeps the forward's graph where this returns ``ESCAPED`` after running ``func``
    (what it saved is then kept for it, and the RNG is not rewound)."""
    if is_compiling() or engine_loaded():
        return ESCAPED
    return attempt(func, args, kwargs, verify, reuse)
