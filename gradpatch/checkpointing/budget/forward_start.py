"""The step's root module call: where a recorded ``peak:<size>`` step begins (its forward's start,
:mod:`gradpatch.checkpointing.budget.peak`), and, under torch.compile, where the steps a plan is made in
begin to run eagerly.

A step's peak counts from what was allocated when its forward began, but ``peak:`` learns that a step
began at its first checkpointed block's call, after the layers before it ran (their activations, FSDP's
all-gather buffers and prefetch). So while a plan is made (:func:`planning`), the first block's call
looks up the outermost module call under way (the model, or its DDP or FSDP wrapper: the step's root)
and puts a forward pre-hook first on it and a forward hook: each later call of the root starts a
recording (:func:`gradpatch.checkpointing.budget.timeline.start`) before anything else runs. The step's
first block takes it (:func:`take`), or it is dropped (a step not recorded; a root's call that ran no
block, a validation forward), staying on the stack, passing ops through, until the root's call returns
(:func:`release`). The hooks are the root's own (torch's global module hooks would make
``torch.compile`` warn) and go when the plan is made. A step whose first block is called outside any
module call begins at that block, as without this.

Under ``torch.compile(model)`` the root is the compiled wrapper, whose hooks run before dynamo: the
recording's dispatch mode is then on the stack, and dynamo runs the frames it meets under a dispatch
mode eagerly, so the step is recorded whole. A model compiled in place (``model.compile()``) would run
its hooks inside the compiled code, where they can do nothing: while its plan is made, its compiled
call is set aside (torch's ``Module._compiled_call_impl``), so that its steps run eagerly, hooks first,
and put back when the hooks go; the next call compiles it anew with the plan.

Under either policy, while a compiled model's plan is made (:func:`eager_from_root` at trace time,
:func:`eager_steps` at a graph break), the root's pre-hook pushes :class:`EagerSteps` where it pushes
no recording, a mode passing every op through, so that the step runs eagerly to be measured; its
forward hook takes it off.
"""
from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, \
    _get_current_dispatch_mode_stack

from gradpatch import settings
from gradpatch.checkpointing.budget import timeline
from gradpatch.checkpointing.compat import is_compiling

_state: dict[str, Any] = {"planning": False, "eager": None, "early": None, "thread": None, "pushed": None,
                          "wanted": None, "nested": 0}
#: The hooked roots, several where models take turns (a GAN's two): id -> (weak reference, the pre-hook's
#: handle or None once removed, the forward hook's handle).
_ROOTS: dict[int, tuple[Any, Any, Any]] = {}
_ASIDE: dict[int, tuple[Any, Any]] = {}  # models compiled in place, set aside: id -> (weak ref, compiled call)
_callback: Any
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _callback
except ImportError:  # (older torch)
    _callback = None
_CALLS = frozenset({torch.nn.Module._call_impl.__code__, torch.nn.Module.__call__.__code__,
                    getattr(torch.nn.Module, "_wrapped_call_impl", torch.nn.Module.__call__).__code__})


class EagerSteps(TorchDispatchMode):
    """Passes every op through. On the dispatch stack it makes dynamo run the frames it meets eagerly:
    the steps a plan is made in, under torch.compile (:func:`eager_steps`)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*args, **(kwargs or {}))


def planning(on: bool, wanted: Callable[[], bool] | None = None) -> None:
    """Whether a ``peak:`` plan is being made: from the next step on, each step's recording begins as
    its root's call does, in the steps for which ``wanted()`` says the step is to be recorded."""
    _state["wanted"] = wanted if on else None
    if _state["planning"] is on:
        return
    _state["planning"] = on
    _state["thread"] = threading.get_ident()
    if not on:
        release(_state["early"])
        _state["early"] = None
        if not _eager():
            _unhook()


def eager_steps(unplanned: Callable[[], bool]) -> None:
    """At a compiled region's graph break while a plan is made: the rest of this step, and each step
    while ``unplanned()``, runs eagerly (:class:`EagerSteps` on the stack from the root's call to its
    return). A graph break per block instead would compile the code around each block apart, once per
    module (a UNet's ``TimestepEmbedSequential.forward`` for every level: past dynamo's recompilation
    limit, with dynamic shapes)."""
    if eager_from_root(unplanned) and _state["pushed"] is None:
        _push_eager()


