"""The report of the ``budget:<size>`` plan (torch-free): the :class:`Plan` that
:func:`gradpatch.checkpoint_plan` returns, a tuple of :class:`PlanEntry` that prints as a table."""
from __future__ import annotations

from typing import NamedTuple


class PlanEntry(NamedTuple):
    """One planned block: its name (module class and method, or path with ``model=``), the bytes
    keeping its activations costs (for a kept block, what it adds to the plan: a storage that kept
    blocks share counts in the first; for a recomputed one, what keeping it alone would add) and the
    seconds recomputing it costs (its recompute in backward and the checkpoint's own work in the
    forward: what keeping it saves), both per step, over all its calls; whether the plan recomputes
    it; whether it is measured; ``why`` it is not planned, if it is not. ``None`` figures: not
    measured yet, or never measurable (a block torch's own checkpoint runs at once: always recomputed,
    and ``why`` says what sent it there)."""

    name: str
    bytes: int | None
    recompute_seconds: float | None
    recomputed: bool
    measured: bool = True
    why: str | None = None
    choice: str | None = None


class Plan(tuple):  # type: ignore[type-arg]
    """A tuple of :class:`PlanEntry`, in the order the blocks first ran, that prints as a table."""

    policy: str
    budget: int | None
    #: Under ``peak:<size>``, once the step is recorded: the predicted peak of this plan, the smallest
    #: peak reachable (every block recomputed) and the peak with every block kept, in bytes above
    #: what was allocated when the step's forward began; otherwise None.
    predicted_peak: int | None = None
    smallest_peak: int | None = None
    largest_peak: int | None = None
    #: Under ``peak:<size>``, why no step can be recorded (every block recomputed); otherwise None.
    unrecorded: str | None = None

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
        if self.policy.startswith("peak:"):
            return self._peak_summary(head)
        if not self.complete:
            return (f"{head}: measuring ({sum(e.measured for e in self)} of "
                    f"{len(self)} blocks measured); every block is recomputed meanwhile")
        return (f"{head}: {kept} of {len(self)} blocks kept, {_mib(self.kept_bytes)} of "
                f"{_mib(self.budget or 0)}, saving about {self.saved_seconds * 1e3:.1f} ms a step"
                f"{self._unplanned()}")

    def _peak_summary(self, head: str) -> str:
        if self.unrecorded:
            return f"{head}: {self.unrecorded}; every block is recomputed"
        if self.smallest_peak is None:
            return (f"{head}: measuring ({sum(e.measured for e in self)} of {len(self)} blocks measured, "
                    f"then one step recorded); every block is recomputed meanwhile")
        span = (f"smallest reachable {_mib(self.smallest_peak)}, every block kept "
                f"{_mib(self.largest_peak or 0)}")
        if self.predicted_peak is None:
            return f"{head}: no plan fits ({span})"
        kept = sum(e.choice == "keep" for e in self)
        saved = sum(e.recompute_seconds or 0.0 for e in self if e.choice == "keep")
        return (f"{head}: predicted peak {_mib(self.predicted_peak)} of {_mib(self.budget or 0)} ({span}); "
                f"{kept} of {len(self)} blocks kept, saving about "
                f"{saved * 1e3:.1f} ms a step{self._unplanned()}")

    def _unplanned(self) -> str:
        """Why blocks are not planned: ``""`` if all are."""
        reasons = [e.why for e in self if e.why]
        if not reasons:
            return ""
        distinct = list(dict.fromkeys(reasons))
        more = f" (and {len(distinct) - 1} other reasons)" if len(distinct) > 1 else ""
        return (f"; {len(reasons)} of {len(self)} blocks not planned, always recomputed through torch's "
                f"checkpoint, whose recompute the planner cannot measure: {distinct[0]}{more}")

    def __str__(self) -> str:
        width = max(len(e.name) for e in self) if self else 5
        rows = [f"{'block':{width}} {'kept bytes':>12} {'recompute':>10}  plan"]
        for e in self:
            size = "?" if e.bytes is None else _mib(e.bytes)
            time_ = "?" if e.recompute_seconds is None else f"{e.recompute_seconds * 1e3:.2f}ms"
            rows.append(f"{e.name:{width}} {size:>12} {time_:>10}  "
                        f"{e.choice or ('keep' if not e.recomputed else 'recompute')}"
                        f"{' (not planned)' if e.why else ''}")
        return "\n".join([self.summary(), *rows])

    def __repr__(self) -> str:
        return str(self)


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"
