"""The ``budget:<size>`` checkpoint policy: training-step time against saved activations.

Run:  PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/checkpoint_budget.py [--quick]
      [--model tiny|medium|audioldm] [--device cuda]

On AudioLDM's real UNet (``benchmarks/checkpoint_speed.py`` builds it; CPU, one thread), every
parameter trainable so that upstream V1 runs: V1, gradpatch's fixed checkpoint under ``respect``
and ``never``, torch's non-reentrant checkpoint, and ``budget`` at 25%, 50% and 75% of the gap
between ``respect``'s and ``never``'s activation memory, which is measured at the allocator level
(bytes still allocated after the forward, as ``checkpoint_speed.py`` does). For comparison, a naive
greedy plan at 50%: blocks by forward time per byte they keep, as long as they fit, with the
planner's byte counts ("greedy") and with naive ones ("naive": every saved tensor's size, views,
inputs and parameters included, scaled to the same total).

Each budget row reports the activation memory it keeps beyond ``respect`` against its budget, by
the allocator and by an independent measure (weak references to every storage an op returns during
the forward, those still alive after it counted once each, parameters and buffers left out), next
to what ``checkpoint_plan()`` says the kept blocks keep. On
the tiny UNet every subset of kept blocks is also measured (allocator bytes and step time, all
subsets and the plans interleaved in the same rounds): for each budget, the plan's step time over
that of the fastest subset that fits, chosen on half of the rounds and compared on the other half.

``--model audioldm``: the real AudioLDM-S UNet narrowed to ``model_channels=32`` (everything else as
``audioldm.utils.default_audioldm_config()``; 10 s of audio, batch 2, every block checkpointed), a
few seconds a step on one thread.

Timing as in ``checkpoint_speed.py``: thread CPU time, variants interleaved in a fresh random order
every round, medians and quartiles of per-round ratios.

With ``--device cuda``: AudioLDM-S's UNet at batch 8, in fp32 and under bf16 autocast, with the
budgets' fractions of the same gap; wall time between synchronisations, and each variant's peak
allocation during a training step (``torch.cuda.max_memory_allocated``).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_speed as speed  # noqa: E402

from gradpatch.checkpointing import checkpoint as fixed  # noqa: E402
from gradpatch.checkpointing import budget  # noqa: E402
from gradpatch.checkpointing.budget import planner  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75)
# The real AudioLDM-S UNet (audioldm.utils.default_audioldm_config(): 8 latent channels,
# channel_mult (1, 2, 3, 5), attention at 8/4/2, 2 ResBlocks a level, 32-channel heads, a 512-d
# FiLM condition) with model_channels 128 -> 32 and nothing else changed, on 10 s of audio
# (8x256x16 latent), batch 2, every block checkpointed (use_checkpoint=True; upstream's default
# checkpoints the transformer blocks only).
speed.MODELS["audioldm"] = (dict(speed.MODELS["audioldm-s"][0], model_channels=32,
                                 use_checkpoint=True), (8, 256, 16), 2)
BASE = {"V1": speed.VARIANTS["V1"], "torch-NR": speed.VARIANTS["torch-NR"],
        "never": speed.VARIANTS["never"], "respect": speed.VARIANTS["fixed"]}


class _LiveStorages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                self.refs.setdefault(ref.cdata, (ref, storage.nbytes()))
        return out


def live_bytes(model: torch.nn.Module, batch: tuple) -> int:
    """The measure independent of the allocator: bytes of the storages created during the forward
    that are still alive after it (its graph held through the output), each storage once, parameters
    and buffers left out. The checkpoint's RNG state (made outside the dispatcher) is not seen."""
    model.zero_grad(set_to_none=True)
    own = {StorageWeakRef(t.untyped_storage()).cdata
           for t in itertools.chain(model.parameters(), model.buffers())}
    mode = _LiveStorages()
    with mode:
        out = speed.forward(model, batch)
    alive = sum(size for key, (ref, size) in mode.refs.items()
                if not ref.expired() and key not in own)
    del out
    return alive


def budget_policy(size: int) -> str:
    return f"budget:{size}"


