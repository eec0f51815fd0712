"""The ``budget:<size>`` and ``peak:<size>`` policies inside torch.compile regions
(:mod:`gradpatch.checkpointing.budget`, :mod:`~gradpatch.checkpointing.budget.peak`).

The plan is baked into the compiled graph: each checkpointed block :func:`run` meets while dynamo
traces is looked up in the plan at trace time (:func:`_decide`, a function dynamo calls once per
trace and whose answer it takes as a constant) and traced as a plain call where the plan keeps it, or
through torch's non-reentrant checkpoint (a higher-order op the compiler understands) where it
recomputes it. Gradients are those of the block either way.

**Measuring.** Bytes and times come from eager calls, as outside compiled regions
(:mod:`gradpatch.checkpointing.budget.measure`). While the plan is not complete (the first
:data:`~gradpatch.checkpointing.budget.planner.TIMING_CALLS` steps, or new blocks: another shape
bucket, a change of training mode or of trainable parameters), a block the plan does not know yet is
run eagerly, outside the graph (``torch._dynamo.disable``): a graph break per block during those
steps only. Under ``peak:<size>`` the plan's steps are recorded eagerly too: the recording is a
dispatch mode, begun before the model's call (:mod:`~gradpatch.checkpointing.budget.forward_start`),
and dynamo runs the frames it meets under a dispatch mode eagerly. Once the plan is solved, the
compilations made while measuring (and those made with an earlier plan) are invalidated in dynamo's
cache once the step's backward began (:mod:`~gradpatch.checkpointing.budget.recompile`), so the next
call compiles the model anew, whole, with the plan baked in. Other compiled code, the user's other models
compiled through the same wrapper included, keeps its entries. Kept blocks are kept at input sizes
up to the largest measured (shapes are static in a trace); a larger one is measured again, eagerly
(recomputed under ``peak:``, as eagerly).

**Where it cannot plan** the block is recomputed through torch's checkpoint, as under ``respect``, and
one :class:`gradpatch.errors.ConfigWarning` per process says so
(:mod:`gradpatch.checkpointing.budget.compiled`): a block not yet measured where no graph break is
allowed (``fullgraph=True``, ``torch.export``, tracing outside dynamo), a block traced with dynamic
shapes (the bytes it keeps have no bound; ``dynamic=False`` compiles each shape apart). Inside
another higher-order op (a recomputed block, a user's own checkpoint) a block is recomputed with it,
silently: the outer op decides. Functions other than module methods are recomputed, as eagerly.

Estimates: the plan's figures are eager measurements. In the compiled graph a kept block keeps what
the compiler's partitioner saves for it (often less: it recomputes cheap pointwise work itself) and
runs faster; ``benchmarks/checkpoint_compile.py`` measures the realised peak. Under ``peak:`` the
compiled step's peak is not measured (compiled code does not go through the recording's dispatch
mode) and can lie above the eager prediction (inductor: ``benchmarks/peak_compile.py``): one
:class:`gradpatch.errors.ConfigWarning` says so when the plan is compiled in
(:func:`gradpatch.checkpointing.budget.compiled.compiled_peak`). The plan is checked
whenever a block runs eagerly; one changed only by blocks that run eagerly elsewhere (a model partly
compiled) reaches compiled code at the next solve.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import Tensor

from gradpatch import settings
from gradpatch.checkpointing import paths
from gradpatch.checkpointing.budget import compiled, forward_start, peak, recompile
from gradpatch.checkpointing.budget.key import bucket, state
from gradpatch.checkpointing.budget.planner import PLANNER, Block
from gradpatch.checkpointing.compat import autocast_dtype, autocast_enabled

KEEP, RECOMPUTE, EAGER = "keep", "recompute", "eager"

_state = {"inside": 0}


def run(func: Callable[..., Any], args: tuple, kwargs: dict | None, policy: str,
        eager: Callable[..., Any]) -> Any:
    """``checkpoint``'s work under ``budget:<size>`` or ``peak:<size>`` while dynamo traces: keep,
    recompute, or (to measure, to record) ``eager(func, args, kwargs, policy)`` outside the graph."""
    # (dynamo answers getattr(method, "__self__", None) with None: the attributes are read directly)
    if not isinstance(func, types.MethodType) or not isinstance(func.__self__, torch.nn.Module):
        return paths.run(func, args, kwargs)
    owner, function = func.__self__, func.__func__
    values = args if kwargs is None else (*args, *kwargs.values())
    # (read before _phase: dynamo gives an input its symbolic sizes when first used)
    meta = tuple((tuple(v.shape), v.dtype, v.device, v.requires_grad) if isinstance(v, Tensor) else None
                 for v in values)
    choice = _phase(policy)
    if choice == KEEP:  # the plan is solved: this block's own decision (static shapes: plain ints)
        amp = (autocast_enabled("cpu") and autocast_dtype("cpu"),
               autocast_enabled("cuda") and autocast_dtype("cuda"))
        choice = _decide(owner, function, amp, meta, policy)
    if choice == KEEP:
        return func(*args, **(kwargs or {}))
    if choice == EAGER:
        return _eager(eager, func, args, kwargs, policy)
    return paths.run(func, args, kwargs)


def inside() -> bool:
    """Whether a compiled region's graph break is running a block eagerly (:func:`_eager`) on this call."""
    return _state["inside"] > 0


def solved(policy: str) -> Any:
    """The policy's solved plan, the object compiled code is traced with; None while it is being made."""
    if settings.is_peak(policy):
        return peak.solved(policy)
    size = settings.budget_bytes(policy)
    return PLANNER.plans.get(size) if PLANNER.solved_for == size else None


