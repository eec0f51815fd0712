"""The ``budget:<size>`` checkpoint policy: choosing which blocks to keep.

Torch-free: the knapsack, and the :class:`Plan` that :func:`gradpatch.checkpoint_plan` returns. The
size is parsed and validated by :mod:`gradpatch.settings` (at start-up too); the measurement and the
per-call dispatch live in :mod:`gradpatch.checkpointing.budget`.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from gradpatch.settings import EXAMPLE, PREFIX, budget_bytes, is_budget, parse_size  # noqa: F401 (the policy's size)

#: Byte resolution of the fallback knapsack: item sizes are rounded up to budget / _STEPS, so a plan
#: never exceeds its budget and forgoes at most (number of blocks) / _STEPS of it.
_STEPS = 4096


class Item(NamedTuple):
    bytes: int  # what keeping it costs
    seconds: float  # what keeping it saves


def choose(items: Sequence[Item], budget: int) -> list[bool]:
    """Which items to keep so that their seconds add up to the most while their bytes stay within
    ``budget``: a 0/1 knapsack. Solved exactly over the Pareto frontier of (bytes, seconds) subsets,
    which stays small for a few dozen blocks of a few distinct sizes; beyond :data:`_FRONTIER`
    subsets, by dynamic programming over bytes rounded up to budget/4096 (never over the budget,
    within about n/4096 of it of the best). Items that cost nothing are kept; others that save
    nothing are not."""
    keep = [it.bytes <= 0 for it in items]
    candidates = [i for i, it in enumerate(items)
                  if not keep[i] and 0 < it.seconds and it.bytes <= budget]
    chosen = _frontier(items, candidates, budget)
    if chosen is None:
        chosen = _rounded(items, candidates, budget)
    for i in chosen:
        keep[i] = True
    return keep


#: Most subsets the exact solver tracks before it falls back to rounded sizes.
_FRONTIER = 20000


def _frontier(items: Sequence[Item], candidates: list[int], budget: int) -> list[int] | None:
    front: list[tuple[int, float, int]] = [(0, 0.0, 0)]  # (bytes, seconds, bitmask of candidates)
    for k, i in enumerate(candidates):
        size, seconds = items[i]
        grown = [(b + size, s + seconds, m | 1 << k) for b, s, m in front if b + size <= budget]
        merged = sorted(front + grown, key=lambda f: (f[0], -f[1]))
        front = []
        for entry in merged:  # keep only subsets faster than every smaller one
            if not front or entry[1] > front[-1][1]:
                front.append(entry)
        if len(front) > _FRONTIER:
            return None
    mask = max(front, key=lambda f: f[1])[2]
    return [i for k, i in enumerate(candidates) if mask >> k & 1]


def _rounded(items: Sequence[Item], candidates: list[int], budget: int) -> list[int]:
    if not candidates:
        return []
    unit = -(-budget // _STEPS)
    capacity = budget // unit
    best = [0.0] * (capacity + 1)  # best[c]: most seconds within c units, over items so far
    taken: list[bytearray] = []  # taken[k][c]: candidate k is in the best set for c units
    for i in candidates:
        weight, seconds, row = -(-items[i].bytes // unit), items[i].seconds, bytearray(capacity + 1)
        for c in range(capacity, weight - 1, -1):
            value = best[c - weight] + seconds
            if value > best[c]:
                best[c], row[c] = value, 1
        taken.append(row)
    chosen, c = [], capacity
    for i, row in zip(reversed(candidates), reversed(taken)):
        if row[c]:
            chosen.append(i)
            c -= -(-items[i].bytes // unit)
    return chosen


class Shared(NamedTuple):
    """A storage that several items may keep (one item's output saved by its last op and taken by
    the next as input): it costs its bytes once, if a keeping item is kept and no item that holds it
    anyway (a consumer, holding it while it is recomputed) is recomputed."""

    bytes: int
    producers: Sequence[int]  # items whose keeping keeps it
    consumers: Sequence[int]  # items that hold it while they are recomputed


def kept_bytes(items: Sequence[Item], shared: Sequence[Shared], keep: Sequence[bool]) -> list[int]:
    """What each item adds to memory when ``keep`` says which are kept: its own bytes, and each shared
    storage it is the first kept producer of that no recomputed consumer holds (0 for recomputed
    items). The sum is what the kept items keep together."""
    out = [it.bytes if k else 0 for it, k in zip(items, keep)]
    for s in shared:
        first = next((i for i in s.producers if keep[i]), None)
        if first is not None and all(keep[c] for c in s.consumers):
            out[first] += s.bytes
    return out


def choose_shared(items: Sequence[Item], shared: Sequence[Shared], budget: int) -> list[bool]:
    """:func:`choose` where items share storages: the knapsack over each item's cost when kept alone,
    re-solved with less room while the chosen set together exceeds ``budget``, then filled up with
    the items that still fit (by seconds per byte they add), counted exactly by :func:`kept_bytes`.
    Never over ``budget``."""
    if not shared:
        return choose(items, budget)
    n = len(items)

    def cost(keep: Sequence[bool]) -> int:
        return sum(kept_bytes(items, shared, keep))

    alone = [Item(cost([j == i for j in range(n)]), it.seconds) for i, it in enumerate(items)]
    room, keep = budget, choose(alone, budget)
    for _ in range(8):
        over = cost(keep) - budget
        if over <= 0:
            break
        room -= over
        keep = choose(alone, max(room, 0))
    while cost(keep) > budget:  # still over: drop what saves least per byte
        kept = [i for i in range(n) if keep[i]]
        keep[min(kept, key=lambda i: items[i].seconds / max(alone[i].bytes, 1))] = False
    while True:  # fill up: what fits now, most seconds per added byte first
        total, best, pick = cost(keep), None, None
        for i in range(n):
            if keep[i] or items[i].seconds <= 0:
                continue
            keep[i] = True
            added = cost(keep) - total
            keep[i] = False
            if total + added <= budget:
                rate = items[i].seconds / max(added, 1)
                if best is None or rate > best:
                    best, pick = rate, i
        if pick is None:
            return keep
        keep[pick] = True


class PlanEntry(NamedTuple):
    """One planned block: its name (module class and method, or path with ``model=``), the bytes
    keeping its activations costs (for a kept block, what it adds to the plan: a storage that kept
    blocks share counts in the first; for a recomputed one, what keeping it alone would add) and the seconds recomputing it costs (its recompute in backward
    and the checkpoint's own work in the forward: what keeping it saves), both per step, over all
    its calls; whether the plan recomputes it; whether it is measured. ``None`` figures: not
    measured yet, or never measurable (a block torch's own checkpoint runs: always recomputed)."""

    name: str
    bytes: int | None
    recompute_seconds: float | None
    recomputed: bool
    measured: bool = True


class Plan(tuple):  # type: ignore[type-arg]
    """A tuple of :class:`PlanEntry`, in the order the blocks first ran, that prints as a table."""

    policy: str
    budget: int | None

    @property
    def kept_bytes(self) -> int:
        """What the kept blocks keep together beyond recomputing all (storages they share counted
        once): the estimate of the extra bytes alive after the forward."""
        return sum(e.bytes or 0 for e in self if not e.recomputed)

    @property
    def saved_seconds(self) -> float:
        return sum(e.recompute_seconds or 0.0 for e in self if not e.recomputed)

    @property
    def complete(self) -> bool:
        return bool(self) and all(e.measured for e in self)

    def summary(self) -> str:
        head = f"checkpoint policy {self.policy}"
        if not self:
            return f"{head}: no checkpointed block has run yet"
        kept = sum(not e.recomputed for e in self)
        if not self.complete:
            return (f"{head}: measuring ({sum(e.measured for e in self)} of "
                    f"{len(self)} blocks measured); every block is recomputed meanwhile")
        return (f"{head}: {kept} of {len(self)} blocks kept, {_mib(self.kept_bytes)} of "
                f"{_mib(self.budget or 0)}, saving about {self.saved_seconds * 1e3:.1f} ms a step")

    def __str__(self) -> str:
        width = max(len(e.name) for e in self) if self else 5
        rows = [f"{'block':{width}} {'kept bytes':>12} {'recompute':>10}  plan"]
        for e in self:
            size = "?" if e.bytes is None else _mib(e.bytes)
            time_ = "?" if e.recompute_seconds is None else f"{e.recompute_seconds * 1e3:.2f}ms"
            rows.append(f"{e.name:{width}} {size:>12} {time_:>10}  "
                        f"{'recompute' if e.recomputed else 'keep'}")
        return "\n".join([self.summary(), *rows])

    def __repr__(self) -> str:
        return str(self)


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"