def forced(blocks: list, keep: list[bool], key: int) -> str:
    """A policy whose plan is ``keep``: the planner's plan for the otherwise unused size ``key``."""
    planner.PLANNER.plans[key] = [(b, k, None) for b, k in zip(blocks, keep)]
    return budget_policy(key)


def measure_plans(model: torch.nn.Module, batch: tuple, size: int) -> list:
    """Run the measuring steps under a budget; return the planned blocks, in order."""
    speed.VARIANTS["_measure"] = (fixed.replace_checkpoint(speed.V1), budget_policy(size))
    for _ in range(budget.TIMING_CALLS + 1):
        with speed.use("_measure"):
            speed.step(model, batch)
    del speed.VARIANTS["_measure"]
    plan = budget.checkpoint_plan(model)
    assert plan.complete, plan
    return [block for _, block in planner.PLANNER.live()]


def add_budgets(model: torch.nn.Module, batch: tuple,
                checkpoint: Callable) -> tuple[dict[str, int], dict[str, int], list]:
    """Measure ``respect``'s and ``never``'s activations after the forward, plan budgets at
    ``FRACTIONS`` of the gap between them and add a variant for each (through ``checkpoint``);
    return those activations, the budgets by variant name, and the planned blocks."""
    memory = {}
    for variant in ("respect", "never"):
        with speed.use(variant):
            memory[variant] = speed.saved_bytes(model, batch)
    gap = memory["never"] - memory["respect"]
    sizes = {f"budget {int(f * 100)}%": int(f * gap) for f in FRACTIONS}
    budget.reset()
    blocks = measure_plans(model, batch, sizes["budget 50%"])
    for variant, size in sizes.items():
        speed.VARIANTS[variant] = (checkpoint, budget_policy(size))
    return memory, sizes, blocks


def raw_bytes(model: torch.nn.Module, batch: tuple, owners: list) -> list[int]:
    """Per block, the bytes of every tensor autograd saves while it runs without checkpoint, as a
    naive count would have them: views and shared storages counted each time, inputs and
    parameters included."""
    counts, current = [0] * len(owners), []
    index = {id(owner): i for i, owner in enumerate(owners)}
    def enter(module: torch.nn.Module, args: tuple) -> None:
        current.append(index[id(module)])

    def leave(module: torch.nn.Module, args: tuple, out: object) -> None:
        current.pop()

    hooks = [owner.register_forward_pre_hook(enter) for owner in owners]
    hooks += [owner.register_forward_hook(leave) for owner in owners]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current:
            counts[current[-1]] += t.nelement() * t.element_size()
        return t.detach()

    x, t, y = batch
    try:
        with speed.use("never"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, t, y=y)
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def greedy(blocks: list, size: int, sizes: list[int] | None = None) -> list[bool]:
    """The naive plan: by forward time per kept byte, keep what still fits (by ``sizes``, the
    blocks' counted bytes unless given)."""
    sizes = sizes or [b.step_bytes for b in blocks]
    keep, used = [False] * len(blocks), 0
    order = sorted(range(len(blocks)), key=lambda i: -min(blocks[i].forward) / max(sizes[i], 1))
    for i in order:
        if used + sizes[i] <= size:
            keep[i], used = True, used + sizes[i]
    return keep


