"""The time-memory trade-off of the checkpoint policies on a user's own training step.

:func:`tradeoff` runs a given step function (forward and backward, no arguments) under ``respect``,
``budget:<size>`` at a few fractions of the memory gap between ``respect`` and ``never``, and
``never``, and reports per policy the step's peak memory beyond its start (CPU: the profiler's
allocation events, a measure independent of the planner; CUDA: ``torch.cuda.max_memory_allocated``),
that peak beyond ``respect``'s, the seconds per step (the median of ``repeats`` timed steps after the
planning steps; wall time, after a CUDA synchronisation where CUDA is in use) with the spread of
those steps (their range over the median), and the ratio to ``respect``'s time; then a warning when
the spread is too wide to rank the policies, and the policy it recommends: the lowest peak among
those within 10% of the fastest step. ``gradpatch tradeoff MODULE:FACTORY`` does the same from the
command line.

Cost: about ``(2 + len(fractions)) * (planning + repeats + 1)`` steps; the budget plans are measured
afresh (:func:`gradpatch.checkpointing.budget.reset`). The step must be repeatable: it is called
many times, with the optimiser (if it steps one) moving the weights. Only blocks the caller asks to
checkpoint (upstream's ``flag=True``) are affected: a model without such blocks shows one point.
The PNG plot needs matplotlib (``pip install "gradpatch[plot]"``, or matplotlib); the table does not.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, NamedTuple, Sequence

import torch

from gradpatch import settings
from gradpatch.checkpointing import budget


class Point(NamedTuple):
    policy: str
    peak_bytes: int  # the step's peak allocation beyond what was allocated at its start
    extra_bytes: int  # peak_bytes beyond respect's
    seconds: float  # per step, median
    ratio: float  # seconds / respect's seconds
    times: tuple[float, ...] = ()  # every timed step, in seconds

    @property
    def spread(self) -> float:
        """The timings' range over their median (0.1: the slowest step took 10% of the median more
        than the fastest); 0 with fewer than two timings."""
        return (max(self.times) - min(self.times)) / self.seconds if len(self.times) > 1 and self.seconds else 0.0


#: Steps within this fraction of the fastest policy's time count as fast as it.
TOLERANCE = 0.10


class Tradeoff(tuple):  # type: ignore[type-arg]
    """A tuple of :class:`Point` (``respect``, the budgets, ``never``) that prints as a table, the
    spread of its timings (with a warning when they are too noisy to rank) and a recommended policy."""

    def __str__(self) -> str:
        rows = [f"{'policy':22} {'peak':>11} {'beyond respect':>15} {'s/step':>9} {'spread':>7} {'/respect':>9}"]
        for p in self:
            rows.append(f"{p.policy:22} {_mib(p.peak_bytes):>11} {_mib(p.extra_bytes):>15} "
                        f"{p.seconds:9.4f} {_percent(p.spread):>7} {p.ratio:9.3f}")
        import textwrap

        warning = self.noise()
        for line in ([f"warning: {warning}"] if warning else []) + [self.recommendation()]:
            rows += textwrap.wrap(line, 100, subsequent_indent="  ", break_on_hyphens=False)
        return "\n".join(rows)

    def noise(self) -> str:
        """Why the timings are too noisy to rank the policies, or ``""``: some policy's timings spread
        wider than the differences between the policies' medians (or wider than 25%)."""
        if len(self) < 2:
            return ""
        medians = sorted(p.seconds for p in self)
        gap = (medians[-1] - medians[0]) / medians[0] if medians[0] else 0.0
        widest = max(self, key=lambda p: p.spread)
        if widest.spread > max(gap, TOLERANCE) or widest.spread > 0.25:
            return (f"timings too noisy to rank: {widest.policy}'s spread {_percent(widest.spread)} exceeds the "
                    f"{_percent(gap)} between the fastest and slowest policy; rerun with more --repeats on an "
                    "idle machine")
        return ""

    def recommendation(self) -> str:
        """The policy with the lowest peak among those within :data:`TOLERANCE` of the fastest time
        (by memory alone when the timings are too noisy to rank), and why."""
        if not self:
            return "recommended: respect (nothing was measured)"
        fastest = min(p.seconds for p in self)
        if self.noise():
            pick = min(self, key=lambda p: p.peak_bytes)
            return f"recommended: {pick.policy} (the lowest peak; the timings cannot rank the policies)"
        near = [p for p in self if p.seconds <= fastest * (1 + TOLERANCE)]
        pick = min(near, key=lambda p: (p.peak_bytes, p.seconds))
        quickest = min(self, key=lambda p: p.seconds)
        if pick is quickest:
            return f"recommended: {pick.policy} (the fastest step, {_mib(pick.peak_bytes)} peak)"
        return (f"recommended: {pick.policy} (within {_percent(TOLERANCE)} of the fastest step, "
                f"{quickest.policy}, at {_mib(quickest.peak_bytes - pick.peak_bytes)} less peak)")

    __repr__ = __str__

    def plot(self, path: str, title: str = "checkpoint policies") -> None:
        """Write the curve (seconds per step against extra memory) as a PNG to ``path``."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("gradpatch: the trade-off plot needs matplotlib; pip install \"gradpatch[plot]\" (or "
                              "matplotlib; the table needs nothing)") from None
        fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
        xs, ys = [p.extra_bytes / 2**20 for p in self], [p.ratio for p in self]
        ax.plot(xs, ys, "o-", color="tab:blue")
        for p, x, y in zip(self, xs, ys):
            label = p.policy
            ax.annotate(label, (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.set_xlabel("peak memory beyond respect (MiB)")
        ax.set_ylabel("time per step / respect")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def tradeoff(step: Callable[[], object], fractions: Sequence[float] = (0.25, 0.5, 0.75),
             repeats: int = 5, device: str | None = None, progress: bool = True,
             timer: Callable[[Callable[[], object], bool], float] | None = None) -> Tradeoff:
    """Measure ``step`` under ``respect``, ``budget:<f * gap>`` for each fraction ``f`` of the peak
    memory gap between ``respect`` and ``never``, and ``never``. ``device``: ``"cuda"`` to measure
    CUDA memory and synchronise (default: CUDA if it is initialised, CPU otherwise). A progress line
    goes to stderr unless ``progress=False``. The policy in force before is restored. Budgets are named
    in MiB (``budget:1.30MiB``, a policy ``GRADPATCH_CHECKPOINT`` takes as it is). ``timer(step, cuda)``
    runs one step and returns its seconds (default: wall time, synchronised on CUDA)."""
    cuda = (device or ("cuda" if torch.cuda.is_available() and torch.cuda.is_initialized()
                       else "cpu")) == "cuda"
    plan_steps = budget.TIMING_CALLS + 1
    total = (2 + len(fractions)) * (plan_steps + repeats + 1)
    bar = _Bar(total, progress)
    measured: dict[str, tuple[int, float, tuple[float, ...]]] = {}
    timer = timer or _timed

    def measure(policy: str) -> None:
        with settings.checkpoint_policy_scope(policy):
            for _ in range(plan_steps):
                step()
                bar.tick(policy)
            peak = _peak(step, cuda)
            bar.tick(policy)
            times = []
            for _ in range(repeats):
                times.append(timer(step, cuda))
                bar.tick(policy)
        measured[policy] = (peak, statistics.median(times), tuple(times))

    try:
        measure("respect")
        measure("never")
        gap = max(measured["never"][0] - measured["respect"][0], 0)
        for f in fractions:
            budget.reset()
            measure(budget_policy(int(f * gap)))
    finally:
        bar.close()
        budget.reset()
    order = ["respect", *[p for p in measured if p.startswith("budget:")], "never"]
    base_peak, base_time, _ = measured["respect"]
    return Tradeoff(Point(p, measured[p][0], measured[p][0] - base_peak, measured[p][1],
                          measured[p][1] / base_time, measured[p][2]) for p in order)


def _peak(step: Callable[[], object], cuda: bool) -> int:
    if cuda:
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    level = peak = 0
    for _, size in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                          if e.name() == "[memory]"):
        level += size
        peak = max(peak, level)
    return peak


def _timed(step: Callable[[], object], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


class _Bar:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, on: bool) -> None:
        self.total, self.done, self.on = total, 0, on

    def tick(self, what: str) -> None:
        self.done += 1
        if self.on:
            filled = 30 * self.done // self.total
            sys.stderr.write(f"\rgradpatch tradeoff [{'#' * filled}{'.' * (30 - filled)}] "
                             f"{self.done}/{self.total} {what:24}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\n")


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def budget_policy(size: int) -> str:
    """``budget:<size>`` named in MiB to three significant digits (``budget:1.30MiB``), in bytes
    below a kibibyte."""
    mib = size / 2**20
    if size < 1024:
        return f"budget:{size}"
    return f"budget:{mib:.0f}MiB" if mib >= 100 else f"budget:{mib:.3g}MiB" if mib < 1 else f"budget:{mib:.2f}MiB"
