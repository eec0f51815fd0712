"""The ``budget:<size>`` checkpoint policy: measure each checkpointed block, then keep the ones that
save the most time within the budget.

A block is a module's method passed to :func:`gradpatch.fixes.checkpoint.checkpoint` with
``flag=True`` (upstream's ``checkpoint(self._forward, inputs, self.parameters(), flag)``), at given
input shapes, dtypes, devices and autocast state. Blocks the caller does not ask to checkpoint
(``flag=False``) run directly, as under ``respect``; so do all blocks under ``no_grad``.

**Measurement** (each block's first :data:`TIMING_CALLS` calls at new shapes). The block is
checkpointed as under ``respect``. The checkpoint's forward runs ``func`` as the caller would,
building its graph before dropping it; during it, :class:`torch.autograd.graph.saved_tensors_hooks`
count, once per storage, the bytes of the tensors autograd saves, leaving out the storages of the
inputs and of the module's parameters and buffers (kept anyway) and less the CPU RNG state the
checkpoint keeps: what keeping the block keeps. No extra run and no extra memory: gradients and the
step's peak are ``respect``'s. Timed (thread CPU time on one CPU thread, wall time after a device
synchronisation otherwise): the recompute in backward, and the checkpoint's forward call beyond
``func`` itself; their sum, fastest of the measured calls each, is what keeping the block saves.

**Plan.** A block is a knapsack item per input signature. Once every block called since the last
new one appeared has been measured (normally after the first :data:`TIMING_CALLS` training steps),
a 0/1 knapsack (:func:`gradpatch.budget.choose`) picks the blocks to keep (run without recompute):
the most seconds saved with at most ``<size>`` bytes kept. Kept blocks run ``func(*inputs)``
directly, exactly as under ``never``. New shapes (batch size, resolution) make new blocks, which are
checkpointed and measured; blocks not called since drop out of the next plan, solved once the new
ones are measured. Meanwhile kept blocks at unchanged shapes stay kept, so the kept total never
exceeds the last plan's.

A block called several times per step (shared weights), or measured again before an earlier call's
backward, counts as many times as its calls' graphs were alive at once. Limits: only module methods
are planned (other functions are always checkpointed); blocks inside torch.compile regions take
torch's checkpoint and are always recomputed (one ``ConfigWarning`` says so; see
:mod:`gradpatch.fixes._budget_compile`); blocks whose first call goes to torch's own
checkpoint (the graph path at once, as DataParallel replicas do) cannot be counted and are always
recomputed; shapes that never repeat are measured at
every step and never planned; a few shapes that alternate from step to step are planned together,
as if all were alive in one step (within the budget, keeping less than a plan per shape would).
The figures are estimates from the measured calls: see :func:`checkpoint_plan`.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch
from torch import Tensor

from gradpatch import budget
from gradpatch.budget import Plan, PlanEntry
from gradpatch.fixes._compat import autocast_enabled, is_compiling
from gradpatch.fixes._budget_compile import watch as _watch_compilation
from gradpatch.fixes._budget_measure import _Measured, measure
from gradpatch.fixes.checkpoint import _checkpoint

__all__ = ["checkpoint_plan", "Plan", "PlanEntry", "reset"]

_watch_compilation()  # compiled regions are not planned: warn once when one is compiled

#: Calls measured per block before it is planned: the first one runs with cold caches.
TIMING_CALLS = 2


class _Block:
    """One module method at one input signature (shapes, dtypes, devices, ``requires_grad``,
    autocast): one item of the knapsack."""

    __slots__ = ("name", "order", "seen", "bytes", "forward", "overhead", "recompute", "keep",
                 "pending", "per_step", "opaque", "__weakref__")

    def __init__(self, name: str, order: int) -> None:
        self.name, self.order, self.seen = name, order, -1
        self.bytes: int | None = None
        self.keep = self.opaque = False  # opaque: its bytes cannot be counted; always recomputed
        self.forward: list[float] = []  # func in the checkpoint's forward
        self.overhead: list[float] = []  # the checkpointed forward call beyond func itself
        self.recompute: list[float] = []  # the recompute in backward
        # Measured calls whose graph is alive and not yet recomputed: more than one at a time is a
        # block called several times per step (or several forwards before a backward).
        self.pending: weakref.WeakSet[_Measured] = weakref.WeakSet()
        self.per_step = 1  # the most such calls seen: bytes and seconds count that many times

    @property
    def measured(self) -> bool:
        # A block that keeps nothing (nothing in it requires grad) is never recomputed; nor is one
        # whose output the loss does not use: it is measured when its forward calls are.
        return self.opaque or self.bytes is not None and (
            len(self.recompute) >= TIMING_CALLS or self.bytes == 0
            or len(self.overhead) > 2 * TIMING_CALLS)

    @property
    def step_bytes(self) -> int | None:
        """What keeping this block keeps at once, all its calls in a step together."""
        return None if self.bytes is None else self.bytes * self.per_step

    @property
    def seconds(self) -> float:
        """What keeping this block saves per step: its recompute and the checkpoint's own work in
        the forward, for each call (0 until measured)."""
        if not self.measured or self.opaque:
            return 0.0
        return self.per_step * ((min(self.recompute) if self.recompute else 0.0) + min(self.overhead))


#: Signatures remembered per module method; the least recently called are forgotten first.
_SIGNATURES = 16


class _Planner:
    """The blocks, and plans over the current ones: those called since the last new block appeared
    (``epoch``). A new block (new shapes) voids the plans; the blocks not called since are left out
    of the next, and are recomputed if they run again before it is solved anew."""

    def __init__(self) -> None:
        self.blocks: weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, _Block]] = \
            weakref.WeakKeyDictionary()
        self.count = self.epoch = 0
        self.solved_for: int | None = None  # the budget of the current plan; None: none
        self.kept_for: int | None = None  # the budget the blocks' keep flags were chosen for
        self.plans: dict[int, list[tuple[_Block, bool]]] = {}  # budget -> plan, current blocks
        self.lock = threading.Lock()

    def block(self, owner: torch.nn.Module, key: tuple) -> _Block:
        per_owner = self.blocks.get(owner)
        found = None if per_owner is None else per_owner.get(key)
        if found is None:
            with self.lock:
                per_owner = self.blocks.setdefault(owner, {})
                same = [k for k in per_owner if k[0] is key[0]]
                if len(same) >= _SIGNATURES:
                    del per_owner[min(same, key=lambda k: per_owner[k].seen)]
                self.count += 1
                self.epoch += 1
                name = f"{type(owner).__name__}.{getattr(key[0], '__name__', '?')}"
                found = per_owner[key] = _Block(name, self.count)
                # Void the plans; the kept flags of the others stay: their bytes did not change,
                # so the kept total stays within the budget.
                self.solved_for = None
                self.plans.clear()
        found.seen = self.epoch
        return found

    def live(self, current: bool = True) -> list[tuple[torch.nn.Module, _Block]]:
        """The blocks (only those called in the current epoch if ``current``), in creation order."""
        return sorted(((owner, b) for owner, per_owner in list(self.blocks.items())
                       for b in per_owner.values() if not current or b.seen == self.epoch),
                      key=lambda pair: pair[1].order)

    def solve(self, size: int) -> None:
        """Choose the kept blocks if every current block is measured."""
        with self.lock:
            every = [b for _, b in self.live(current=False)]
            blocks = [b for b in every if b.seen == self.epoch]
            if not all(b.measured for b in blocks):
                if size != self.kept_for:  # kept for another budget: recompute all meanwhile
                    for b in every:
                        b.keep = False
                    self.kept_for = None
                return
            plan = self.plans.get(size)
            if plan is None:
                keep = budget.choose([budget.Item(b.step_bytes or 1, b.seconds) for b in blocks],
                                     size)  # opaque blocks: no bytes known, nothing saved
                plan = self.plans[size] = list(zip(blocks, keep))
            for b in every:
                b.keep = False
            for b, k in plan:
                b.keep = k
            self.solved_for = self.kept_for = size


_PLANNER = _Planner()


def run(func: Callable[..., Any], args: tuple, kwargs: dict | None, policy: str) -> Any:
    """``checkpoint``'s work under ``policy = "budget:<size>"``, called with ``flag=True`` in grad
    mode: ``func`` runs directly if the plan keeps it, checkpointed (and measured) otherwise."""
    owner = getattr(func, "__self__", None)
    function = getattr(func, "__func__", None)
    if not isinstance(owner, torch.nn.Module) or function is None or is_compiling():
        return _checkpoint(func, args, kwargs)
    block = _PLANNER.block(owner, (function, _signature(args, kwargs)))
    size = budget.budget_bytes(policy)
    if _PLANNER.solved_for != size and (block.measured or _PLANNER.kept_for not in (None, size)):
        _PLANNER.solve(size)
    if block.keep:
        return func(*args, **(kwargs or {}))
    if block.measured:
        return _checkpoint(func, args, kwargs)
    return measure(block, func, args, kwargs)


def _signature(args: tuple, kwargs: dict | None) -> tuple:
    values = args if kwargs is None else (*args, *kwargs.values())
    return (autocast_enabled("cpu"), autocast_enabled("cuda"),
            *[(v.shape, v.dtype, v.device, v.requires_grad) if isinstance(v, Tensor) else None
              for v in values])


def checkpoint_plan(model: torch.nn.Module | None = None) -> Plan:
    """The current plan of the ``budget:<size>`` policy: every block it has seen, alive, with its
    figures (estimates from the measured calls) and whether it is recomputed. With ``model``, only
    that model's blocks, named by their path in it (``output_blocks.5.1.transformer_blocks.0``).
    """
    from gradpatch import settings

    if budget.is_budget(settings.checkpoint_policy):  # measured since the last call: plan now
        _PLANNER.solve(budget.budget_bytes(settings.checkpoint_policy))
    paths = {id(m): p for p, m in model.named_modules()} if model is not None else None
    entries = []
    for owner, block in _PLANNER.live():  # the current blocks
        if paths is not None and id(owner) not in paths:
            continue
        name = block.name if paths is None else f"{paths[id(owner)]}.{block.name.split('.')[-1]}"
        known = block.measured and not block.opaque
        entries.append(PlanEntry(name, block.step_bytes, block.seconds if known else None,
                                 not block.keep, block.measured))
    plan = Plan(entries)
    plan.policy = settings.checkpoint_policy
    plan.budget = budget.budget_bytes(plan.policy) if budget.is_budget(plan.policy) else None
    return plan


def reset() -> None:
    """Forget every measurement and plan: the next steps measure again."""
    with _PLANNER.lock:
        _PLANNER.blocks = weakref.WeakKeyDictionary()
        _PLANNER.solved_for = _PLANNER.kept_for = None
        _PLANNER.plans.clear()
        _PLANNER.epoch += 1