def _kept(plan: Any, block: Block, policy: str) -> bool | None:
    """Whether ``plan`` keeps ``block``; None where the block is not in it."""
    if settings.is_peak(policy):
        choice = plan.get(block)
        if choice is None:
            return False if plan is peak.UNRECORDED else None
        return choice == peak.KEEP
    return block.keep if any(b is block for b, _, _ in plan) else None


@torch._dynamo.assume_constant_result
def _phase(policy: str) -> str:
    """At trace time, without the block (no guard on the module: one compiled code for all its
    instances while measuring): ``EAGER`` while the plan is not solved, ``KEEP`` to ask
    :func:`_decide`, ``RECOMPUTE`` where nothing can be measured or bounded."""
    plan = solved(policy)
    if plan is None:  # (measured eagerly whatever the shapes: a call has real ones)
        if recompile.breakable() is not None and forward_start.eager_from_root(_unplanned):
            _record(None)  # the next steps run eagerly until the plan is made; then compiled anew
            return RECOMPUTE
        return _measure_here(None, "a block not measured yet where the graph may not break")
    if _symbolic():
        compiled.note("dynamic shapes in the compiled region (the bytes a block keeps have no bound)")
        return RECOMPUTE
    if settings.is_peak(policy) and plan is not peak.UNRECORDED:
        compiled.compiled_peak(policy)
    return KEEP


@torch._dynamo.assume_constant_result
def _decide(owner: torch.nn.Module, function: Any, amp: tuple, meta: tuple, policy: str) -> str:
    """At trace time: this block's decision in the solved plan, or ``EAGER`` to measure it (unknown,
    not in the plan, or larger than measured)."""
    key = (function, state(owner), (*amp, *[None if m is None else (bucket(m[0]), *m[1:]) for m in meta]))
    per_owner = PLANNER.blocks.get(owner)
    block = None if per_owner is None else per_owner.get(key)
    plan = solved(policy)
    if block is None or plan is None or not block.measured:
        return _measure_here(None, "a block not measured yet where the graph may not break")
    PLANNER.block(owner, key)  # called in this epoch: planned with the others
    kept = _kept(plan, block, policy)
    if kept is None:
        PLANNER.void()  # measured, but left out of this plan (not called when it was solved)
        return _measure_here(None, "a block left out of the plan where the graph may not break")
    largest = sum(_numel(m[0]) for m in meta if m is not None)
    if kept and largest > block.largest:
        if settings.is_peak(policy):  # (recomputed, as peak: does eagerly at inputs larger than measured)
            _record(plan)
            return RECOMPUTE
        return _measure_here(plan, "a kept block at larger inputs than measured where the graph may not break")
    _record(plan)
    return KEEP if kept else RECOMPUTE


def _symbolic() -> bool:
    """Whether the trace under way has symbolic sizes (dynamic shapes): blocks are not planned there."""
    try:
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        fake = None if context is None else context.fake_mode
        shape_env = None if fake is None else fake.shape_env
        if shape_env is None:
            return False
        sizes = getattr(shape_env, "backed_var_to_val", None)  # torch 2.14's name
        return bool(shape_env.var_to_val if sizes is None else sizes)
    except Exception:
        return False


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _measure_here(plan: Any, why: str) -> str:
    """``EAGER`` if the graph being traced may break here (the frame's code noted, to be compiled
    anew once the plan is solved); otherwise ``RECOMPUTE``, noted for the warning."""
    code = recompile.breakable()
    if code is None:
        if not recompile.inside_op():  # (inside another op, such as a recomputed block, its decision rules)
            compiled.note(why)
        _record(None)  # compiled again once a plan is solved (measured by eager steps elsewhere)
        return RECOMPUTE
    recompile.note(code, plan)
    return EAGER


def _record(plan: Any) -> None:
    code = recompile.breakable(check=False)
    if code is not None:
        recompile.note(code, plan)


@torch._dynamo.disable
def _eager(eager: Callable[..., Any], func: Callable[..., Any], args: tuple, kwargs: dict | None,
           policy: str) -> Any:
    """The block run eagerly (measured, recorded, or as the plan says), then the compiled code brought
    up to date with the plan if it is solved."""
    _state["inside"] += 1
    try:
        out = eager(func, args, kwargs, policy)
    finally:
        _state["inside"] -= 1
    if _unplanned():  # the rest of the step, and the next ones until the plan is made, eagerly
        forward_start.eager_steps(_unplanned)
    check(policy, out)
    return out


def _unplanned() -> bool:
    policy = settings.checkpoint_policy
    return (settings.is_budget(policy) or settings.is_peak(policy)) and solved(policy) is None


def check(policy: str, out: Any = None) -> None:
    """Invalidate the compilations made with another plan than the solved one, once the step's
    backward begins (``out``'s gradient; at once if none): the step under way keeps running the code
    it started with."""
    if not recompile.CODES or recompile.exhausted() or _state["inside"]:
        return  # (inside _eager: checked after the call, with its output)
    plan = solved(policy)
    if plan is None or not recompile.stale(plan):
        return
    tensor = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(t, Tensor) and t.requires_grad), None)
    if tensor is None:
        recompile.invalidate(recompile.stale(plan))
    else:  # (a hook per call until one fires: the first finds them, the others nothing)
        def hook(grad: Tensor) -> Tensor:
            recompile.invalidate(recompile.stale(plan))
            return grad

        tensor.register_hook(hook)


def forget() -> None:
    """Invalidate every compilation made with a plan (:func:`gradpatch.checkpointing.budget.reset`):
    the next calls measure again."""
    recompile.forget()
