"""Which compiled code holds a checkpoint plan, and compiling it anew when the plan changes
(:mod:`gradpatch.checkpointing.budget.traced`).

Each compilation that traced a planned block is noted with the plan it was traced with (None while
measuring): its code object and its compile id (:func:`note`). When the plan is solved, the
compilations made with another plan are invalidated in dynamo's cache (:func:`invalidate`), each cache
entry by its compile id, as dynamo invalidates the entries guarding an object that died; where this
torch has no such entries, the code object's whole cache goes (``torch._dynamo.reset_code``). Other
compiled code keeps its entries. Past :data:`RESETS` resets nothing more is invalidated: no endless
recompilation where the plan keeps changing.
"""
from __future__ import annotations

from typing import Any

import torch

#: Compilations with a decision of ours inside: code object -> [(compile id, the plan it was traced
#: with, None while measuring)].
CODES: dict[Any, list] = {}
#: Resets made (see :data:`RESETS`).
_state = {"resets": 0}
RESETS = 16


def exhausted() -> bool:
    """Whether :data:`RESETS` resets were made: compiled code stays as it is."""
    return _state["resets"] >= RESETS


def breakable(check: bool = True) -> Any:
    """The code object dynamo is compiling if it may graph-break here (not ``fullgraph``, not under
    ``error_on_graph_break``, not inside a higher-order op); None otherwise or where this torch's
    tracer does not say. ``check=False``: the code object wherever it may be invalidated."""
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


def inside_op() -> bool:
    """Whether the trace under way is inside a higher-order op (a recomputed block, a user's checkpoint)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().output.current_tracer.parent is not None
    except Exception:
        return False


def note(code: Any, plan: Any) -> None:
    """At trace time: the compilation under way of ``code`` traced a block with ``plan``."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except Exception:  # another torch: the code's whole cache is reset
        compile_id = None
    traced = CODES.setdefault(code, [])
    if not any(c == compile_id and p is plan for c, p in traced):
        traced.append((compile_id, plan))


def stale(plan: Any) -> list[tuple[Any, set]]:
    """The compilations made with another plan than ``plan``: (code object, compile ids)."""
    found = []
    for code, traced in CODES.items():
        ids = {c for c, p in traced if p is not plan}
        if ids:
            found.append((code, ids))
    return found


def invalidate(compilations: list[tuple[Any, set]]) -> None:
    """Invalidate these compilations (code object, compile ids) in dynamo's cache."""
    if not compilations:
        return
    _state["resets"] += 1
    for code, ids in compilations:
        left = [(c, p) for c, p in CODES.get(code, ()) if c not in ids]
        if left:
            CODES[code] = left
        else:
            CODES.pop(code, None)
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
    """Invalidate every compilation made with a plan: the next calls measure again."""
    compilations = [(code, {c for c, _ in traced}) for code, traced in CODES.items()]
    CODES.clear()
    if compilations:
        invalidate(compilations)
