"""gradpatch's ``budget:<size>`` against ``torch.compile`` with
``torch._functorch.config.activation_memory_budget``, at about the same realised memory.

Run:  PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/checkpoint_compile.py [--rounds 8]
      [--tries 4 | --budgets 0.0 0.25] [--device cuda [--bf16]]

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
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_budget as cb  # noqa: E402
import checkpoint_speed as speed  # noqa: E402

from gradpatch.checkpointing import checkpoint as fixed  # noqa: E402

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
        self.step = torch.compile(namespace[f"step_{index}"], backend="inductor")

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tries", type=int, default=4, help="compilations to find the matching budget")
    parser.add_argument("--budgets", type=float, nargs="+", help="compile these budgets instead (no bisection)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="CUDA: the forward under bf16 autocast")
    args = parser.parse_args()
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
    times: dict[str, list[float]] = {v: [] for v in variants}
    import random

    order, rng = list(variants), random.Random(0)
    for r in range(args.rounds + 1):
        rng.shuffle(order)
        for variant in order:
            if variant in models:
                with speed.use("no-ckpt"):
                    elapsed = speed.step(models[variant], batch)
            else:
                with speed.use(variant):
                    elapsed = speed.step(model, batch)
            if r:
                times[variant].append(elapsed)
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
