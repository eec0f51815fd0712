"""The ``peak:<size>`` policy: choosing each block's treatment so that the step's peak stays within the
size (torch-free).

The step's memory is measured once with every block recomputed, as a list of *levels*: the most bytes
alive in each interval between two block events (a block's forward starting or ending, its recompute
starting in backward), above what was alive when the first block began. Keeping a block adds its bytes to every interval from its forward's start to its recompute's
start, where recomputing would not have them alive; from its recompute on, the recomputed block holds
the same activations as a kept one. So the last block of a chain is kept for free, and a block kept
late in the forward costs less peak than one kept early. The predicted peak of a choice is the largest
level plus what the chosen blocks add there (:func:`predict`); :func:`choose` picks, among each
block's options (recompute, keep), the most seconds saved with the predicted peak at or under the size.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

RECOMPUTE, KEEP = "recompute", "keep"


class Option(NamedTuple):
    """One treatment of a block: what it adds while alive, what it saves per step."""

    kind: str
    bytes: int
    seconds: float


class Occurrence(NamedTuple):
    """One call of a block in the measured step: the intervals ``[start, end)`` its kept bytes are
    alive in beyond what recomputing it keeps."""

    block: int
    start: int
    end: int


class PeakUnreachable(ValueError):
    """No choice keeps the step's peak within the size: even recomputing every block peaks higher."""


def predict(levels: Sequence[int], occurrences: Sequence[Occurrence], added: Sequence[int]) -> int:
    """The step's peak when block ``i`` adds ``added[i]`` bytes over each of its occurrences."""
    totals = list(levels)
    for o in occurrences:
        if added[o.block]:
            for k in range(o.start, min(o.end, len(totals))):
                totals[k] += added[o.block]
    return max(totals, default=0)


def choose(levels: Sequence[int], occurrences: Sequence[Occurrence],
           options: Sequence[Sequence[Option]], size: int) -> tuple[list[int], int]:
    """The option index chosen per block (``options[i][0]`` is recomputing: nothing added, nothing
    saved) and the predicted peak. Greedy: repeatedly take the upgrade of one block (to a later option)
    that saves the most seconds per fraction of the tightest remaining room it uses, among those that
    keep the prediction within ``size``; free upgrades (in intervals with room to spare everywhere they
    reach) are taken first by their seconds. :class:`PeakUnreachable` if recomputing every block already
    peaks above ``size``."""
    totals = list(levels)
    floor = max(totals, default=0)
    if floor > size:
        raise PeakUnreachable(floor)
    spans: list[list[tuple[int, int]]] = [[] for _ in options]
    for o in occurrences:
        if o.start < min(o.end, len(totals)):
            spans[o.block].append((o.start, min(o.end, len(totals))))
    chosen = [0] * len(options)
    while True:
        best: tuple[float, float, int, int] | None = None
        for i, opts in enumerate(options):
            now = opts[chosen[i]]
            for j in range(chosen[i] + 1, len(opts)):
                gain, extra = opts[j].seconds - now.seconds, opts[j].bytes - now.bytes
                if gain <= 0:
                    continue
                if extra <= 0 or not spans[i]:
                    score = float("inf")
                else:
                    highest = max(max(totals[s:e]) for s, e in spans[i])
                    if highest + extra > size:
                        continue
                    used = max(extra / max(size - max(totals[s:e]), 1) for s, e in spans[i])
                    score = gain / used
                if best is None or (score, gain) > best[:2]:
                    best = (score, gain, i, j)
        if best is None:
            break
        _, _, i, j = best
        extra = options[i][j].bytes - options[i][chosen[i]].bytes
        for s, e in spans[i]:
            for k in range(s, e):
                totals[k] += extra
        chosen[i] = j
    return chosen, max(totals, default=0)
