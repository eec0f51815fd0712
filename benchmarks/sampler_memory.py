"""Saved activations and time of F5-TTS ``CFM.sample(cache=False)`` under gradpatch, and the cost of
``cache=True`` against unpatched upstream.

A tiny random DiT (``dim=32, depth=2``; no downloads), ``duration`` frames, CFG 2.0, Euler. For N
steps, forward + backward in three ways: plain (every step builds a graph), ``checkpoint_steps=True``
(each transformer evaluation recomputed in backward) and ``grad_steps=1`` (only the last step builds a
graph). Saved bytes: the peak, over the forward, of the unique tensor storages autograd holds for
backward, seen through ``torch.autograd.graph.saved_tensors_hooks`` and released when the graph node
holding them is freed; parameters are excluded. A checkpointed evaluation's own graph lives while the
evaluation runs (one step's activations, as its recompute in backward does), so the peak includes one
step's activations. Deterministic on CPU.

``cache=True`` (the original method behind gradpatch's wrapper) is timed against the unpatched upstream
method on the same model and inputs: interleaved pairs in alternating order, medians and the median of
per-pair ratios. On a shared machine those move by a few percent either way, so the wrapper's own cost
is also measured alone (around a method that does nothing) and given as a share of an upstream call.

    HF_HUB_OFFLINE=1 python benchmarks/sampler_memory.py [--quick] [--steps 8 32] [--duration 100]

Targets: ``checkpoint_steps`` at the largest N saves >= 5x fewer bytes than plain (checked: exit 1 if
missed); ``cache=True`` within 1% of upstream (printed).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import gradpatch  # noqa: E402


def build(seed: int = 0):
    from f5_tts.model import CFM, DiT

    torch.manual_seed(seed)
    net = DiT(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, mel_dim=16, text_num_embeds=32, text_dim=16)
    with torch.no_grad():
        for p in net.parameters():
            if not p.any():  # adaLN / proj_out start at zero
                p.normal_(std=0.05)
    model = CFM(transformer=net, mel_spec_kwargs=dict(n_mel_channels=16)).eval()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(1, 8, 16, generator=g), torch.randint(0, 32, (1, 6), generator=g)


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedMeter:
    """Live and peak bytes of the tensor storages autograd saves (each storage counted once)."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded, self.users, self.live, self.peak = excluded, {}, 0, 0

    def pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded:
            return tensor
        # A detached alias: the tensor itself would hold its grad_fn, and a saved output's node would
        # then hold itself through this object (a cycle that keeps the graph alive past its use).
        held = _Held(tensor.detach())
        if self.users.get(key, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.users[key] = self.users.get(key, 0) + 1
        weakref.finalize(held, self._release, key, storage.nbytes())
        return held

    def _release(self, key: int, nbytes: int) -> None:
        self.users[key] -= 1
        if self.users[key] == 0:
            self.live -= nbytes

    @staticmethod
    def unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held  # type: ignore[return-value]


def measure(model, cond, text, steps: int, duration: int, options: dict) -> tuple[int, float]:
    """(peak saved bytes, seconds) of one forward + backward with ``cache=False``."""
    meter = SavedMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        out, _ = model.sample(cond, text, duration=duration, steps=steps, cfg_strength=2.0, seed=0,
                              cache=False, **options)
    out.square().mean().backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return meter.peak, elapsed


def compare_cache_true(model, cond, text, upstream, steps: int, duration: int, pairs: int) -> dict[str, float]:
    """Upstream vs patched ``cache=True``, interleaved in alternating order: medians of each side and
    the median of the per-pair ratios (adjacent runs share the machine's load, so it is the steadier)."""
    kw = dict(duration=duration, steps=steps, cfg_strength=2.0, seed=0)
    times: dict[str, list[float]] = {"upstream": [], "patched": []}
    calls = {"upstream": lambda: upstream(model, cond, text, **kw), "patched": lambda: model.sample(cond, text, **kw)}
    for i in range(pairs):
        for name in (("upstream", "patched") if i % 2 == 0 else ("patched", "upstream")):
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return {"upstream": statistics.median(times["upstream"]), "patched": statistics.median(times["patched"]),
            "pair_ratio": statistics.median(p / u for p, u in zip(times["patched"], times["upstream"]))}


def wrapper_overhead(calls: int = 20000) -> float:
    """Seconds the ``cache=True`` wrapper adds per call, measured around a method that does nothing."""
    from gradpatch.sampling.families.ode import differentiable_sampler

    class Stub:
        def sample(self, cond, text, duration, *, steps=32, seed=None):
            return None

    bare, wrapped, stub = Stub.sample, differentiable_sampler(Stub.sample), Stub()
    best = []
    for method in (bare, wrapped):
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                method(stub, None, None, 20, steps=8, seed=0)
            runs.append((time.perf_counter() - start) / calls)
        best.append(min(runs))
    return best[1] - best[0]


MODES = {"plain": {}, "checkpoint_steps": {"checkpoint_steps": True}, "grad_steps=1": {"grad_steps": 1}}


def sweep(measure, steps: list[int], repeats: int, label: str = "") -> bool:
    """Print one row per step count and mode (:data:`MODES`): saved MB, how many times fewer than
    plain, median time, time relative to plain. ``measure(steps, options)`` returns ``(saved bytes,
    seconds)``. True when ``checkpoint_steps`` saves at least 5x fewer bytes than plain at the most
    steps. The sampler benchmarks share it."""
    ok = True
    for n in steps:
        base = None
        for mode, options in MODES.items():
            runs = [measure(n, options) for _ in range(repeats)]
            saved, seconds = runs[0][0], statistics.median(r[1] for r in runs)
            base = base or (saved, seconds)
            print(f"{label}{n:>5}  {mode:<17}{saved / 2**20:>10.2f}{base[0] / saved:>9.1f}"
                  f"{seconds:>9.3f}{seconds / base[1]:>9.2f}")
            if n == max(steps) and mode == "checkpoint_steps" and base[0] < 5 * saved:
                ok = False
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (memory figures are the same)")
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--duration", type=int, default=100, help="frames generated")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per mode (default 3, quick 1)")
    parser.add_argument("--pairs", type=int, default=None, help="cache=True pairs (default 40, quick 10)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    pairs = args.pairs or (10 if args.quick else 40)
    torch.set_num_threads(args.threads)

    from f5_tts.model import CFM

    upstream = CFM.__dict__["sample"]
    model, cond, text = build()
    print(f"F5-TTS CFM + tiny DiT, {args.duration} frames, CFG 2.0, Euler; forward + backward with cache=False; "
          f"median of {repeats}; {args.threads} thread(s); torch {torch.__version__}")
    print(f"{'steps':>5}  {'mode':<17}{'saved MB':>10}{'x fewer':>9}{'time s':>9}{'x plain':>9}")
    with gradpatch.applied("f5_tts"):
        measure(model, cond, text, 2, args.duration, {})  # warm-up
        ok = sweep(lambda n, options: measure(model, cond, text, n, args.duration, options), args.steps, repeats)
        steps = min(args.steps)
        compare_cache_true(model, cond, text, upstream, steps, args.duration, 2)  # warm-up
        timing = compare_cache_true(model, cond, text, upstream, steps, args.duration, pairs)
    overhead = wrapper_overhead()
    print(f"cache=True, {steps} steps, {pairs} interleaved pairs: upstream median {timing['upstream'] * 1e3:.2f} ms, "
          f"gradpatch median {timing['patched'] * 1e3:.2f} ms (ratio {timing['patched'] / timing['upstream']:.4f}); "
          f"median per-pair ratio {timing['pair_ratio']:.4f}")
    print(f"cache=True wrapper alone: {overhead * 1e6:.2f} us per call = {overhead / timing['upstream']:.5%} of an "
          f"upstream call ({'within' if overhead / timing['upstream'] <= 0.01 else 'OVER'} the 1% target)")
    print(f"checkpoint_steps at {max(args.steps)} steps: {'meets' if ok else 'MISSES'} the >= 5x target")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
