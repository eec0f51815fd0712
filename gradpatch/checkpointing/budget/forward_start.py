"""Where a recorded ``peak:<size>`` step begins: its forward's start (:mod:`gradpatch.checkpointing.budget.peak`).

A step's peak counts from what was allocated when its forward began, but ``peak:`` learns that a step
began at its first checkpointed block's call, after the layers before it ran: their activations, and
under FSDP the root's all-gather buffers and the next unit's prefetch, would go unseen. So while a plan
is made (:func:`planning`), the first block's call looks up the outermost module call under way (the
model, or the DDP or FSDP wrapper around it: the step's root) and puts a forward pre-hook first on it
and a forward hook: each later call of the root starts a recording
(:func:`gradpatch.checkpointing.budget.timeline.start`) before anything else runs, FSDP's all-gather
included. The step's first block takes it (:func:`take`), to be the step's recording or dropped if
this step is not recorded; a call of the root that returns without having run one (a validation
forward) drops it. The hooks are the root's own (torch's global module hooks would make
``torch.compile`` warn) and go when the plan is made. A step whose first block is called outside any
module call begins at that block, as without this.
"""
from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import Any

import torch

from gradpatch import settings
from gradpatch.checkpointing.budget import timeline

_state: dict[str, Any] = {"planning": False, "root": None, "hooks": (), "early": None, "thread": None}
_CALLS = frozenset({torch.nn.Module._call_impl.__code__, torch.nn.Module.__call__.__code__,
                    getattr(torch.nn.Module, "_wrapped_call_impl", torch.nn.Module.__call__).__code__})


def planning(on: bool) -> None:
    """Whether a plan is being made: from the next step on, each step's recording begins as its root's
    call does."""
    if _state["planning"] is on:
        return
    _state["planning"] = on
    _state["thread"] = threading.get_ident()
    if not on:
        _unhook()
        _drop()


def take(first: bool) -> timeline.Recording | None:
    """At a block's call while planning: the recording begun at this step's forward's start if the block
    is the step's first (``first``), else None (one begun outside this step is dropped). The first
    block's call hooks the root it runs in."""
    early, _state["early"] = _state["early"], None
    if early is not None and not first:
        timeline.stop(early)
        early = None
    if first and _state["planning"]:
        root = _root()
        hooked = _state["root"]() if _state["root"] is not None else None
        if root is not None and root is not hooked:
            _unhook()
            _state["root"] = weakref.ref(root)
            _state["hooks"] = (root.register_forward_pre_hook(_pre, prepend=True),
                               root.register_forward_hook(_post, always_call=True))
    return early


def _root() -> torch.nn.Module | None:
    """The module of the outermost module call on this thread's stack."""
    frame: FrameType | None = sys._getframe(2)
    root = None
    while frame is not None:
        if frame.f_code in _CALLS:
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                root = module
        frame = frame.f_back
    return root


def _pre(module: torch.nn.Module, args: Any) -> None:
    if not _state["planning"] or threading.get_ident() != _state["thread"] \
            or torch._C._current_graph_task_id() != -1 or not settings.is_peak(settings.checkpoint_policy):
        return  # (a checkpoint's recompute in backward calls modules too; another policy for now)
    _drop()
    timeline.unwind()  # an ended recording still on the stack leaves it first
    _state["early"] = timeline.start({})


def _post(module: torch.nn.Module, args: Any, out: Any) -> None:
    if threading.get_ident() == _state["thread"]:
        _drop()  # (not taken: no checkpointed block ran in this call)


def _drop() -> None:
    early, _state["early"] = _state["early"], None
    if early is not None:
        timeline.stop(early)


def _unhook() -> None:
    for handle in _state["hooks"]:
        handle.remove()
    _state["hooks"], _state["root"] = (), None
