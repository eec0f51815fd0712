"""Saved activations of k-diffusion ``sample_*(cache=False)`` under gradpatch, and the cost of
``cache=True`` against the unpatched upstream function.

The denoiser is ``k_diffusion.layers.Denoiser`` around a small random 1-D convolutional network (four
residual blocks of 64 channels, 256 samples, batch 2; no downloads). For each sampler and N steps, one
forward + backward with ``cache=False`` in three ways: plain, ``checkpoint_steps=True`` and
``grad_steps=1``. Saved bytes: the peak, over the forward, of the distinct tensor storages autograd
holds for backward (``saved_tensors_hooks``; parameters excluded), as in ``sampler_memory.py``.

``cache=True`` is timed against upstream's decorated function on the same inputs: interleaved pairs in
alternating order, the median of per-pair ratios (a shared CPU moves it by several percent either way),
and the wrapper's own cost is measured alone, around a function that does nothing.

    python benchmarks/kdiffusion_memory.py [--quick] [--steps 8 32]

Target: ``checkpoint_steps`` at the largest N saves >= 5x fewer bytes than plain for every sampler
(exit 1 if missed).
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore")  # clip-anytorch's pkg_resources import warns

import torch  # noqa: E402

import gradpatch  # noqa: E402
from sampler_memory import SavedMeter  # noqa: E402  (same folder)

SAMPLERS = ["sample_euler", "sample_heun", "sample_dpmpp_2m", "sample_dpmpp_2m_sde"]


class Net(torch.nn.Module):
    def __init__(self, channels: int = 4, hidden: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Conv1d(channels, hidden, 3, padding=1)
        self.emb = torch.nn.Linear(1, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.GroupNorm(8, hidden), torch.nn.SiLU(), torch.nn.Conv1d(hidden, hidden, 3, padding=1))
            for _ in range(blocks))
        self.out = torch.nn.Conv1d(hidden, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.emb(sigma.reshape(-1, 1).log())[..., None]
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def measure(fn, model, x, sigmas, options: dict) -> int:
    meter = SavedMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        out = fn(model, x, sigmas, disable=True, cache=False, **options)
    out.square().mean().backward()
    model.zero_grad(set_to_none=True)
    return meter.peak


def cache_true_ratio(patched, upstream, model, x, sigmas, pairs: int) -> tuple[float, float]:
    """(median per-pair ratio patched / upstream, median upstream seconds)."""
    times: dict[str, list[float]] = {"upstream": [], "patched": []}
    calls = {"upstream": lambda: upstream(model, x, sigmas, disable=True),
             "patched": lambda: patched(model, x, sigmas, disable=True)}
    for i in range(pairs):
        for name in (("upstream", "patched") if i % 2 == 0 else ("patched", "upstream")):
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return (statistics.median(p / u for p, u in zip(times["patched"], times["upstream"])),
            statistics.median(times["upstream"]))


def wrapper_overhead(calls: int = 20000) -> float:
    """Seconds the ``cache=True`` wrapper adds per call, measured around a function that does nothing."""
    from gradpatch.sampling.families.functions import fixed_step_sampler

    def sample_stub(model, x, sigmas, extra_args=None, callback=None, disable=None):
        return None

    best = []
    for fn in (sample_stub, fixed_step_sampler(sample_stub)):
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn(None, None, None, disable=True)
            runs.append((time.perf_counter() - start) / calls)
        best.append(min(runs))
    return best[1] - best[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing pairs (memory figures are the same)")
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--pairs", type=int, default=None, help="cache=True pairs (default 40, quick 10)")
    args = parser.parse_args()
    pairs = args.pairs or (10 if args.quick else 40)
    torch.set_num_threads(1)

    import k_diffusion
    from k_diffusion import sampling

    torch.manual_seed(0)
    model = k_diffusion.layers.Denoiser(Net(), sigma_data=0.5)
    x = torch.randn(2, 4, 256) * 10
    upstream = {name: getattr(sampling, name) for name in SAMPLERS}
    print(f"k-diffusion Denoiser + conv net ({sum(p.numel() for p in model.parameters())} params), x {tuple(x.shape)}, "
          f"Karras sigmas; forward + backward with cache=False; 1 thread; torch {torch.__version__}")
    print(f"{'sampler':<22}{'steps':>6}  {'plain MB':>9}{'ckpt MB':>9}{'x fewer':>8}{'K=1 MB':>9}{'x fewer':>8}")
    ok = True
    with gradpatch.applied("k_diffusion"):
        for name in SAMPLERS:
            fn = getattr(sampling, name)
            for steps in args.steps:
                sigmas = sampling.get_sigmas_karras(steps, 0.05, 10.0)
                plain, ckpt, last = (measure(fn, model, x, sigmas, options) for options in
                                     ({}, {"checkpoint_steps": True}, {"grad_steps": 1}))
                print(f"{name:<22}{steps:>6}  {plain / 2**20:>9.2f}{ckpt / 2**20:>9.2f}{plain / ckpt:>8.1f}"
                      f"{last / 2**20:>9.2f}{plain / last:>8.1f}")
                ok &= steps != max(args.steps) or plain >= 5 * ckpt
        sigmas = sampling.get_sigmas_karras(min(args.steps), 0.05, 10.0)
        ratio, upstream_seconds = cache_true_ratio(sampling.sample_dpmpp_2m, upstream["sample_dpmpp_2m"], model, x, sigmas, pairs)
    print(f"cache=True / upstream, sample_dpmpp_2m, {min(args.steps)} steps, {pairs} interleaved pairs: "
          f"median per-pair ratio {ratio:.4f} (upstream median {upstream_seconds * 1e3:.2f} ms)")
    overhead = wrapper_overhead()
    print(f"cache=True wrapper alone: {overhead * 1e6:.2f} us per call = {overhead / upstream_seconds:.4%} of that call")
    print(f"checkpoint_steps at {max(args.steps)} steps: {'meets' if ok else 'MISSES'} the >= 5x target")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
