"""gradpatch's ``budget:<size>`` against ``torch.compile`` with
``torch._functorch.config.activation_memory_budget``, at about the same realised memory.

Run:  PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/checkpoint_compile.py [--rounds 8]
      [--tries 4 | --budgets 0.0 0.25] [--device cuda [--bf16]]
      [--gradpatch-compiled [--model tiny-all-blocks|medium] [--fraction 0.5]]

The medium UNet of ``benchmarks/checkpoint_budget.py`` (AudioLDM's UNetModel, every block
checkpointed; CPU, one thread). gradpatch: ``respect``, ``never`` and ``budget:`` at 50% of the gap
between their activation memories (planned as ``checkpoint_budget.py`` does). torch.compile (inductor,
CPU) of the same model with the checkpoint calls made plain, so that the partitioner alone decides
what to recompute: ``activation_memory_budget`` 1.0 (keep what the partitioner would), and a budget
found by bisection (``--tries`` compilations) whose realised memory is closest to gradpatch's 50%;
``--budgets`` compiles the budgets given instead and times the closest. Each compilation of this model
takes minutes on a CPU (graph caches are off so that every budget is compiled).

With ``--device cuda``: AudioLDM-S's UNet (``checkpoint_speed.py``'s ``audioldm-s``, its transformer
blocks checkpointed as upstream has them) at batch 8, fp32 or under bf16 autocast (``--bf16``), wall
time between synchronisations, memory by ``torch.cuda.memory_allocated``. Each compiled budget is
also met from the other side: gradpatch ``budget:`` planned at the memory that compilation realised
(where it lies between ``respect`` and ``never``), so that the two are timed at the same memory.

With ``--gradpatch-compiled`` (``--model``, default ``tiny-all-blocks``; ``--fraction``): everything
compiled (inductor, or ``--backend``), side by side at the same realised step peak: gradpatch ``budget:<size>`` planned
inside the compiled model (measured eagerly on its first steps, then compiled whole with the plan
baked in), today's behaviour before that plan (every checkpointed block through torch's checkpoint:
``respect`` compiled, which is what ``budget:`` did under torch.compile), no checkpoint
(``activation_memory_budget`` 1.0), and ``activation_memory_budget`` found by bisection (``--tries``)
whose realised peak is closest to gradpatch's. The size is ``--fraction`` of the gap between the eager
``respect``'s and ``never``'s bytes kept after the forward. Peak: the step's (forward and backward)
highest allocation above its start, from the profiler's allocation events matched by address
(``memory_truth.allocator``; gradients included). Also printed: gradients of the compiled plan against
eager ``never`` (relative), and the time each variant took to compile (gradpatch's includes its
measuring steps, which run with a graph break per block).

Measured (CPU, one thread, a machine shared with other jobs, torch 2.14, ``--backend
aot_eager_decomp_partition``: inductor's partitioner, ``activation_memory_budget`` included, without
kernel compilation; ``--fraction 0.5``). ``--model medium``, 6 rounds: gradpatch's plan 0.856x the time
of today's all-recompute and 0.950x ``activation_memory_budget`` 0.5, all three at a step peak of
66.65 MiB (kept after the forward: 11.97, 3.28 and 11.05 MiB; no checkpoint 0.809x at 67.42 MiB;
gradients within 6e-7 of eager ``never``'s largest). ``tiny-all-blocks``, 8 rounds: 0.888x today's
at 1.06x its peak (6.16 against 5.79 MiB), 1.012x ``activation_memory_budget`` 0.625 at 1.01x its
peak. On these UNets the step's peak is set by the backward's top-resolution blocks and the
gradients, so most of a 50% budget comes free of peak.

Memory is measured the same way for every variant: the bytes still allocated after the forward
(profiler memory events: the graph's saved tensors), minus ``respect``'s. Time: thread CPU time of a
training step (forward and backward), all variants interleaved in a fresh random order every round,
medians of per-round ratios to ``respect``. Compilation happens before the rounds and is reported
apart.
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_budget as cb  # noqa: E402
import checkpoint_speed as speed  # noqa: E402

from gradpatch.checkpointing import checkpoint as fixed  # noqa: E402

BACKEND = ["inductor"]  # --backend
PLAIN = speed.VARIANTS["no-ckpt"]  # the same function object in every compiled call (dynamo guards it)


class _Compiled(torch.nn.Module):
    """``model`` compiled through a step function of its own code object: dynamo caches graphs per
    code object and, with modules inlined, does not guard on the module, so a second compilation of
    the same model's ``forward`` at another budget would reuse the first graph."""

    def __init__(self, model: torch.nn.Module, index: int) -> None:
        super().__init__()
        self.model = model
        namespace: dict = {}
        exec(f"def step_{index}(model, x, t, y=None):\n    return model(x, t, y=y)\n", namespace)
        self.step = torch.compile(namespace[f"step_{index}"], backend=BACKEND[0])

    def forward(self, x, t, y=None):
        return self.step(self.model, x, t, y=y)


