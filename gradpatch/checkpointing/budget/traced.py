"""The ``budget:<size>`` policy inside torch.compile regions (:mod:`gradpatch.checkpointing.budget`).

The plan is baked into the compiled graph: each checkpointed block :func:`run` meets while dynamo
traces is looked up in the planner at trace time (:func:`_decide`, a function dynamo calls once per
trace and whose answer it takes as a constant) and traced as a plain call where the plan keeps it, or
through torch's non-reentrant checkpoint (a higher-order op the compiler understands) where it
recomputes it. Gradients are those of the block either way.

**Measuring.** Bytes and times come from eager calls, as outside compiled regions
(:mod:`gradpatch.checkpointing.budget.measure`). While the plan is not complete (the first
:data:`~gradpatch.checkpointing.budget.planner.TIMING_CALLS` steps, or new blocks: another shape
bucket, a change of training mode or of trainable parameters), a block the plan does not know yet is
run eagerly, outside the graph (``torch._dynamo.disable``): a graph break per block during those
steps only. Once the plan is solved, the compilations made while measuring (and those made with an
earlier plan) are invalidated in dynamo's cache once the step's backward began (each cache entry by
its compile id, as dynamo invalidates the entries guarding an object that died; where this torch has
no such entries, the code object's whole cache goes: ``torch._dynamo.reset_code``), so the next call
compiles the model anew, whole, with the plan baked in. Other compiled code, the user's other models
compiled through the same wrapper included, keeps its entries. Kept blocks are kept at input sizes
up to the largest measured (shapes are static in a trace); a larger one is measured again, eagerly.

**Where it cannot plan** the block is recomputed through torch's checkpoint, as under ``respect``, and
one :class:`gradpatch.errors.ConfigWarning` per process says so
(:mod:`gradpatch.checkpointing.budget.compiled`): a block not yet measured where no graph break is
allowed (``fullgraph=True``, ``torch.export``, tracing outside dynamo), a block traced with dynamic
shapes (the bytes it keeps have no bound; ``dynamic=False`` compiles each shape apart). Inside
another higher-order op (a recomputed block, a user's own checkpoint) a block is recomputed with it,
silently: the outer op decides. Functions other than module methods are recomputed, as eagerly.

Estimates: the plan's figures are eager measurements. In the compiled graph a kept block keeps what
the compiler's partitioner saves for it (often less: it recomputes cheap pointwise work itself) and
runs faster; ``benchmarks/checkpoint_compile.py`` measures the realised peak. The plan is checked
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
from gradpatch.checkpointing.budget import compiled
from gradpatch.checkpointing.budget.key import bucket, state
from gradpatch.checkpointing.budget.planner import PLANNER
from gradpatch.checkpointing.compat import autocast_dtype, autocast_enabled

KEEP, RECOMPUTE, EAGER = "keep", "recompute", "eager"

#: Compilations with a decision of ours inside: code object -> [(compile id, the plan (a list) it was
#: traced with, None while measuring)]. Invalidated when their plan is not the solved one.
_CODES: dict[Any, list] = {}
#: Resets made; past :data:`RESETS` the plan is no longer pushed into compiled code (no endless
#: recompilation where the plan keeps changing): what is compiled stays as it is.
_state = {"resets": 0, "inside": 0}
RESETS = 16


def run(func: Callable[..., Any], args: tuple, kwargs: dict | None, policy: str,
        eager: Callable[..., Any]) -> Any:
    """``checkpoint``'s work under ``budget:<size>`` while dynamo traces: keep, recompute, or (to
    measure) ``eager(func, args, kwargs, policy)`` outside the graph."""
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


@torch._dynamo.assume_constant_result
def _phase(policy: str) -> str:
    """At trace time, without the block (no guard on the module: one compiled code for all its
    instances while measuring): ``EAGER`` while the plan is not solved, ``KEEP`` to ask
    :func:`_decide`, ``RECOMPUTE`` where nothing can be measured or bounded."""
    if _symbolic():
        compiled.note("dynamic shapes in the compiled region (the bytes a block keeps have no bound)")
        return RECOMPUTE
    if PLANNER.solved_for == settings.budget_bytes(policy):
        return KEEP
    return _measure_here(None, "a block not measured yet where the graph may not break")


@torch._dynamo.assume_constant_result
def _decide(owner: torch.nn.Module, function: Any, amp: tuple, meta: tuple, policy: str) -> str:
    """At trace time: this block's decision in the solved plan, or ``EAGER`` to measure it (unknown,
    not in the plan, or larger than measured)."""
    size = settings.budget_bytes(policy)
    key = (function, state(owner), (*amp, *[None if m is None else (bucket(m[0]), *m[1:]) for m in meta]))
    per_owner = PLANNER.blocks.get(owner)
    block = None if per_owner is None else per_owner.get(key)
    plan = PLANNER.plans.get(size) if PLANNER.solved_for == size else None
    if block is None or plan is None or not block.measured:
        return _measure_here(None, "a block not measured yet where the graph may not break")
    PLANNER.block(owner, key)  # called in this epoch: planned with the others
    if not any(b is block for b, _, _ in plan):
        PLANNER.void()  # measured, but left out of this plan (not called when it was solved)
        return _measure_here(None, "a block left out of the plan where the graph may not break")
    largest = sum(_numel(m[0]) for m in meta if m is not None)
    if block.keep and largest > block.largest:
        return _measure_here(plan, "a kept block at larger inputs than measured where the graph may not break")
    _record(plan)
    return KEEP if block.keep else RECOMPUTE


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
    code = _breakable()
    if code is None:
        if not _inside_op():  # (inside another op, such as a recomputed block, its decision rules)
            compiled.note(why)
        _record(None)  # compiled again once a plan is solved (measured by eager steps elsewhere)
        return RECOMPUTE
    _note(code, plan)
    return EAGER


def _record(plan: Any) -> None:
    code = _breakable(check=False)
    if code is not None:
        _note(code, plan)


def _note(code: Any, plan: Any) -> None:
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except Exception:  # another torch: the code's whole cache is reset
        compile_id = None
    traced = _CODES.setdefault(code, [])
    if not any(c == compile_id and p is plan for c, p in traced):
        traced.append((compile_id, plan))


def _inside_op() -> bool:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().output.current_tracer.parent is not None
    except Exception:
        return False


def _breakable(check: bool = True) -> Any:
    """The code object dynamo is compiling if it may graph-break here (not ``fullgraph``, not under
    ``error_on_graph_break``, not inside a higher-order op); None otherwise or where this torch's
    tracer does not say."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.utils import _get_error_on_graph_break

        tx = InstructionTranslator.current_tx()
        if check and (tx.one_graph or _get_error_on_graph_break()
                      or tx.output.current_tracer.parent is not None):
            return None
        return tx.f_code if hasattr(torch._dynamo, "reset_code") else None
    except Exception:  # not dynamo (non-strict export, make_fx), or another torch
        return None


