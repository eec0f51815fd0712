"""The ``budget:<size>`` checkpoint policy: measure each checkpointed block, then keep the ones that
save the most time within the budget.

A block is a module's method passed to :func:`gradpatch.checkpointing.checkpoint.checkpoint` with
``flag=True`` (upstream's ``checkpoint(self._forward, inputs, self.parameters(), flag)``), at given
input shapes, dtypes, devices and autocast state, and in a given state of its module: training mode,
which of its parameters require grad, their dtype. A change of any of these (gradual unfreezing,
``train()`` after ``eval()``, autocast turned on, ``half()``) makes a new block, measured again: what
a block keeps follows them. The module's state is one key per call (its parameters' flags read from
a list kept per module, walked again only after a parameter or submodule was registered anywhere).
Blocks the caller does not ask to checkpoint (``flag=False``) run directly, as under ``respect``; so do all blocks under ``no_grad``.

**Measurement** (each block's first :data:`TIMING_CALLS` calls at new shapes). The block is
checkpointed as under ``respect``. The checkpoint's forward runs ``func`` as the caller would,
building its graph before dropping it; during it, :class:`torch.autograd.graph.saved_tensors_hooks`
count, once per storage, the bytes of the tensors autograd saves, leaving out the storages of the
inputs and of the module's parameters and buffers (kept anyway) and less the CPU RNG state the
checkpoint keeps: what keeping the block keeps. A saved storage still alive after the call (its
output saved by its last op, as ``sigmoid`` does) is shared: the next checkpointed block takes it as
input and holds it anyway while recomputed, so it costs only where every block taking it is kept,
and once however many blocks keep it (``gradpatch.checkpointing._measure``). No extra run and no extra memory: gradients and the
step's peak are ``respect``'s. Timed (thread CPU time on one CPU thread, wall time after a device
synchronisation otherwise): the recompute in backward, and the checkpoint's forward call beyond
``func`` itself; their sum, fastest of the measured calls each, is what keeping the block saves.

**Plan.** A block is a knapsack item per input signature. Once every block called since the last
new one appeared has been measured (normally after the first :data:`TIMING_CALLS` training steps),
a 0/1 knapsack (:func:`gradpatch.checkpointing.plan.choose`) picks the blocks to keep (run without
recompute): the most seconds saved with at most ``<size>`` bytes kept, shared storages counted once
and only where they cost (:func:`gradpatch.checkpointing.plan.choose_shared`). Kept blocks run ``func(*inputs)``
directly, exactly as under ``never``. New shapes (batch size, resolution) make new blocks, which are
checkpointed and measured; blocks not called since drop out of the next plan, solved once the new
ones are measured. Meanwhile kept blocks at unchanged shapes stay kept, so the kept total never
exceeds the last plan's.

A block called several times per step (shared weights), or measured again before an earlier call's
backward, counts as many times as its calls' graphs were alive at once. Limits: only module methods
are planned (other functions are always checkpointed); blocks inside torch.compile regions take
torch's checkpoint and are always recomputed (one ``ConfigWarning`` says so; see
:mod:`gradpatch.checkpointing._budget_compile`); blocks whose first call goes to torch's own
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

from gradpatch.checkpointing import _measure as _bytes
from gradpatch.checkpointing import plan as budget
from gradpatch.checkpointing._block_key import signature, state
from gradpatch.checkpointing._compat import is_compiling
from gradpatch.checkpointing._budget_compile import watch as _watch_compilation
from gradpatch.checkpointing._measure import _Measured, measure
from gradpatch.checkpointing._paths import run as _checkpoint
from gradpatch.checkpointing.plan import Plan, PlanEntry

__all__ = ["checkpoint_plan", "Plan", "PlanEntry", "reset"]

_watch_compilation()  # compiled regions are not planned: warn once when one is compiled

#: Calls measured per block before it is planned: the first one runs with cold caches.
TIMING_CALLS = 2


class _Block:
    """One module method at one input signature (shapes, dtypes, devices, ``requires_grad``,
    autocast): one item of the knapsack."""

    __slots__ = ("name", "order", "seen", "bytes", "forward", "overhead", "recompute", "keep",
                 "pending", "per_step", "opaque", "shared", "consumers", "holds", "anyway", "added",
                 "__weakref__")

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
        self.shared: dict[int, int] = {}  # storages it saves that outlive its call: id -> bytes
        self.consumers: dict[int, set[_Block]] = {}  # id -> blocks taking it as input
        self.holds: set[int] = set()  # shared storages it takes as input and saves when kept
        self.anyway: set[int] = set()  # shared storages held by others (alive at backward)
        self.added: int | None = None  # what it adds to the current plan (kept) or alone

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
            if _bytes._LIVE and all(b.measured for b in every):
                _bytes.prune()
            if not all(b.measured for b in blocks):
                if size != self.kept_for:  # kept for another budget: recompute all meanwhile
                    for b in every:
                        b.keep = False
                    self.kept_for = None
                return
            plan = self.plans.get(size)
            if plan is None:
                items, shared = _items(blocks)
                keep = budget.choose_shared(items, shared, size)
                added = budget.kept_bytes(items, shared, keep)
                alone = [sum(budget.kept_bytes(items, shared, [j == i for j in range(len(blocks))]))
                         for i in range(len(blocks))] if shared else [it.bytes for it in items]
                plan = self.plans[size] = [(b, k, a if k else a1)
                                           for b, k, a, a1 in zip(blocks, keep, added, alone)]
            for b in every:
                b.keep, b.added = False, None
            for b, k, a in plan:
                b.keep, b.added = k, a
            self.solved_for = self.kept_for = size


def _items(blocks: list[_Block]) -> tuple[list[budget.Item], list[budget.Shared]]:
    """The knapsack's items (opaque blocks: no bytes known, nothing saved) and shared storages."""
    index = {id(b): i for i, b in enumerate(blocks)}
    items = [budget.Item(1 if b.opaque else b.step_bytes or 0, b.seconds) for b in blocks]
    found: dict[int, tuple[int, list[int], set]] = {}
    for i, b in enumerate(blocks):
        for sid, size in b.shared.items():
            if sid in b.anyway:
                continue
            entry = found.setdefault(sid, (0, [], set()))
            found[sid] = (max(entry[0], size * b.per_step), [*entry[1], i],
                          entry[2] | b.consumers.get(sid, set()))
    shared = []
    for sid, (size, producers, consumers) in found.items():
        if any(c.opaque or sid in c.holds for c in consumers):
            continue  # held by a block whether kept or recomputed: never costs
        shared.append(budget.Shared(size, producers, [index[id(c)] for c in consumers
                                                       if id(c) in index]))
    return items, shared