def compiled(model: torch.nn.Module, batch: tuple, budget: float) -> tuple[torch.nn.Module, float, int]:
    """A compiled copy of ``model`` at ``activation_memory_budget=budget``: (model, seconds to
    compile its forward and backward, bytes allocated after its forward)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    _Compiled.count = getattr(_Compiled, "count", 0) + 1
    copy_ = _Compiled(copy.deepcopy(model), _Compiled.count)
    start = time.perf_counter()
    # The graph caches key on the graph, not on the budget: without this a second budget reuses the first.
    with functorch_config.patch(activation_memory_budget=budget, enable_autograd_cache=False), \
            inductor_config.patch(fx_graph_cache=False), speed.use("no-ckpt"):
        speed.step(copy_, batch)
        seconds = time.perf_counter() - start
        memory = speed.saved_bytes(copy_, batch)
    return copy_, seconds, memory


def compile_variant(model: torch.nn.Module, batch: tuple, variant: str, budget: float | None = None,
                    steps: int = 1) -> tuple[torch.nn.Module, float]:
    """A compiled copy of ``model`` run ``steps`` training steps under ``variant`` (compilation, and
    for gradpatch's ``budget:`` its measuring steps): (model, seconds)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    _Compiled.count = getattr(_Compiled, "count", 0) + 1
    copy_ = _Compiled(copy.deepcopy(model), _Compiled.count)
    extra = {} if budget is None else {"activation_memory_budget": budget}
    start = time.perf_counter()
    with functorch_config.patch(enable_autograd_cache=False, **extra), \
            inductor_config.patch(fx_graph_cache=False), speed.use(variant):
        for _ in range(steps):
            speed.step(copy_, batch)
    return copy_, time.perf_counter() - start


def step_peak(model: torch.nn.Module, batch: tuple, variant: str) -> tuple[int, int]:
    """The step's peak above its start and what is allocated after its forward (profiler allocation
    events matched by address)."""
    import memory_truth as truth

    model.zero_grad(set_to_none=True)
    with speed.use(variant):
        return truth.allocator(lambda marks: truth.step(model, batch, marks))


def matching_budget(model: torch.nn.Module, batch: tuple, goal: int, tries: int) -> tuple:
    """The ``activation_memory_budget`` whose compiled step peaks closest to ``goal`` bytes, by bisection
    (``tries`` compilations): (budget, compiled model, step peak, seconds to compile, bytes after the
    forward)."""
    low, high, tried = 0.0, 1.0, []
    for _ in range(tries):
        amb = round((low + high) / 2, 4)
        compiled_model, took = compile_variant(model, batch, "no-ckpt", amb)
        peak, kept = step_peak(compiled_model, batch, "no-ckpt")
        print(f"activation_memory_budget={amb}: compiled in {took:.0f} s, step peak {peak / 2**20:.2f} MiB, "
              f"{kept / 2**20:.2f} MiB after the forward", flush=True)
        tried.append((abs(peak - goal), amb, compiled_model, peak, took, kept))
        low, high = (amb, high) if peak < goal else (low, amb)
    return min(tried, key=lambda t: t[0])[1:]


def interleaved(runs: dict[str, tuple[torch.nn.Module, str]], batch: tuple, rounds: int) -> dict[str, list[float]]:
    """Step times of each ``name -> (model, variant)``, all interleaved in a fresh random order every
    round, after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    order, rng = list(runs), random.Random(0)
    for r in range(rounds + 1):
        rng.shuffle(order)
        for name in order:
            model, variant = runs[name]
            with speed.use(variant):
                elapsed = speed.step(model, batch)
            if r:
                times[name].append(elapsed)
    return times


def gradpatch_compiled(args: argparse.Namespace) -> int:
    """``--gradpatch-compiled``: see the module's docstring."""
    from gradpatch.checkpointing import budget as planned

    torch.set_num_threads(1)
    model, batch = speed.build(*speed.MODELS[args.model])
    speed.VARIANTS.update(cb.BASE)
    kept = {}
    for variant in ("respect", "never"):
        with speed.use(variant):
            kept[variant] = speed.saved_bytes(model, batch)
    size = int(args.fraction * (kept["never"] - kept["respect"]))
    speed.VARIANTS["budget"] = (fixed.replace_checkpoint(speed.V1), cb.budget_policy(size))
    planned.reset()
    print(f"{args.model} UNet, CPU, 1 thread, torch {torch.__version__}, {args.backend}; eager respect keeps "
          f"{kept['respect'] / 2**20:.2f} MiB after the forward, never {kept['never'] / 2**20:.2f} MiB; "
          f"gradpatch budget:{size} ({args.fraction:.0%} of the gap)", flush=True)
    runs: dict[str, tuple[torch.nn.Module, str]] = {}
    seconds, peaks, after = {}, {}, {}
    ours, today = "gradpatch budget, compiled", "respect, compiled (budget before)"
    for name, variant, amb, steps in [(today, "respect", None, 1),
                                      (ours, "budget", None, planned.TIMING_CALLS + 3),
                                      ("never, compiled (amb 1.0)", "no-ckpt", 1.0, 1)]:
        compiled_model, seconds[name] = compile_variant(model, batch, variant, amb, steps)
        runs[name] = (compiled_model, variant)
        peaks[name], after[name] = step_peak(compiled_model, batch, variant)
        print(f"{name}: compiled in {seconds[name]:.0f} s, step peak {peaks[name] / 2**20:.2f} MiB, "
              f"{after[name] / 2**20:.2f} MiB after the forward", flush=True)
    with speed.use("budget"):
        print(planned.checkpoint_plan(runs[ours][0].model).summary())
    with speed.use("never"):  # gradients: the compiled plan against eager never
        model.zero_grad(set_to_none=True)
        speed.forward(model, batch).float().square().mean().backward()
    runs[ours][0].zero_grad(set_to_none=True)
    with speed.use("budget"):
        speed.forward(runs[ours][0], batch).float().square().mean().backward()
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    error = max((a.grad - b.grad).abs().max().item()
                for a, b in zip(model.parameters(), runs[ours][0].model.parameters()))
    print(f"gradients, compiled plan vs eager never: max difference {error / scale:.1e} of the largest")
    amb, compiled_model, peak, took, kept = matching_budget(model, batch, peaks[ours], args.tries)
    match = f"torch amb {amb}, compiled"
    runs[match], peaks[match], seconds[match], after[match] = (compiled_model, "no-ckpt"), peak, took, kept
    side_by_side(interleaved(runs, batch, args.rounds), peaks, seconds, ours, (today, match), "x today", after)
    return 0


def side_by_side(times: dict[str, list[float]], peaks: dict[str, int], seconds: dict[str, float], ours: str,
                 others: tuple[str, str], against: str, after: dict[str, int] | None = None) -> None:
    """The interleaved rounds' table (each run's time against ``others[0]``, its peak against ``ours``;
    with ``after``, what each keeps after the forward) and ``ours`` against both ``others``."""
    print(f"\n{len(times[ours])} interleaved rounds; ratios: medians of per-round ratios")
    fwd = f"{'fwd MiB':>9}" if after else ""
    print(f"{'variant':<36}{'step ms':>9}{against:>11}{'peak MiB':>10}{'peak x ours':>13}{fwd}{'compile s':>11}")
    for name, taken in times.items():
        ratio = statistics.median(a / b for a, b in zip(taken, times[others[0]]))
        kept = f"{after[name] / 2**20:>9.2f}" if after else ""
        print(f"{name:<36}{statistics.median(taken) * 1e3:>9.1f}{ratio:>11.3f}{peaks[name] / 2**20:>10.2f}"
              f"{peaks[name] / peaks[ours]:>13.2f}{kept}{seconds[name]:>11.0f}")
    for other in others:
        ratio = statistics.median(a / b for a, b in zip(times[ours], times[other]))
        print(f"{ours} / {other}: time {ratio:.3f}x, peak {peaks[ours] / peaks[other]:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tries", type=int, default=4, help="compilations to find the matching budget")
    parser.add_argument("--budgets", type=float, nargs="+", help="compile these budgets instead (no bisection)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="CUDA: the forward under bf16 autocast")
    parser.add_argument("--gradpatch-compiled", action="store_true",
                        help="gradpatch's budget planned inside the compiled model, against torch's")
    parser.add_argument("--model", default="tiny-all-blocks", help="--gradpatch-compiled: the UNet")
    parser.add_argument("--fraction", type=float, default=0.5, help="--gradpatch-compiled: the budget")
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile's backend (aot_eager_decomp_partition: the same partitioner, "
                             "no kernel compilation)")
    args = parser.parse_args()
    BACKEND[0] = args.backend
    if args.gradpatch_compiled:
        return gradpatch_compiled(args)
    speed.VARIANTS.update(cb.BASE)
    if args.device == "cuda":
        speed.DEVICE, speed.AUTOCAST = torch.device("cuda"), torch.bfloat16 if args.bf16 else None
        kwargs, shape, _ = speed.MODELS["audioldm-s"]
        model, batch = speed.build(kwargs, shape, 8)
        where = (f"AudioLDM-S UNet, batch 8, {'bf16 autocast' if args.bf16 else 'fp32'}, "
                 f"{torch.cuda.get_device_name()}")
    else:
        torch.set_num_threads(1)
        model, batch = speed.build(*speed.MODELS["medium"])
        where = "medium UNet, CPU, 1 thread"
    fixed_copy = fixed.replace_checkpoint(speed.V1)
    memory, sizes, _ = cb.add_budgets(model, batch, fixed_copy)
    target = "budget 50%"
    with speed.use(target):
        memory[target] = speed.saved_bytes(model, batch)
    goal = memory[target] - memory["respect"]
    print(f"{where} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), torch "
          f"{torch.__version__}; respect keeps {memory['respect'] / 2**20:.2f} MiB after the forward, never "
          f"{memory['never'] / 2**20:.2f} MiB; gradpatch {target} = {sizes[target] / 2**20:.2f} MiB realises "
          f"{goal / 2**20:.2f} MiB beyond respect")

    models = {}
    budgets = args.budgets or [1.0]
    results = []
    for budget in budgets:
        try:
            candidate, seconds, realised = compiled(model, batch, budget)
        except Exception as error:  # say exactly what fails
            print(f"torch.compile (inductor, CPU) failed: {type(error).__name__}: {str(error)[:2000]}")
            return 1
        results.append((budget, candidate, realised - memory["respect"]))
        print(f"compiled at activation_memory_budget={budget} in {seconds:.0f} s: "
              f"{(realised - memory['respect']) / 2**20:.2f} MiB beyond respect")
    if not args.budgets:
        models["compile mem 1.0"], memory["compile mem 1.0"] = results[0][1], results[0][2] + memory["respect"]
        low, high = 0.0, 1.0
        for _ in range(args.tries):
            budget = round((low + high) / 2, 4)
            candidate, seconds, realised = compiled(model, batch, budget)
            extra = realised - memory["respect"]
            print(f"compiled at activation_memory_budget={budget} in {seconds:.0f} s: {extra / 2**20:.2f} MiB beyond respect")
            results.append((budget, candidate, extra))
            low, high = (budget, high) if extra < goal else (low, budget)
    best = min(results, key=lambda r: abs(r[2] - goal))
    name = f"compile mem {best[0]}"
    models[name], memory[name] = best[1], best[2] + memory["respect"]
    gap = memory["never"] - memory["respect"]
    matched = []  # gradpatch planned at the memory each compiled budget realised
    for budget, candidate, extra in results:
        models.setdefault(f"compile mem {budget}", candidate)
        memory.setdefault(f"compile mem {budget}", extra + memory["respect"])
        if 0 < extra < gap:
            variant = f"gradpatch at {budget}"
            speed.VARIANTS[variant] = (fixed_copy, cb.budget_policy(int(extra)))
            with speed.use(variant):
                for _ in range(3):  # plan at this size (the blocks are measured already)
                    speed.step(model, batch)
                memory[variant] = speed.saved_bytes(model, batch)
            matched.append((variant, f"compile mem {budget}"))

    variants = ["respect", target, "never", *(v for v, _ in matched), *models]
    times = interleaved({v: (models[v], "no-ckpt") if v in models else (model, v) for v in variants}, batch,
                        args.rounds)
    print(f"\n{args.rounds} interleaved rounds; ratios: medians of per-round ratios to respect")
    print(f"{'variant':<22}{'step ms':>9}{'x respect':>11}{'MiB beyond respect':>20}{'x gradpatch 50%':>17}")
    for variant in variants:
        ratio = statistics.median(a / b for a, b in zip(times[variant], times["respect"]))
        extra = memory[variant] - memory["respect"]
        print(f"{variant:<22}{statistics.median(times[variant]) * 1e3:>9.1f}{ratio:>11.3f}{extra / 2**20:>20.2f}"
              f"{extra / goal if goal else float('nan'):>17.2f}")
    ours = statistics.median(a / b for a, b in zip(times[target], times[name]))
    print(f"\ngradpatch {target} / {name}: time {ours:.3f}x, memory beyond respect "
          f"{goal / max(best[2], 1):.2f}x")
    for variant, other in matched:
        ratio = statistics.median(a / b for a, b in zip(times[variant], times[other]))
        extra = (memory[variant] - memory["respect"]) / max(memory[other] - memory["respect"], 1)
        print(f"{variant} / {other} (same memory): time {ratio:.3f}x, memory beyond respect {extra:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
