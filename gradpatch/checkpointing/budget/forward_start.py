"""Where a recorded ``peak:<size>`` step begins: its forward's start (:mod:`gradpatch.checkpointing.budget.peak`).

A step's peak counts from what was allocated when its forward began, but ``peak:`` learns that a step
began at its first checkpointed block's call, after the layers before it ran: their activations, and
under FSDP the root's all-gather buffers and the next unit's prefetch, would go unseen. So while a plan
is made (:func:`planning`), the recording begins earlier: armed at the end of the module call that ran
a step's first block, the next module call (outside a backward, on the same thread) starts one
(:func:`gradpatch.checkpointing.budget.timeline.start`). The step's first block takes it (:func:`take`),
to be the step's recording or dropped if this step is not recorded; a module call that returns without
running a block (a frozen encoder, a validation forward, a loss module) drops it and arms again, and a
block other than the first (the recording began mid-step) drops it too. The global module hooks are
registered only while armed (the pre-hook) or while such a recording runs (its module's post-hook),
and module calls inside a block begin none. A step whose first block is called outside any module
call begins at that block, as without this.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch.nn.modules import module as nn_module

from gradpatch.checkpointing.budget import timeline

_state: dict[str, Any] = {"planning": False, "armed": False, "pre": None, "post": None, "owner": None,
                          "early": None, "thread": None, "blocks": 0}


def planning(on: bool) -> None:
    """Whether a plan is being made: each step's recording begins at its forward's start from the next
    step on (armed when this step's module call ends)."""
    if _state["planning"] is on:
        return
    _state["planning"] = on
    _state["thread"] = threading.get_ident()
    if on:  # armed once the module call under way ends (at the next block: see take)
        return
    _state["armed"] = False
    _drop_hooks()
    early, _state["early"] = _state["early"], None
    if early is not None:
        timeline.stop(early)


def take(first: bool) -> timeline.Recording | None:
    """At a block's call: the recording begun at this step's forward's start if the block is the step's
    first (``first``), else None (one begun mid-step is dropped). Arms for the next step where nothing
    is under way yet (the first block since planning began)."""
    early, _state["early"] = _state["early"], None
    if early is not None and not first:
        timeline.stop(early)
        early = None
    if _state["planning"] and first and _state["owner"] is None and not _state["armed"]:
        _arm()  # (planning began inside this step: from the next module call outside a block on)
    return early


@contextlib.contextmanager
def in_block() -> Iterator[None]:
    """A checkpointed block's call: module calls inside it begin no recording."""
    _state["blocks"] += 1
    try:
        yield
    finally:
        _state["blocks"] -= 1


def _arm() -> None:
    _state["armed"] = True
    if _state["pre"] is None:
        _state["pre"] = nn_module.register_module_forward_pre_hook(_pre)


def _pre(module: torch.nn.Module, args: Any) -> None:
    if not _state["armed"] or _state["blocks"] or threading.get_ident() != _state["thread"] \
            or torch._C._current_graph_task_id() != -1:
        return  # (inside a block; a checkpoint's recompute in backward calls modules too)
    _state["armed"] = False
    _state["pre"].remove()
    _state["pre"] = None
    timeline.unwind()  # an ended recording still on the stack leaves it first
    _state["owner"] = module
    _state["early"] = timeline.start({})
    _state["post"] = nn_module.register_module_forward_hook(_post, always_call=True)


def _post(module: torch.nn.Module, args: Any, out: Any) -> None:
    if module is not _state["owner"]:
        return
    _state["owner"] = None
    if _state["post"] is not None:
        _state["post"].remove()
        _state["post"] = None
    early, _state["early"] = _state["early"], None
    if early is not None:  # no checkpointed block ran in it
        timeline.stop(early)
    if _state["planning"]:
        _arm()


def _drop_hooks() -> None:
    for name in ("pre", "post"):
        if _state[name] is not None:
            _state[name].remove()
            _state[name] = None
    _state["owner"] = None