@torch._dynamo.disable
def _eager(eager: Callable[..., Any], func: Callable[..., Any], args: tuple, kwargs: dict | None,
           policy: str) -> Any:
    """The block run eagerly (measured, or as the plan says), then the compiled code brought up to
    date with the plan if it is solved."""
    _state["inside"] += 1
    try:
        out = eager(func, args, kwargs, policy)
    finally:
        _state["inside"] -= 1
    check(policy, out)
    return out


def check(policy: str, out: Any = None) -> None:
    """Invalidate the compilations made with another plan than the solved one, once the step's
    backward begins (``out``'s gradient; at once if none): the step under way keeps running the code
    it started with."""
    if not _CODES or _state["resets"] >= RESETS or _state["inside"] and out is None:
        return  # (inside _eager: checked after the call, with its output)
    size = settings.budget_bytes(policy)
    plan = PLANNER.plans.get(size) if PLANNER.solved_for == size else None
    if plan is None or not _stale(plan):
        return
    tensor = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(t, Tensor) and t.requires_grad), None)
    if tensor is None:
        _invalidate(_stale(plan))
    else:  # (a hook per call until one fires: the first finds them, the others nothing)
        def hook(grad: Tensor) -> Tensor:
            _invalidate(_stale(plan))
            return grad

        tensor.register_hook(hook)


def _stale(plan: Any) -> list[tuple[Any, set]]:
    """The compilations made with another plan than ``plan``: (code object, compile ids)."""
    found = []
    for code, traced in _CODES.items():
        ids = {c for c, p in traced if p is not plan}
        if ids:
            found.append((code, ids))
    return found


def _invalidate(stale: list[tuple[Any, set]]) -> None:
    """Invalidate these compilations (code object, compile ids) in dynamo's cache."""
    if not stale:
        return
    _state["resets"] += 1
    for code, ids in stale:
        left = [(c, p) for c, p in _CODES.get(code, ()) if c not in ids]
        if left:
            _CODES[code] = left
        else:
            _CODES.pop(code, None)
        try:
            from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
            from torch._dynamo.guards import DeletedGuardManagerWrapper

            if None in ids:
                raise LookupError("compile ids unknown")
            for entry in _debug_get_cache_entry_list(code):
                manager: Any = entry.guard_manager
                if entry.compile_id in ids and not isinstance(manager, DeletedGuardManagerWrapper):
                    manager.extra_state.invalidate(
                        manager.cache_entry, DeletedGuardManagerWrapper("gradpatch: the checkpoint plan changed"))
        except Exception:  # not this torch's cache layout: the code object's whole cache
            torch._dynamo.reset_code(code)


def forget() -> None:
    """Invalidate every compilation made with a plan (:func:`gradpatch.checkpointing.budget.reset`):
    the next calls measure again."""
    stale = [(code, {c for c, _ in traced}) for code, traced in _CODES.items()]
    _CODES.clear()
    if stale:
        _invalidate(stale)
