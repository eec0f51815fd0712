"""gradpatch's ``peak:<size>`` planned inside a compiled model: the compiled step's peak against the
plan's prediction and the size, and its time against torch.compile's ``activation_memory_budget`` at
the same realised peak.

Run:  PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/peak_compile.py [--model tiny-all-blocks]
      [--fractions 0.25 0.5 0.75] [--backend aot_eager_decomp_partition] [--rounds 6] [--tries 4]

The UNet of ``benchmarks/checkpoint_speed.py`` (``--model``: AudioLDM's UNetModel, every block
checkpointed), CPU, one thread, compiled through ``checkpoint_compile.py``'s wrapper (a module whose
forward calls the compiled step function: the wrapper is the step's root). Sizes: ``--fractions`` of
the gap between eager ``respect``'s and ``never``'s step peaks. For each, a compiled copy runs
``peak:<size>``: its first steps measure and record eagerly (the recording's dispatch mode makes dynamo
run them eagerly), then the model is compiled anew with the plan baked in. Printed per size: the plan's
predicted peak (from the eager recording), the compiled step's peak, both against the size. Then, at
the middle size, times side by side (interleaved rounds, medians of per-round ratios): the plan
compiled, every block recomputed compiled (``respect``: what ``peak:`` did under torch.compile before
it was planned there), no checkpoint (``activation_memory_budget`` 1.0) and the
``activation_memory_budget`` whose realised peak is closest to the plan's (bisection, ``--tries``
compilations). Peak: the step's (forward and backward) highest allocation above its start, from the
profiler's allocation events matched by address (``memory_truth.allocator``; gradients included), an
independent measure of the compiled code (the plan's recorder sees eager steps only). Gradients of the
compiled plan against eager ``never`` (relative to the largest).

Measured: ``docs/how-to/memory.md`` (Under torch.compile) and ``docs/benchmarks.md``: with
``aot_eager_decomp_partition`` the compiled step peaks 0.89-0.95x the eager prediction; with inductor
1.42x (every block recomputed compiled peaks 1.6x its eager peak there).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_budget as cb  # noqa: E402
import checkpoint_compile as cc  # noqa: E402
import checkpoint_speed as speed  # noqa: E402

from gradpatch.checkpointing import checkpoint as fixed  # noqa: E402

MiB = 2**20


def gradient_error(model: torch.nn.Module, compiled_model: torch.nn.Module, batch: tuple, variant: str) -> float:
    """The compiled plan's gradients against eager ``never``'s, relative to the largest."""
    with speed.use("never"):
        model.zero_grad(set_to_none=True)
        speed.forward(model, batch).float().square().mean().backward()
    compiled_model.zero_grad(set_to_none=True)
    with speed.use(variant):
        speed.forward(compiled_model, batch).float().square().mean().backward()
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    return max((a.grad - b.grad).abs().max().item()
               for a, b in zip(model.parameters(), compiled_model.model.parameters())) / scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-all-blocks")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--backend", default="aot_eager_decomp_partition",
                        help="torch.compile's backend (inductor compiles kernels: minutes per compilation)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tries", type=int, default=4, help="compilations to find the matching budget")
    args = parser.parse_args()
    cc.BACKEND[0] = args.backend

    from gradpatch.checkpointing import budget as planned

    torch.set_num_threads(1)
    model, batch = speed.build(*speed.MODELS[args.model])
    speed.VARIANTS.update(cb.BASE)
    eager = {v: cc.step_peak(model, batch, v)[0] for v in ("respect", "never")}
    print(f"{args.model} UNet, CPU, 1 thread, torch {torch.__version__}, {args.backend}; eager step peaks: "
          f"respect {eager['respect'] / MiB:.2f} MiB, never {eager['never'] / MiB:.2f} MiB", flush=True)
    runs: dict[str, tuple[torch.nn.Module, str]] = {}
    peaks, seconds = {}, {}
    print(f"{'size':<22}{'predicted MiB':>14}{'compiled MiB':>14}{'x predicted':>13}{'x size':>8}"
          f"{'kept':>7}{'grad err':>10}{'compile s':>11}")
    middle = sorted(args.fractions)[len(args.fractions) // 2]
    # (the middle size last: its plan is the one in place, process-wide, when the variants are timed)
    for fraction in sorted(args.fractions, key=lambda f: f == middle):
        size = int(eager["respect"] + fraction * (eager["never"] - eager["respect"]))
        variant = f"peak {fraction:.0%}"
        speed.VARIANTS[variant] = (fixed.replace_checkpoint(speed.V1), f"peak:{size}")
        planned.reset()
        compiled_model, took = cc.compile_variant(model, batch, variant, None, planned.TIMING_CALLS + 5)
        with speed.use(variant):
            plan = planned.checkpoint_plan(compiled_model.model)
        peak, _ = cc.step_peak(compiled_model, batch, variant)
        error = gradient_error(model, compiled_model, batch, variant)
        predicted = plan.predicted_peak or 0
        kept = f"{sum(not e.recomputed for e in plan)}/{len(plan)}"
        print(f"{variant + f' ({size / MiB:.2f} MiB)':<22}{predicted / MiB:>14.2f}{peak / MiB:>14.2f}"
              f"{peak / max(predicted, 1):>13.3f}{peak / size:>8.3f}{kept:>7}"
              f"{error:>10.1e}{took:>11.0f}", flush=True)
        if fraction == middle:
            ours = f"gradpatch {variant}, compiled"
            runs[ours], peaks[ours], seconds[ours] = (compiled_model, variant), peak, took
    today = "respect, compiled"
    for name, variant, amb in [(today, "respect", None), ("never, compiled (amb 1.0)", "no-ckpt", 1.0)]:
        compiled_model, seconds[name] = cc.compile_variant(model, batch, variant, amb)
        runs[name], peaks[name] = (compiled_model, variant), cc.step_peak(compiled_model, batch, variant)[0]
    amb, compiled_model, peak, took, _ = cc.matching_budget(model, batch, peaks[ours], args.tries)
    match = f"torch amb {amb}, compiled"
    runs[match], peaks[match], seconds[match] = (compiled_model, "no-ckpt"), peak, took
    cc.side_by_side(cc.interleaved(runs, batch, args.rounds), peaks, seconds, ours, (today, match), "x respect")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
