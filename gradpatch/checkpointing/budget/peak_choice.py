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

Where each block is called once and the spans nest (a block's span inside another's or apart from it:
forward in order, recompute in reverse), the choice is exact: the spans form a tree, and each subtree's
choices reduce to the pairs (room left for the blocks around it, seconds saved) that no other pair beats
on both (:func:`_nested`); among equal savings, the later blocks. Past :data:`FRONT_LIMIT` pairs (many
blocks with unequal bytes), one pair per share of the size, and the better of that choice and the
greedy one below. Where a block runs more than once a step (its spans do not nest), a greedy choice:
repeatedly the upgrade that saves the most seconds per share of the tightest room it uses.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

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


def unreachable_message(policy: str, size: int, floor: int) -> str:
    """What :class:`PeakUnreachable` says for a training step."""
    need = -(-floor * 101 // 100 // 2**20)
    return (f"checkpoint policy {policy!r}: no plan keeps this step's peak within {size / 2**20:.2f} MiB; "
            f"the smallest peak reachable is {floor / 2**20:.2f} MiB, with every checkpointed block "
            f"recomputed (measured from the forward's start to the end of the backward). "
            f"Use peak:{need}MiB or more, a smaller batch, or checkpoint more of the model")


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
    saved) and the predicted peak: the most seconds saved with the prediction within ``size`` (exact
    where the spans nest and their choices stay few, else the better of that and a greedy choice:
    module docstring). :class:`PeakUnreachable` if recomputing every block already peaks above
    ``size``."""
    floor = max(levels, default=0)
    if floor > size:
        raise PeakUnreachable(floor)
    spans: list[list[tuple[int, int]]] = [[] for _ in options]
    for o in occurrences:
        if o.start < min(o.end, len(levels)):
            spans[o.block].append((o.start, min(o.end, len(levels))))
    chosen, exact = _nested(levels, spans, options, size)
    if not exact:
        greedy = _greedy(levels, spans, options, size)
        if chosen is None or _saved(options, greedy) > _saved(options, chosen):
            chosen = greedy
    assert chosen is not None
    return chosen, predict(levels, occurrences, [options[i][j].bytes for i, j in enumerate(chosen)])


class _Node(NamedTuple):
    """A block's span in the tree of nested spans (the root: the whole step, no block)."""

    start: int
    end: int
    block: int | None
    children: list[_Node]


#: The most (room, seconds) pairs one subtree keeps: past it, one per ``size / FRONT_LIMIT`` of room
#: (within that much of the best).
FRONT_LIMIT = 512


