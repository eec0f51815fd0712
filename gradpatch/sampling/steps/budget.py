"""``checkpoint_steps="budget:<size>"``: keep the graphs of as many denoiser evaluations as fit in
``<size>`` bytes and recompute the others in backward.

What keeping an evaluation costs is measured, not estimated: the first evaluation of each input
signature (shapes, dtypes, devices of the tensor arguments) is checkpointed and counts the bytes of
the storages it saved for backward that were freed when it returned
(:func:`gradpatch.sampling.steps.checkpoint.measured`, the way the block budget planner counts a
block's own bytes: storages that stay alive anyway, such as inputs, parameters and the output, are
not counted). Later evaluations keep their graph while the bytes kept so far plus that cost fit in the
budget, in the order they run, and are checkpointed from then on. A kept evaluation runs gradpatch's
block checkpoints inside it plainly, as the measured one did. Gradients equal those of
``checkpoint_steps=False`` whichever evaluations are kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from gradpatch.sampling.steps import checkpoint as step_checkpoint

T = TypeVar("T")


@dataclass
class StepBudget:
    """The budget of one ``cache=False`` call: its size, the cost per signature, what was kept."""

    size: int
    costs: dict[tuple, int] = field(default_factory=dict)
    kept_bytes: int = 0
    kept: int = 0
    recomputed: int = 0


def _signature(args: tuple, kwargs: dict) -> tuple:
    return tuple((tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else None
                 for v in (*args, *kwargs.values()))


def evaluate(budget: StepBudget, fn: Callable[..., T], args: tuple, kwargs: dict,
             recompute: Callable[[Callable[..., T], tuple, dict], T]) -> T:
    """Run one evaluation under ``budget``: measured and recomputed, kept, or recomputed (by
    ``recompute``, the call's own: :meth:`gradpatch.sampling.run.SamplingRun.recomputed`)."""
    key = _signature(args, kwargs)
    cost = budget.costs.get(key)
    if cost is None:
        out, budget.costs[key] = step_checkpoint.measured(fn, *args, **kwargs)
        budget.recomputed += 1
        return out
    if budget.kept_bytes + cost <= budget.size:
        budget.kept_bytes += cost
        budget.kept += 1
        return step_checkpoint.kept(fn, *args, **kwargs)
    budget.recomputed += 1
    return recompute(fn, args, kwargs)
