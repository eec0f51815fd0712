"""The blocks the ``budget:<size>`` policy measures and the plans over them
(:mod:`gradpatch.checkpointing.budget`): :class:`Block`, one knapsack item, and :class:`Planner`, which
keys blocks, voids plans when new ones appear and solves the knapsack
(:mod:`gradpatch.checkpointing.budget.knapsack`) once every current block is measured."""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from gradpatch.checkpointing.budget import knapsack, measure
from gradpatch.checkpointing.budget.measure import Measured

#: Calls measured per block before it is planned: the first one runs with cold caches.
TIMING_CALLS = 2


class Block:
    """One module method at one input signature (shapes, dtypes, devices, ``requires_grad``,
    autocast): one item of the knapsack."""

    __slots__ = ("name", "order", "seen", "bytes", "forward", "overhead", "recompute", "keep",
                 "pending", "per_step", "opaque", "shared", "consumers", "holds", "anyway", "added",
                 "why", "largest", "__weakref__")

    def __init__(self, name: str, order: int) -> None:
        self.name, self.order, self.seen = name, order, -1
        self.bytes: int | None = None
        self.keep = self.opaque = False  # opaque: its bytes cannot be counted; always recomputed
        self.forward: list[float] = []  # func in the checkpoint's forward
        self.overhead: list[float] = []  # the checkpointed forward call beyond func itself
        self.recompute: list[float] = []  # the recompute in backward
        # Measured calls whose graph is alive and not yet recomputed: more than one at a time is a
        # block called several times per step (or several forwards before a backward).
        self.pending: weakref.WeakSet[Measured] = weakref.WeakSet()
        self.per_step = 1  # the most such calls seen: bytes and seconds count that many times
        self.shared: dict[int, int] = {}  # storages it saves that outlive its call: id -> bytes
        self.consumers: dict[int, set[Block]] = {}  # id -> blocks taking it as input
        self.holds: set[int] = set()  # shared storages it takes as input and saves when kept
        self.anyway: set[int] = set()  # shared storages held by others (alive at backward)
        self.added: int | None = None  # what it adds to the current plan (kept) or alone
        self.why: str | None = None  # why it is not planned (opaque: torch's checkpoint ran it)
        self.largest = 0  # the largest input size (elements) measured: kept only up to it

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


class Planner:
    """The blocks, and plans over the current ones: those called since the last new block appeared
    (``epoch``). A new block (new shapes) voids the plans; the blocks not called since are left out
    of the next, and are recomputed if they run again before it is solved anew."""

    def __init__(self) -> None:
        self.blocks: weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, Block]] = \
            weakref.WeakKeyDictionary()
        self.count = self.epoch = 0
        self.solved_for: int | None = None  # the budget of the current plan; None: none
        self.kept_for: int | None = None  # the budget the blocks' keep flags were chosen for
        self.plans: dict[int, list[tuple[Block, bool, int]]] = {}  # budget -> plan, current blocks
        self.lock = threading.Lock()

    def block(self, owner: torch.nn.Module, key: tuple) -> Block:
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
                found = per_owner[key] = Block(name, self.count)
                # Void the plans; the kept flags of the others stay: their bytes did not change,
                # so the kept total stays within the budget.
                self.solved_for = None
                self.plans.clear()
        found.seen = self.epoch
        return found

    def void(self) -> None:
        """Solve the plan again at the next call (a kept block measured anew at a larger size)."""
        with self.lock:
            self.solved_for = None
            self.plans.clear()

    def reset(self) -> None:
        """Forget every block and plan."""
        with self.lock:
            self.blocks = weakref.WeakKeyDictionary()
            self.solved_for = self.kept_for = None
            self.plans.clear()
            self.epoch += 1
            measure.forget()

    def live(self, current: bool = True) -> list[tuple[torch.nn.Module, Block]]:
        """The blocks (only those called in the current epoch if ``current``), in creation order."""
        return sorted(((owner, b) for owner, per_owner in list(self.blocks.items())
                       for b in per_owner.values() if not current or b.seen == self.epoch),
                      key=lambda pair: pair[1].order)

    def solve(self, size: int) -> None:
        """Choose the kept blocks if every current block is measured."""
        with self.lock:
            every = [b for _, b in self.live(current=False)]
            blocks = [b for b in every if b.seen == self.epoch]
            if measure.measuring() and all(b.measured for b in every):
                measure.prune()
            if not all(b.measured for b in blocks):
                if size != self.kept_for:  # kept for another budget: recompute all meanwhile
                    for b in every:
                        b.keep = False
                    self.kept_for = None
                return
            plan = self.plans.get(size)
            if plan is None:
                items, shared = items_of(blocks)
                keep = knapsack.choose_shared(items, shared, size)
                added = knapsack.kept_bytes(items, shared, keep)
                alone = knapsack.alone_bytes(items, shared)
                plan = self.plans[size] = [(b, k, a if k else a1)
                                           for b, k, a, a1 in zip(blocks, keep, added, alone)]
            for b in every:
                b.keep, b.added = False, None
            for b, k, a in plan:
                b.keep, b.added = k, a
            self.solved_for = self.kept_for = size


def items_of(blocks: list[Block]) -> tuple[list[knapsack.Item], list[knapsack.Shared]]:
    """The knapsack's items (opaque blocks: no bytes known, nothing saved) and shared storages."""
    index = {id(b): i for i, b in enumerate(blocks)}
    items = [knapsack.Item(1 if b.opaque else b.step_bytes or 0, b.seconds) for b in blocks]
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
        shared.append(knapsack.Shared(size, producers, [index[id(c)] for c in consumers
                                                       if id(c) in index]))
    return items, shared


#: The process's planner.
PLANNER = Planner()
