"""The ``budget:<size>`` policy at run time (:mod:`gradpatch.checkpointing.budget`): each checkpointed
call (:func:`run`), the plan's report (:func:`checkpoint_plan`) and :func:`reset`."""
from __future__ import annotations

from typing import Any, Callable

import torch

from gradpatch import settings
from gradpatch.checkpointing import paths
from gradpatch.checkpointing.budget import compiled, forward_start, measure, peak, peak_report, resizes, traced
from gradpatch.checkpointing.budget.key import signature, size_of, state
from gradpatch.checkpointing.budget.planner import PLANNER, TIMING_CALLS
from gradpatch.checkpointing.budget.report import Plan, PlanEntry
from gradpatch.checkpointing.compat import is_compiling

__all__ = ["checkpoint_plan", "Plan", "PlanEntry", "reset", "run", "TIMING_CALLS"]

compiled.watch()  # blocks a compiled region cannot plan: warn once


def run(func: Callable[..., Any], args: tuple, kwargs: dict | None, policy: str) -> Any:
    """``checkpoint``'s work under ``policy = "budget:<size>"``, called with ``flag=True`` in grad
    mode: ``func`` runs directly if the plan keeps it, checkpointed (and measured) otherwise.
    ``"peak:<size>"`` goes to :func:`gradpatch.checkpointing.budget.peak.run`. In a compiled region,
    either plan is baked into the graph (:mod:`~gradpatch.checkpointing.budget.traced`)."""
    if is_compiling():  # the plan baked into the compiled graph (measured eagerly: this function)
        return traced.run(func, args, kwargs, policy, run)
    if forward_start.steps_eager():  # a compiled model's step run eagerly: blocks timed without dynamo
        return _without_dynamo(func, args, kwargs, policy)
    return _run(func, args, kwargs, policy)


def _run(func: Callable[..., Any], args: tuple, kwargs: dict | None, policy: str) -> Any:
    if policy[0] == "p":
        out = peak.run(func, args, kwargs, policy, traced.inside())
        traced.check(policy, out)  # a plan made since code was compiled: compiled anew
        return out
    owner = getattr(func, "__self__", None)
    function = getattr(func, "__func__", None)
    if not isinstance(owner, torch.nn.Module) or function is None:
        return paths.run(func, args, kwargs)
    block = PLANNER.block(owner, (function, state(owner), signature(args, kwargs)))
    if measure.measuring():  # which shared storages this call holds while it is recomputed
        measure.consumers(block, args if kwargs is None else (*args, *kwargs.values()))
    size = settings.budget_bytes(policy)
    if PLANNER.solved_for != size and (block.measured or PLANNER.kept_for not in (None, size)):
        PLANNER.solve(size)
        traced.check(policy)  # compiled code with another plan is compiled anew
    if block.keep:
        if size_of(args, kwargs) <= block.largest:
            return func(*args, **(kwargs or {}))
        # Larger inputs than measured in this shape bucket: it may keep more than the plan counted.
        # Recompute and measure this call; the plan is solved again with what it keeps.
        block.keep = False
        PLANNER.void()
        return measure.measure(block, func, args, kwargs)
    if block.measured:
        return paths.run(func, args, kwargs)
    return measure.measure(block, func, args, kwargs)


#: :func:`_run` with dynamo's frame callback off: under a mode that makes dynamo skip each frame, the
#: callback still runs for every Python frame, which would count in the blocks' measured seconds.
_without_dynamo = torch._dynamo.disable(_run)


def checkpoint_plan(model: torch.nn.Module | None = None) -> Plan:
    """The current plan of the ``budget:<size>`` policy: every block it has seen, alive, with its
    figures (estimates from the measured calls) and whether it is recomputed. With ``model``, only
    that model's blocks, named by their path in it (``output_blocks.5.1.transformer_blocks.0``).
    """
    policy = settings.checkpoint_policy
    if settings.is_budget(policy):  # measured since the last call: plan now
        PLANNER.solve(settings.budget_bytes(policy))
    if settings.is_peak(policy):
        return peak_report.report(model, policy)
    paths_in = {id(m): p for p, m in model.named_modules()} if model is not None else None
    entries = []
    for owner, block in PLANNER.live():  # the current blocks
        if paths_in is not None and id(owner) not in paths_in:
            continue
        name = block.name if paths_in is None else f"{paths_in[id(owner)]}.{block.name.split('.')[-1]}"
        known = block.measured and not block.opaque
        size = block.added if block.added is not None and known else block.step_bytes
        entries.append(PlanEntry(name, size, block.seconds if known else None,
                                 not block.keep, block.measured, block.why if block.opaque else None))
    plan = Plan(entries)
    plan.policy = settings.checkpoint_policy
    plan.budget = settings.budget_bytes(plan.policy) if settings.is_budget(plan.policy) else None
    return plan


def reset() -> None:
    """Forget every measurement and plan: the next steps measure again."""
    PLANNER.reset()
    peak.PEAK.reset()
    resizes.planning(False)
    forward_start.planning(False)
    traced.forget()