def eager_from_root(unplanned: Callable[[], bool]) -> bool:
    """Whether the compiled call's root (the outermost module call on the stack, outside the compiled
    code) runs the next steps eagerly while ``unplanned()`` (:class:`EagerSteps` pushed by its hooks,
    which run before dynamo): at trace time, this step's blocks may then be traced recomputed, without
    a graph break. A model compiled in place has its compiled call set aside meanwhile (module
    docstring)."""
    root = _root()
    if root is None:
        return False
    _state["eager"], _state["thread"] = unplanned, threading.get_ident()
    _hook(root)
    return True


def take(first: bool) -> timeline.Recording | None:
    """At a block's call while planning: the recording begun at this step's forward's start if the block
    is the step's first (``first``), else None (one begun outside this step is dropped). The first
    block's call hooks the root it runs in."""
    early, _state["early"] = _state["early"], None
    if early is not None and not first:
        release(early)
        early = None
    if first and _state["planning"]:
        root = _root()
        if root is not None:
            _hook(root)
    return early


def release(early: timeline.Recording | None) -> None:
    """A recording begun at the forward's start that this step does not use: it stops counting, and
    stays on the dispatch stack, passing ops through, until the root's call returns (:func:`_post`).
    Taken off inside the call, it could be inside a compiled function's call, which puts the thread's
    dispatch keys back as they were when it began: the Python key on, with no mode left to take it."""
    if early is not None:
        timeline.stop(early, pop=False)


def unrecordable(inside_compiled: bool) -> bool:
    """Whether a block runs in compiled code (``inside_compiled``) outside any module: no recording can
    begin before a step's forward. A root compiled in place (``model.compile()``, compiled mid-plan) is
    hooked here, its compiled call set aside: its next steps run eagerly, hooks first."""
    root = _root()
    if root is not None and getattr(root, "_compiled_call_impl", None) is not None:
        _hook(root)
        return False
    return inside_compiled and root is None


def inside_compiled_call() -> bool:
    """Whether a compiled function's call is under way on this thread (dynamo's frame callback is set),
    where a dispatch mode pushed before it must not be taken off: the call puts the thread's dispatch
    keys back as they were when it began. (torch < 2.5 does not say: False.)"""
    return bool(_callback is not None and _callback())


def steps_eager() -> bool:
    """Whether this root call runs eagerly under a mode of ours (:func:`eager_steps`, a recording)."""
    return _state["pushed"] is not None


def _root() -> torch.nn.Module | None:
    """The module of the outermost module call on this thread's stack; None where that call runs inside
    a compiled function (``torch.compile(lambda x: model(x))``), whose code its hooks would run in."""
    frame: FrameType | None = sys._getframe(2)
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # (nothing is compiled before it is imported)
    root, compiled = None, False
    while frame is not None:
        if frame.f_code in _CALLS:
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                root, compiled = module, False
        elif root is not None and not compiled and dynamo is not None:
            compiled = frame.f_code.co_filename == dynamo.__file__ and _compiling(frame.f_locals.get("self"), dynamo)
        frame = frame.f_back
    return None if compiled else root


def _compiling(context: Any, dynamo: Any) -> bool:
    """Whether ``context``, of a frame of dynamo's ``eval_frame``, is torch.compile's (not ``torch._dynamo.disable``'s)."""
    return isinstance(context, getattr(dynamo, "_TorchDynamoContext", ())) and \
        not isinstance(context, getattr(dynamo, "DisableContext", ()))


def _hook(root: torch.nn.Module) -> None:
    """The root's hooks, and its compiled call set aside if it is compiled in place (where its hooks
    would run in compiled code and do nothing), until the hooks go (:func:`_unhook`, :func:`_remove`)."""
    entry = _ROOTS.get(id(root))
    if entry is None or entry[0]() is not root or entry[1] is None:
        if entry is not None:  # (another module at a dead one's id, or the pre-hook already removed)
            _remove(id(root))
        _ROOTS[id(root)] = (weakref.ref(root), root.register_forward_pre_hook(_pre, prepend=True),
                            root.register_forward_hook(_post, always_call=True))
    _set_aside(root)


