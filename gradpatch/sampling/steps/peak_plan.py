"""The plan of ``checkpoint_steps="peak:<size>"`` (:mod:`gradpatch.sampling.steps.peak`), torch-free: what
the recorded call of a key showed (:class:`Record`) and the evaluations kept per size (:class:`Plan`),
chosen as the block policy chooses blocks (:func:`gradpatch.checkpointing.budget.peak_choice.choose`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from gradpatch.checkpointing.budget.peak_choice import KEEP, RECOMPUTE, Occurrence, Option, PeakUnreachable, \
    choose, predict

#: Recorded plans over their size (and recordings dropped) before a key gives up keeping.
TRIES = 3


@dataclass
class Plan:
    keep: frozenset
    predicted: int
    realised: int | None = None
    margin: int = 0
    tries: int = 0


@dataclass
class Record:
    """What the recorded call of a key showed: its evaluations' signatures and bytes, the levels and
    each evaluation's span (:class:`~gradpatch.checkpointing.budget.peak_choice.Occurrence`)."""

    signatures: list
    costs: list
    levels: list
    occurrences: list
    floor: int
    ceiling: int
    plans: dict = field(default_factory=dict)
    stale: bool = False

    def plan(self, size: int, again: bool = False) -> Plan:
        old = self.plans.get(size)
        if old is not None and not again:
            return old
        margin = old.margin if old is not None else 0
        tries = old.tries if old is not None else 0
        # Latest first: among evaluations that cost the same peak the later ones are kept (their graphs
        # are alive for the shortest time).
        last = len(self.costs) - 1
        options = [[Option(RECOMPUTE, 0, 0.0), Option(KEEP, c, 1.0)] for c in reversed(self.costs)]
        occurrences = [o._replace(block=last - o.block) for o in self.occurrences]
        try:
            chosen, predicted = choose(self.levels, occurrences, options, size - margin)
        except PeakUnreachable:  # recorded plans ran over: recompute every evaluation
            chosen, predicted = [0] * len(options), self.floor
        plan = Plan(frozenset(last - i for i, j in enumerate(chosen) if j), predicted, None, margin, tries)
        if not plan.keep:  # what the recorded call ran: nothing to check
            plan.realised = self.floor
        self.plans[size] = plan
        return plan

    def check(self, size: int, realised: int) -> None:
        plan = self.plans[size]
        plan.tries += 1
        if realised <= size:
            plan.realised = realised
            return
        plan.margin += realised - min(plan.predicted, size)  # what the prediction missed: so much less room
        if plan.tries >= TRIES:
            plan.margin = size + 1  # nothing fits: every evaluation recomputed
        self.plan(size, again=True)


    @classmethod
    def of(cls, evaluations: Sequence[tuple[Any, Any, int | None]], levels: Sequence[int],
           spans: Sequence[tuple[int, int, int]]) -> Record:
        """The record of a call that recomputed every evaluation: ``evaluations`` (signature, shape, bytes
        where measured: the first of each shape), the recorder's ``levels`` (the most alive between two
        marks) and each evaluation's ``spans`` (index, first level, end level: from its forward's start
        to its recompute's, :meth:`gradpatch.checkpointing.budget.timeline.Recording.occurrences`).

        A kept evaluation counts from the interval after its forward: its own forward's level (the
        interval ending when it returns) is its working set, most of it freed as it goes, and its graph is
        whole only when it returns, where the next interval begins. Counted there too, the working set and
        the whole graph would be added (AudioLDM's UNet: 0.8 MiB of 9.3 over, the third evaluation
        kept at 28.5 MiB predicted at 28.73 and peaking at 27.98)."""
        costs = {shape: cost for _, shape, cost in evaluations if cost is not None}
        signatures = [s for s, _, _ in evaluations]
        levels = list(levels)
        occurrences = [Occurrence(i, start + 1, end) for i, start, end in sorted(spans)]
        per = [costs.get(shape, 0) for _, shape, _ in evaluations]
        return cls(signatures, per, levels, occurrences, max(levels, default=0), predict(levels, occurrences, per))


def unreachable(size: int, floor: int) -> str:
    need = -(-floor * 101 // 100 // 2**20)
    return (f"checkpoint_steps='peak:<size>': no plan keeps this sampler call's step within {size / 2**20:.2f} MiB; "
            f"the smallest peak reachable is {floor / 2**20:.2f} MiB, with every denoiser evaluation recomputed "
            f"(measured from the call's start to the end of the backward of its output). Use peak:{need}MiB or "
            f"more, fewer steps, a smaller batch, or grad_steps to backpropagate through fewer steps")
