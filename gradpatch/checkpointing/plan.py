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


class PlanEntry(NamedTuple):
    """One planned block: its name (module class and method, or path with ``model=``), the bytes
    keeping its activations costs and the seconds recomputing it costs (its recompute in backward
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