def _set_aside(root: torch.nn.Module) -> None:
    """``model.compile()``'s compiled call kept aside (:data:`_ASIDE`): the model's calls run eagerly."""
    compiled_call = getattr(root, "_compiled_call_impl", None)
    if compiled_call is not None:
        _ASIDE[id(root)] = (weakref.ref(root), compiled_call)
        root._compiled_call_impl = None


def _put_back(key: int) -> None:
    entry = _ASIDE.pop(key, None)
    root = None if entry is None else entry[0]()
    if root is not None and getattr(root, "_compiled_call_impl", None) is None:  # (else the user's since)
        root._compiled_call_impl = entry[1]  # type: ignore[index]


def _eager() -> bool:
    unplanned = _state["eager"]
    if unplanned is not None and not unplanned():
        _state["eager"] = unplanned = None
    return unplanned is not None


def _pre(module: torch.nn.Module, args: Any) -> None:
    if is_compiling() or inside_compiled_call():  # a root inside compiled code: see the module docstring
        return
    if threading.get_ident() != _state["thread"] or torch._C._current_graph_task_id() != -1:
        return  # (a checkpoint's recompute in backward calls modules too)
    if _state["pushed"] is not None:  # inside another root's call, whose mode covers this one
        _state["nested"] += 1
        return
    _drop()
    _unwind()  # an ended recording still on the stack leaves it first (the last step's)
    if not _state["planning"] and not _eager():  # (hooks kept for this: planned, the hooks go)
        _unhook()
        return
    wanted = _state["wanted"]
    if _state["planning"] and settings.is_peak(settings.checkpoint_policy) and (wanted is None or wanted()):
        _state["early"] = _state["pushed"] = timeline.start({})
    elif _eager():
        _push_eager()


def _post(module: torch.nn.Module, args: Any, out: Any) -> None:
    if is_compiling() or inside_compiled_call():
        return
    if threading.get_ident() == _state["thread"] and torch._C._current_graph_task_id() == -1:
        if _state["nested"]:
            _state["nested"] -= 1
            return
        _drop()  # (not taken: no checkpointed block ran in this call)
        pushed, _state["pushed"] = _state["pushed"], None
        if pushed is not None and (isinstance(pushed, EagerSteps) or pushed.ended):  # off the stack now
            _pop(pushed)
        if not _state["planning"] and not _eager():  # (the plan was made in this call: the hooks go now)
            _unhook()


def _push_eager() -> None:
    mode = EagerSteps()
    mode.__enter__()
    _state["pushed"] = mode


def _pop(mode: Any) -> None:
    current: Any = _get_current_dispatch_mode()
    if isinstance(mode, timeline.Recording):
        timeline.stop(mode)
    elif current is mode:
        current.__exit__(None, None, None)


def _unwind() -> None:
    """Take ended recordings and eager steps' modes off the top of this thread's dispatch stack."""
    timeline.unwind()
    mode: Any = _get_current_dispatch_mode()
    while isinstance(mode, EagerSteps) and mode is not _state["pushed"]:
        mode.__exit__(None, None, None)
        timeline.unwind()
        mode = _get_current_dispatch_mode()


def _drop() -> None:
    early, _state["early"] = _state["early"], None
    release(early)


def _unhook() -> None:
    """Remove the roots' hooks; a forward hook stays until the root's call under way returns, while a
    mode pushed in that call is still on the stack (it removes itself then). While a mode of ours is
    on the stack otherwise (left where it could not be taken off), the hooks stay for the next root
    call to take it off."""
    if any(isinstance(m, (timeline.Recording, EagerSteps)) and m is not _state["pushed"]
           for m in _get_current_dispatch_mode_stack()):
        return
    for key, (ref, pre, post) in list(_ROOTS.items()):
        if pre is not None:
            pre.remove()
        _put_back(key)
        if _state["pushed"] is None:
            post.remove()
            del _ROOTS[key]
        else:
            _ROOTS[key] = (ref, None, post)


def _remove(key: int) -> None:
    _, pre, post = _ROOTS.pop(key)
    if pre is not None:
        pre.remove()
    post.remove()
    _put_back(key)
