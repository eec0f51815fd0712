"""A training step's peak memory and time under checkpoint policies, and under torch's ``sac_ilp`` plan.

Run:  PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/peak_plan.py [--model medium|audioldm]
      [--batch N] [--steps N] [--policies "budget:40MiB,peak:60MiB"] [--sac-budgets "62,65"]
      [--fractions 0.25,0.5,0.75] [--device cpu|cuda]

Models, as ``memory_truth.py`` and ``checkpoint_budget.py`` build them (``checkpoint_speed.build``, every
parameter trainable, every block checkpointed through gradpatch's fixed checkpoint): the medium UNet
(default batch 2) and AudioLDM-S's UNet narrowed to 32 channels (10 s of audio, default batch 1).
One step: forward, loss (the output's mean square), backward, gradients set to None before it.

Rows:

* gradpatch policies, set with ``gradpatch.set_checkpoint_policy``: ``never``, ``respect``,
  ``budget:<size>`` at ``--fractions`` of the gap between ``never``'s and ``respect``'s bytes still
  allocated after the forward, ``peak:<size>`` at each ``sac_ilp`` budget below (the same peak
  limit side by side), and every policy in ``--policies``. A policy ``set_checkpoint_policy``
  rejects (``ValueError``: ``peak:`` before it exists) prints "not available". ``budget:`` and
  ``peak:`` rows start from a reset planner (``budget.reset()``) and run 3 warm-up steps (the policy measures its blocks
  during its first steps), then print ``gradpatch.checkpoint_plan()``'s summary; a plan with a
  ``predicted_peak`` attribute gives the row's predicted peak.
* ``torch checkpoint`` and ``torch selective`` (``--no-torch-rows`` leaves them out): every block through
  ``torch.utils.checkpoint(use_reentrant=False)``, and through it with a selective-checkpoint policy that
  keeps the outputs of the matmuls, convolutions and attention (:data:`EXPENSIVE`) and recomputes the
  rest: what ``peak:`` would run for a block it kept only partly.
* ``sac_ilp <size>``: torch's ``torch.distributed._tools.sac_ilp.sac_milp`` plan for a step peak of
  ``<size>`` above the parameters (its budget is that plus the parameters' bytes), made from
  ``MemTracker``, ``SACEstimator`` and the modules' order on the real model and applied with
  ``torch.utils.checkpoint`` and a selective-checkpoint policy per checkpointed module
  (``benchmarks/sac_ilp_plan.py`` says how, and where it departs from torch's own test). The model's
  own checkpoint calls run their function directly there. Its predicted peak is ``sac_milp``'s
  model's for the plan. ``--sac-budgets`` (MiB) defaults to the ``budget:`` rows' realised peaks
  (allocator); a size the ILP finds infeasible prints "no plan".

Measures, each relative to what was allocated when the step's forward began (parameters excluded,
gradients included), in separate steps after the warm-up:

* **allocator**: the profiler's allocation events matched by address (``memory_truth.allocator``).
* **MemTracker**: torch's ``MemTracker`` (peak ``Total`` minus what it tracked at the start), as
  ``memory_truth.memtracker`` uses it, in the subclass ``sac_ilp_plan.PeakTracker``, which gives the
  same figures but updates only the active modules' peaks after each operator (MemTracker walks
  every module it has seen: 97 s a step on the medium UNet instead of about 3).
* **CUDA** (``--device cuda``): ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
* **time**: the median of ``--steps`` steps per row, rows interleaved (every round runs one step of
  each in a fresh random order, after one warm-up round), thread CPU time on one thread (CUDA: wall
  time between synchronisations); ``/never``: the ratio of medians.

The predicted columns' ratios are realised (allocator, MemTracker) over predicted.

Measured (CPU, one thread, loaded machine, torch 2.14.1; MiB above the step's start, allocator /
MemTracker, time over ``never``'s; before ``peak:`` existed):

* medium UNet, batch 8 (``--batch 8``, 5 steps, 17 min): ``never`` 111.7 / 110.7, 1.000; ``respect``
  78.8 / 80.9, 1.399; ``budget:`` 82.5 / 84.5, 1.192; 85.0 / 87.0, 1.080; 94.3 / 95.8, 1.033.
  ``sac_ilp`` at those three realised peaks (predicted 82.5, 85.0, 94.2): 85.8 / 87.5, 1.235; 87.9 /
  88.0, 1.186; 94.8 / 96.3, 1.123. Its plans land above their limit (1.01 to 1.06 of it) and are slower
  than ``budget:`` at every point. Its no-checkpoint model: 112.1 (measured 111.7).
* medium UNet, batch 2 (the default): the 64 MiB of gradients make most of the peak (``never`` 68.5,
  ``respect`` 65.3); ``sac_ilp`` finds no plan below 65 MiB, and its plan at 65.4 realises 67.8.
* AudioLDM-S at 32 channels, batch 1 (3 steps, 27 min; the ILP took up to its 180 s limit per size):
  ``never`` 282.9 / 282.0, 1.000; ``respect`` 102.2 / 103.9, 1.498; ``budget:`` 122.4 / 122.4, 1.407;
  151.1 / 150.2, 1.206; 204.3 / 203.4, 1.111. ``sac_ilp`` at those limits: 115.7 / 116.4, 1.533;
  132.4 / 131.6, 1.317; 181.5 / 180.4, 1.335 (0.87 to 0.95 of its prediction, which is the limit):
  under its limit but slower than ``budget:`` at a higher peak. Its no-checkpoint model: 303.2
  (measured 282.9).
* The operators of every applied ``sac_ilp`` plan matched the estimator's order (no mismatch).

``peak:`` rows, ``--no-sac``, quiet machine (load about 1), each at a ``budget:`` row's realised
allocator peak; ``peak:`` predicted, then allocator / MemTracker, time over ``never``'s:

* AudioLDM-S at 32 channels, batch 1 (``--steps 11``): at 122.3 ``budget:`` 122.4 / 122.3, 1.182;
  ``peak:`` 117.9, 118.8 / 117.9, 1.161. At 187.4: 187.4 / 187.4, 1.139; ``peak:`` 164.1, 165.1 / 164.1,
  1.102. At 204.3: 204.3 / 203.4, 1.077; ``peak:`` 197.7, 198.6 / 197.7, 1.081.
* medium UNet, batch 8 (``--steps 7``): at 82.5 ``budget:`` 82.5 / 84.5, 1.193; ``peak:`` 79.9,
  80.0 / 82.0, 1.085. At 85.0: 85.0 / 87.0, 1.100; ``peak:`` 81.4, 81.5 / 83.5, 1.075. At 95.3:
  95.3 / 95.8, 1.052; ``peak:`` 92.1, 93.2 / 92.2, 1.032.

``torch checkpoint`` and ``torch selective`` rows, ``--no-sac --steps 7``, load below 1:

* medium UNet, batch 8: ``respect`` 78.8 / 80.9, 1.368; ``torch checkpoint`` 78.7 / 80.9, 1.314;
  ``torch selective`` 87.0 / 88.4, 1.346; ``peak:85.0MiB`` 81.5 / 83.5, 1.109.
* AudioLDM-S at 32 channels, batch 1: ``respect`` 102.2 / 103.9, 1.386; ``torch checkpoint`` 101.8 /
  103.6, 1.407; ``torch selective`` 181.0 / 180.9, 1.414; ``peak:151.1MiB`` 147.5 / 146.6, 1.147.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_budget as cb  # noqa: E402,F401  (defines the "audioldm" model)
import checkpoint_speed as speed  # noqa: E402
import memory_truth as truth  # noqa: E402
import sac_ilp_plan  # noqa: E402

import audioldm.latent_diffusion.attention as attention  # noqa: E402
import audioldm.latent_diffusion.openaimodel as openaimodel  # noqa: E402

import gradpatch  # noqa: E402
from gradpatch.checkpointing import budget  # noqa: E402
from gradpatch.checkpointing import checkpoint as fixed  # noqa: E402

MiB = 2 ** 20
WARMUP = budget.TIMING_CALLS + 3  # steps before measuring a budget: or peak: row: budget: measures its blocks
# in its first TIMING_CALLS steps; peak: then records one step, and the plan's first step
FIXED = fixed.replace_checkpoint(speed.V1)


def direct(func: Callable, inputs: tuple, params: Any, flag: bool) -> Any:
    """The model's checkpoint calls under a ``sac_ilp`` plan: the function, run directly."""
    return func(*inputs)