_PLANNER = _Planner()


def run(func: Callable[..., Any], args: tuple, kwargs: dict | None, policy: str) -> Any:
    """``checkpoint``'s work under ``policy = "budget:<size>"``, called with ``flag=True`` in grad
    mode: ``func`` runs directly if the plan keeps it, checkpointed (and measured) otherwise."""
    owner = getattr(func, "__self__", None)
    function = getattr(func, "__func__", None)
    if not isinstance(owner, torch.nn.Module) or function is None or is_compiling():
        return _checkpoint(func, args, kwargs)
    block = _PLANNER.block(owner, (function, state(owner), signature(args, kwargs)))
    if _bytes._LIVE:  # measuring: which shared storages this call holds while it is recomputed
        _bytes.consumers(block, args if kwargs is None else (*args, *kwargs.values()))
    size = budget.budget_bytes(policy)
    if _PLANNER.solved_for != size and (block.measured or _PLANNER.kept_for not in (None, size)):
        _PLANNER.solve(size)
    if block.keep:
        return func(*args, **(kwargs or {}))
    if block.measured:
        return _checkpoint(func, args, kwargs)
    return measure(block, func, args, kwargs)


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
        size = block.added if block.added is not None and known else block.step_bytes
        entries.append(PlanEntry(name, size, block.seconds if known else None,
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
        _bytes._LIVE.clear()
        _bytes._UNCHECKED.clear()