def curve(name: str, rounds: int, warmup: int, exhaustive: bool) -> None:
    model, batch = speed.build(*speed.MODELS[name])
    fixed_copy = fixed.replace_checkpoint(speed.V1)
    speed.VARIANTS.clear()
    speed.VARIANTS.update(BASE)
    memory, sizes, blocks = add_budgets(model, batch, fixed_copy)
    gap = memory["never"] - memory["respect"]
    half = sizes["budget 50%"]
    speed.VARIANTS["greedy 50%"] = (fixed_copy, forced(blocks, greedy(blocks, half), half + 1))
    # The same greedy with naive byte counts, scaled so that keeping all still fills the gap.
    raw = raw_bytes(model, batch, [owner for owner, _ in planner.PLANNER.live()])
    scale = sum(b.step_bytes for b in blocks) / sum(raw)
    naive = greedy(blocks, half, [int(r * scale) for r in raw])
    speed.VARIANTS["naive 50%"] = (fixed_copy, forced(blocks, naive, half + 2))
    subsets = {}
    if exhaustive:
        for n, keep in enumerate(itertools.product((False, True), repeat=len(blocks))):
            label = "keep {" + ",".join(str(i) for i, k in enumerate(keep) if k) + "}"
            subsets[label] = keep
            speed.VARIANTS[label] = (fixed_copy, forced(blocks, list(keep), gap + 10 + n))
    for variant in speed.VARIANTS:
        if variant not in memory:
            with speed.use(variant):
                memory[variant] = speed.saved_bytes(model, batch)
    live, reported = {}, {}
    for variant in ["respect", "never", *sizes]:
        with speed.use(variant):
            live[variant] = live_bytes(model, batch)
            if variant in sizes:
                reported[variant] = budget.checkpoint_plan(model)
    times = speed.interleaved(model, batch, list(speed.VARIANTS), rounds, warmup)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\n== {name}: {n_params / 1e6:.1f}M params, {len(blocks)} checkpointed blocks, {rounds} "
          f"rounds; respect keeps {memory['respect'] / 2**20:.2f} MiB, never "
          f"{memory['never'] / 2**20:.2f} MiB (gap {gap / 2**20:.2f} MiB) ==")
    print(f"{'variant':12} {'median step':>12} {'/V1 paired':>11} {'quartiles':>14} "
          f"{'saved after fwd':>16} {'beyond respect':>15} {'/budget':>8}")
    for variant in [v for v in speed.VARIANTS if v not in subsets]:
        median, low, high = speed.paired(times, variant, "V1")
        beyond = memory[variant] - memory["respect"]
        size = sizes.get(variant, half if variant.endswith(" 50%") else None)
        ratio = f"{beyond / size:8.3f}" if size else ""
        print(f"{variant:12} {statistics.median(times[variant]) * 1e3:10.1f}ms {median:11.3f} "
              f"{low:6.3f}..{high:5.3f} {memory[variant] / 2**20:13.2f}MiB "
              f"{beyond / 2**20:12.2f}MiB {ratio}")
    print("planned: " + "; ".join(
        f"{v}: {sum(k for _, k, _ in planner.PLANNER.plans[s])} of {len(blocks)} kept, "
        f"{sum(a for _, k, a in planner.PLANNER.plans[s] if k) / 2**20:.2f} MiB estimated"
        for v, s in sizes.items()))
    live_gap = live["never"] - live["respect"]
    print(f"live storages after the forward (weak references): respect "
          f"{live['respect'] / 2**20:.2f} MiB, never {live['never'] / 2**20:.2f} MiB "
          f"(gap {live_gap / 2**20:.2f} MiB)")
    print(f"{'variant':12} {'budget':>10} {'allocator':>10} {'/budget':>8} {'live':>10} "
          f"{'/budget':>8} {'plan says':>10} {'/allocator':>10} {'/live':>6} {'kept':>6}")
    for variant, size in sizes.items():
        kept, alive = memory[variant] - memory["respect"], live[variant] - live["respect"]
        plan = reported[variant]
        print(f"{variant:12} {size / 2**20:7.2f}MiB {kept / 2**20:7.2f}MiB {kept / size:8.3f} "
              f"{alive / 2**20:7.2f}MiB {alive / size:8.3f} {plan.kept_bytes / 2**20:7.2f}MiB "
              f"{plan.kept_bytes / kept:10.3f} {plan.kept_bytes / alive:6.3f} "
              f"{sum(not e.recomputed for e in plan):3}/{len(plan)}")
    median, low, high = speed.paired(times, "budget 50%", "greedy 50%")
    planned = {b: k for b, k, _ in planner.PLANNER.plans[sizes["budget 50%"]]}
    differ = sum(planned[b] != k for b, k in zip(blocks, greedy(blocks, sizes["budget 50%"])))
    print(f"budget 50% / greedy 50% = {median:.3f} ({low:.3f}..{high:.3f}); the plans differ in "
          f"{differ} of {len(blocks)} blocks")
    # The fastest subset is chosen on the even rounds and compared on the odd ones: choosing and
    # comparing on the same rounds would favour whichever subset the noise flattered.
    choose = {v: t[0::2] for v, t in times.items()}
    judge = {v: t[1::2] for v, t in times.items()}
    for variant, size in sizes.items() if subsets else ():
        fitting = [s for s in subsets if memory[s] - memory["respect"] <= size]
        best = min(fitting, key=lambda s: statistics.median(choose[s]))
        median, low, high = speed.paired(judge, variant, best)
        print(f"exhaustive, {variant}: {len(fitting)} of {len(subsets)} subsets fit; fastest "
              f"{best}; plan/fastest = {median:.3f} ({low:.3f}..{high:.3f})")


