"""The time-memory trade-off of the checkpoint policies on a user's own training step.

:func:`tradeoff` runs a given step function (forward and backward, no arguments) under ``respect``,
``budget:<size>`` at a few fractions of the memory gap between ``respect`` and ``never``, and
``never``, and reports per policy the step's peak memory beyond its start (CPU: the profiler's
allocation events, a measure independent of the planner; CUDA: ``torch.cuda.max_memory_allocated``),
that peak beyond ``respect``'s, the seconds per step (the median of ``repeats`` timed steps after the
planning steps; wall time, after a CUDA synchronisation where CUDA is in use), and the ratio to
``respect``'s time. ``gradpatch tradeoff MODULE:FACTORY`` does the same from the command line.

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


class Tradeoff(tuple):  # type: ignore[type-arg]
    """A tuple of :class:`Point` (``respect``, the budgets, ``never``) that prints as a table."""

    def __str__(self) -> str:
        rows = [f"{'policy':24} {'peak':>11} {'beyond respect':>15} {'s/step':>9} {'/respect':>9}"]
        for p in self:
            rows.append(f"{p.policy:24} {_mib(p.peak_bytes):>11} {_mib(p.extra_bytes):>15} "
                        f"{p.seconds:9.4f} {p.ratio:9.3f}")
        return "\n".join(rows)

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
            label = (f"budget {int(p.policy[7:]) / 2**20:.1f} MiB" if p.policy.startswith("budget:")
                     else p.policy)
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
             repeats: int = 5, device: str | None = None, progress: bool = True) -> Tradeoff:
    """Measure ``step`` under ``respect``, ``budget:<f * gap>`` for each fraction ``f`` of the peak
    memory gap between ``respect`` and ``never``, and ``never``. ``device``: ``"cuda"`` to measure
    CUDA memory and synchronise (default: CUDA if it is initialised, CPU otherwise). A progress line
    goes to stderr unless ``progress=False``. The policy in force before is restored."""
    cuda = (device or ("cuda" if torch.cuda.is_available() and torch.cuda.is_initialized()
                       else "cpu")) == "cuda"
    plan_steps = budget.TIMING_CALLS + 1
    total = (2 + len(fractions)) * (plan_steps + repeats + 1)
    bar = _Bar(total, progress)
    measured: dict[str, tuple[int, float]] = {}

    def measure(policy: str) -> None:
        with settings.checkpoint_policy_scope(policy):
            for _ in range(plan_steps):
                step()
                bar.tick(policy)
            peak = _peak(step, cuda)
            bar.tick(policy)
            times = []
            for _ in range(repeats):
                times.append(_timed(step, cuda))
                bar.tick(policy)
        measured[policy] = (peak, statistics.median(times))

    try:
        measure("respect")
        measure("never")
        gap = max(measured["never"][0] - measured["respect"][0], 0)
        for f in fractions:
            budget.reset()
            measure(f"budget:{int(f * gap)}")
    finally:
        bar.close()
        budget.reset()
    order = ["respect", *[p for p in measured if p.startswith("budget:")], "never"]
    base_peak, base_time = measured["respect"]
    return Tradeoff(Point(p, measured[p][0], measured[p][0] - base_peak, measured[p][1],
                          measured[p][1] / base_time) for p in order)


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