#: The operators whose outputs the ``torch selective`` row keeps (torch's usual choice).
EXPENSIVE = frozenset(getattr(torch.ops.aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention") if hasattr(torch.ops.aten, name))


def _expensive_saved(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in EXPENSIVE else CheckpointPolicy.PREFER_RECOMPUTE


def torch_checkpoint(selective: bool) -> Callable:
    """The model's checkpoint calls through ``torch.utils.checkpoint(use_reentrant=False)``; ``selective``:
    with a selective-checkpoint policy keeping the :data:`EXPENSIVE` operators' outputs in every block."""
    context = {"context_fn": lambda: create_selective_checkpoint_contexts(_expensive_saved)} if selective else {}

    def run(func: Callable, inputs: tuple, params: Any, flag: bool) -> Any:
        return checkpoint(func, *inputs, use_reentrant=False, **context) if flag else func(*inputs)
    return run


@dataclass
class Row:
    name: str
    checkpoint: Callable = FIXED
    policy: str | None = None  # a gradpatch policy
    applied: sac_ilp_plan.Applied | None = None  # a sac_ilp plan
    predicted: int | None = None
    missing: str | None = None  # why the row cannot run
    peaks: dict[str, int] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved = attention.checkpoint, openaimodel.checkpoint
        attention.checkpoint = openaimodel.checkpoint = self.checkpoint
        previous = gradpatch.set_checkpoint_policy(self.policy or "respect")
        try:
            with self.applied() if self.applied else contextlib.nullcontext():
                yield
        finally:
            attention.checkpoint, openaimodel.checkpoint = saved
            gradpatch.set_checkpoint_policy(previous)

    @property
    def planned(self) -> bool:
        return self.policy is not None and self.policy.split(":")[0] in ("budget", "peak")


def gradpatch_row(policy: str) -> Row:
    try:
        previous = gradpatch.set_checkpoint_policy(policy)
    except ValueError as error:
        return Row(policy, policy=policy, missing=f"not available ({error})")
    gradpatch.set_checkpoint_policy(previous)
    return Row(policy, policy=policy)


def memtracker_peak(run: Callable[[list], None], model: torch.nn.Module) -> int:
    """The step's peak by MemTracker (``PeakTracker``), as ``memory_truth.memtracker`` takes it."""
    model.zero_grad(set_to_none=True)
    tracker = sac_ilp_plan.PeakTracker()
    tracker.track_external(model)
    start = truth._total(tracker.get_tracker_snapshot("current"))
    with tracker:
        run([])
    return truth._total(tracker.get_tracker_snapshot("peak")) - start


def measure(row: Row, model: torch.nn.Module, batch: tuple) -> None:
    """Warm up, print the plan, then the step's peak by each measure (``row.peaks``, bytes)."""
    def run(marks: list) -> None:
        model.zero_grad(set_to_none=True)
        truth.step(model, batch, marks)

    with row.active():
        if row.planned:
            budget.reset()
        for _ in range(WARMUP if row.planned else 1):
            run([])
        if row.planned:
            plan = gradpatch.checkpoint_plan(model)
            print(f"  {row.name}: {plan.summary()}")
            if not plan.complete:
                print(f"  {row.name}: the plan is not complete after {WARMUP} steps; measured as it is")
            predicted = getattr(plan, "predicted_peak", None)
            row.predicted = None if predicted is None else int(predicted)
        if row.applied is not None:
            print(f"  {row.name}: {row.applied.describe()}")
        gc.collect()
        row.peaks["allocator"] = truth.allocator(run)[0]
        gc.collect()
        row.peaks["MemTracker"] = memtracker_peak(run, model)
        if speed.DEVICE.type == "cuda":
            gc.collect()
            row.peaks["CUDA"] = truth.cuda_peak(run, model)[0]
        if row.applied is not None and row.applied.mismatches:
            print(f"  {row.name}: {row.applied.mismatches} operators did not match the estimator's "
                  f"order (recomputed)")
    model.zero_grad(set_to_none=True)


def kept_after_forward(row: Row, model: torch.nn.Module, batch: tuple) -> int:
    def run(marks: list) -> None:
        model.zero_grad(set_to_none=True)
        truth.step(model, batch, marks)

    with row.active():
        return truth.allocator(run)[1]


def timing(rows: list[Row], model: torch.nn.Module, batch: tuple, steps: int) -> None:
    order, rng = list(rows), random.Random(0)
    for r in range(1 + steps):
        rng.shuffle(order)
        for row in order:
            with row.active():
                elapsed = speed.step(model, batch)
            if r:
                row.times.append(elapsed)
    model.zero_grad(set_to_none=True)


def sac_rows(inputs: sac_ilp_plan.Inputs, model: torch.nn.Module, sizes: list[int],
             depth: int | None) -> list[Row]:
    rows = []
    for size in sizes:
        name = f"sac_ilp {size / MiB:.1f}MiB"
        start = time.perf_counter()
        decisions, recompute_ms, predicted = inputs.plan(size, depth)
        solved = time.perf_counter() - start
        if predicted is None:
            rows.append(Row(name, checkpoint=direct, missing=f"no plan (infeasible in sac_ilp's model, "
                                                             f"{solved:.0f} s)"))
            continue
        applied = sac_ilp_plan.Applied(model, inputs, decisions)
        print(f"  {name}: {len(decisions)} modules checkpointed, recompute {recompute_ms:.2f} ms "
              f"by SACEstimator's times (solved in {solved:.0f} s)")
        rows.append(Row(name, checkpoint=direct, applied=applied, predicted=predicted))
    return rows


def table(rows: list[Row]) -> None:
    measures = list(next((r.peaks for r in rows if r.peaks), {"allocator": 0}))
    never = next((statistics.median(r.times) for r in rows if r.name == "never" and r.times), None)
    head = f"{'policy':22} {'predicted':>9} " + " ".join(f"{m:>10}" for m in measures)
    head += " " + " ".join(f"{m[:5] + '/pred':>10}" for m in measures) + f" {'time ms':>9} {'/never':>7}"
    print("\n" + head)
    for row in rows:
        if row.missing:
            print(f"{row.name:22} {row.missing}")
            continue
        pred = f"{row.predicted / MiB:9.1f}" if row.predicted else f"{'-':>9}"
        line = f"{row.name:22} {pred} " + " ".join(f"{row.peaks[m] / MiB:10.1f}" for m in measures)
        line += " " + " ".join(f"{row.peaks[m] / row.predicted:10.3f}" if row.predicted else f"{'-':>10}"
                               for m in measures)
        median = statistics.median(row.times)
        line += f" {median * 1e3:9.1f} {median / never:7.3f}" if never else f" {median * 1e3:9.1f}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("medium", "audioldm"), default="medium")
    parser.add_argument("--batch", type=int, help="batch size (default: 2 for medium, 1 for audioldm)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (default 5)")
    parser.add_argument("--policies", default="", help="more gradpatch policies, comma-separated")
    parser.add_argument("--fractions", default="0.25,0.5,0.75",
                        help="budget: sizes, as fractions of the never-respect gap after the forward")
    parser.add_argument("--sac-budgets", default="",
                        help="sac_ilp step peaks in MiB (default: the budget: rows' realised peaks)")
    parser.add_argument("--sac-depth", type=int, help="sac_ilp may checkpoint only modules at most this deep "
                        "(the model 0, out 1, input_blocks.4 2, input_blocks.4.0 3); default: any module")
    parser.add_argument("--no-peak-rows", action="store_true",
                        help="no peak:<size> rows at the sac_ilp sizes")
    parser.add_argument("--no-torch-rows", action="store_true",
                        help="no rows for torch's checkpoint and its selective checkpoint on every block")
    parser.add_argument("--no-sac", action="store_true", help="no sac_ilp rows (its solver takes minutes)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    speed.DEVICE = torch.device(args.device)
    if speed.DEVICE.type == "cpu":
        torch.set_num_threads(1)
    kwargs, shape, n = speed.MODELS[args.model]
    batch_size = args.batch or (2 if args.model == "medium" else 1)
    model, batch = speed.build(dict(kwargs, use_checkpoint=True), shape, batch_size)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"== {args.model}: batch {batch_size}, {params / MiB:.1f} MiB of parameters, every block "
          f"checkpointed, {speed.DEVICE.type}, torch {torch.__version__}; MiB above the step's start ==")

    rows = [Row("never", policy="never"), Row("respect", policy="respect")]
    kept = {row.name: kept_after_forward(row, model, batch) for row in rows}
    if not args.no_torch_rows:
        rows += [Row("torch checkpoint", checkpoint=torch_checkpoint(False)),
                 Row("torch selective", checkpoint=torch_checkpoint(True))]
    gap = kept["never"] - kept["respect"]
    rows += [gradpatch_row(f"budget:{float(f) * gap / MiB:.2f}MiB") for f in args.fractions.split(",") if f]
    for row in rows:
        measure(row, model, batch)

    inputs = None
    if not args.no_sac:
        with Row("plain", checkpoint=direct).active():
            inputs = sac_ilp_plan.Inputs(model, batch, lambda m, b: truth.step(m, b, []), speed.DEVICE)
        print(f"  sac_ilp's model: {len(inputs.graph.nodes)} modules ({len(inputs.dropped)} with nothing to "
              f"discard left out), no-checkpoint peak {inputs.baseline() / MiB:.1f} MiB")
    if args.sac_budgets:
        sizes = [int(float(s) * MiB) for s in args.sac_budgets.split(",") if s]
    else:
        sizes = sorted({r.peaks["allocator"] // (MiB // 10) * (MiB // 10) for r in rows
                        if r.name.startswith("budget:") and r.peaks})
    more = [gradpatch_row(p.strip()) for p in args.policies.split(",") if p.strip()]
    if not args.no_peak_rows:
        more += [gradpatch_row(f"peak:{s / MiB:.1f}MiB") for s in sizes]
    if inputs is not None:
        more += sac_rows(inputs, model, sizes, args.sac_depth)
    for row in more:
        if not row.missing:
            measure(row, model, batch)
    rows += more

    timing([r for r in rows if not r.missing], model, batch, args.steps)
    table(rows)


if __name__ == "__main__":
    main()