def gpu_curve(dtype: torch.dtype | None, rounds: int, every_block: bool = False) -> None:
    """AudioLDM-S at batch 8; ``dtype``: the forward's autocast dtype, if any; ``every_block``:
    every block checkpointed (``use_checkpoint=True``), not only the transformer blocks."""
    speed.AUTOCAST = dtype
    kwargs, shape, _ = speed.MODELS["audioldm-s"]
    kwargs = dict(kwargs, use_checkpoint=every_block)
    model, batch = speed.build(kwargs, shape, 8)
    speed.VARIANTS.clear()
    speed.VARIANTS.update(BASE)
    try:
        with speed.use("V1"):
            speed.step(model, batch)
    except RuntimeError as error:  # V1 recomputes outside autocast
        print(f"\n(V1 under {dtype}: {str(error).splitlines()[0][:100]})")
        del speed.VARIANTS["V1"]
    memory, sizes, _ = add_budgets(model, batch, fixed.replace_checkpoint(speed.V1))
    gap = memory["never"] - memory["respect"]
    peak, reported = {}, {}
    for variant in speed.VARIANTS:
        with speed.use(variant):
            memory.setdefault(variant, speed.saved_bytes(model, batch))
            peak[variant] = speed.peak_bytes(model, batch)
            if variant in sizes:
                reported[variant] = budget.checkpoint_plan(model).kept_bytes
    times = speed.interleaved(model, batch, list(speed.VARIANTS), rounds, 2)
    base = "V1" if "V1" in speed.VARIANTS else "respect"
    label = (f"{dtype} autocast" if dtype else "fp32") + (", every block checkpointed" if every_block else "")
    print(f"\n== audioldm-s, batch 8, {label}, {rounds} rounds; gap "
          f"{gap / 2**20:.0f} MiB ==")
    print(f"{'variant':12} {'median step':>12} {'/' + base + ' paired':>16} {'quartiles':>14} "
          f"{'saved after fwd':>16} {'peak in step':>13} {'beyond respect /budget':>23}")
    for variant in speed.VARIANTS:
        median, low, high = speed.paired(times, variant, base)
        beyond = memory[variant] - memory["respect"]
        ratio = f"{beyond / sizes[variant]:8.3f}" if variant in sizes else ""
        print(f"{variant:12} {statistics.median(times[variant]) * 1e3:10.1f}ms {median:16.3f} "
              f"{low:6.3f}..{high:5.3f} {memory[variant] / 2**20:13.0f}MiB "
              f"{peak[variant] / 2**20:10.0f}MiB {ratio:>23}")
    print("checkpoint_plan() reports, over the allocator's bytes beyond respect: " + ", ".join(
        f"{v} {reported[v] / max(memory[v] - memory['respect'], 1):.3f}" for v in sizes))
    budget.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--model", choices=("tiny", "medium", "audioldm"), help="only this model")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--every-block", action="store_true",
                        help="CUDA: every block of AudioLDM-S checkpointed, not only its transformer blocks")
    args = parser.parse_args()
    if args.device == "cuda":
        speed.DEVICE = torch.device("cuda")
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        for dtype in (None, torch.bfloat16):
            gpu_curve(dtype, 20, every_block=args.every_block)
        return
    torch.set_num_threads(1)
    if args.quick:
        for name in [args.model] if args.model else ["tiny", "medium"]:
            curve(name, {"tiny": 10, "medium": 4}.get(name, 3), 1, exhaustive=name == "tiny")
        return
    for name in [args.model] if args.model else ["tiny", "medium", "audioldm"]:
        curve(name, {"tiny": 60, "medium": 20}.get(name, 8), {"tiny": 3}.get(name, 1),
              exhaustive=name == "tiny")


if __name__ == "__main__":
    main()
