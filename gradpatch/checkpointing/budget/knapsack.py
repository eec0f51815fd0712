"""The ``budget:<size>`` checkpoint policy: choosing which blocks to keep (torch-free).

A 0/1 knapsack over the measured blocks (:func:`choose`), and its variant where blocks share storages
(:func:`choose_shared`, :func:`kept_bytes`). The size is parsed and validated by
:mod:`gradpatch.settings` (at start-up too); the measurement and the per-call dispatch live in
:mod:`gradpatch.checkpointing.budget.policy`, the report in :mod:`gradpatch.checkpointing.budget.report`.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

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


def alone_bytes(items: Sequence[Item], shared: Sequence[Shared]) -> list[int]:
    """What each item adds to memory when it is the only one kept (its shared storages counted)."""
    if not shared:
        return [it.bytes for it in items]
    return [sum(kept_bytes(items, shared, [j == i for j in range(len(items))])) for i in range(len(items))]


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