def _nested(levels: Sequence[int], spans: list[list[tuple[int, int]]], options: Sequence[Sequence[Option]],
            size: int) -> tuple[list[int] | None, bool]:
    """The choice where every block has at most one span and the spans nest (None otherwise), and
    whether it is exact (no front thinned past :data:`FRONT_LIMIT`).

    Each entry of a subtree's front is ``(room, seconds, picks)``: the most bytes the blocks around the
    subtree may still add over its span with its choices made (``picks``: None, ``("pick", block,
    option, picks)`` or ``("join", picks, picks)``). Children's fronts combine by the smaller room and
    the summed seconds; the block's own options then take their bytes off the room. Only entries that no
    other beats on both are kept."""
    if any(len(s) > 1 for s in spans):
        return None, False
    # A block with no span was not seen in the recorded step (another model's, called in other steps):
    # what keeping it adds there is unknown, so it is recomputed.
    chosen = [0] * len(options)
    nodes = sorted((s[0][0], -s[0][1], i) for i, s in enumerate(spans) if s)
    root = _Node(0, len(levels), None, [])
    stack = [root]
    for start, negative_end, i in nodes:
        while stack[-1].end <= start:
            stack.pop()
        if -negative_end > stack[-1].end:
            return None, False  # overlaps its parent's end: not nested
        node = _Node(start, -negative_end, i, [])
        stack[-1].children.append(node)
        stack.append(node)
    fronts: dict[int, list[tuple[int | float, float, Any]]] = {}
    exact = True
    # The least room a subtree may leave: what the blocks around it could still give back (an option
    # with fewer bytes than recomputing); 0 where every option adds bytes.
    lowest = sum(min(0, *(opt.bytes for opt in opts)) for opts in options)
    order: list[_Node] = []
    pending = [root]
    while pending:  # children before their parent
        node = pending.pop()
        order.append(node)
        pending.extend(node.children)
    for node in reversed(order):
        start, end, block, children = node
        covered = [False] * (end - start)
        for child in children:
            covered[child.start - start:child.end - start] = [True] * (child.end - child.start)
        own = [levels[start + k] for k, c in enumerate(covered) if not c]
        front: list[tuple[int | float, float, Any]] = [(size - max(own) if own else float("inf"), 0.0, None)]
        for child in children:
            theirs = fronts.pop(id(child))
            front, whole = _pareto([(min(room, r), seconds + s, ("join", picks, more))
                                    for room, seconds, picks in front for r, s, more in theirs], size)
            exact &= whole
        if block is not None:
            late = 1 + 1e-9 * start / len(levels)  # equal seconds: the later block (less of the step to span)
            front, whole = _pareto([(room - opt.bytes, seconds + opt.seconds * late, ("pick", block, j, picks)
                                     if j else picks) for room, seconds, picks in front
                                    for j, opt in enumerate(options[block]) if room - opt.bytes >= lowest], size)
            exact &= whole
        fronts[id(node)] = front
    best = max((entry for entry in fronts[id(root)] if entry[0] >= 0), key=lambda entry: entry[1])
    links = [best[2]]
    while links:
        link = links.pop()
        if link is None:
            continue
        if link[0] == "pick":
            chosen[link[1]] = link[2]
            links.append(link[3])
        else:
            links += link[1:]
    return chosen, exact


def _saved(options: Sequence[Sequence[Option]], chosen: list[int]) -> float:
    return sum(options[i][j].seconds for i, j in enumerate(chosen))


def _pareto(entries: list[tuple[int | float, float, Any]],
            size: int) -> tuple[list[tuple[int | float, float, Any]], bool]:
    """The entries no other beats on both room and seconds (most room first), and whether that is all
    of them: past :data:`FRONT_LIMIT`, only the one saving the most seconds per ``size / FRONT_LIMIT``
    of room."""
    entries.sort(key=lambda entry: (-entry[0], -entry[1]))
    kept: list[tuple[int | float, float, Any]] = []
    for entry in entries:
        if not kept or entry[1] > kept[-1][1]:
            kept.append(entry)
    if len(kept) <= FRONT_LIMIT:
        return kept, True
    cell = max(size // FRONT_LIMIT, 1)
    thinned: list[tuple[int | float, float, Any]] = []
    for entry in kept:  # seconds rise as room falls: the last of each cell saves the most
        if thinned and thinned[-1][0] // cell == entry[0] // cell:
            thinned[-1] = entry
        else:
            thinned.append(entry)
    return thinned, False


def _greedy(levels: Sequence[int], spans: list[list[tuple[int, int]]], options: Sequence[Sequence[Option]],
            size: int) -> list[int]:
    """Repeatedly take the upgrade of one block (to a later option) that saves the most seconds per
    fraction of the tightest remaining room it uses, among those that keep the prediction within
    ``size``; free upgrades (in intervals with room to spare everywhere they reach) first, by their
    seconds."""
    totals = list(levels)
    chosen = [0] * len(options)
    while True:
        best: tuple[float, float, int, int] | None = None
        for i, opts in enumerate(options):
            now = opts[chosen[i]]
            for j in range(chosen[i] + 1, len(opts)):
                gain, extra = opts[j].seconds - now.seconds, opts[j].bytes - now.bytes
                if gain <= 0 or (extra > 0 and not spans[i]):  # no span: not seen in the recorded step
                    continue
                if extra <= 0:
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
            return chosen
        _, _, i, j = best
        extra = options[i][j].bytes - options[i][chosen[i]].bytes
        for s, e in spans[i]:
            for k in range(s, e):
                totals[k] += extra
        chosen[i] = j
