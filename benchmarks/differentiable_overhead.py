"""Time of a ``gradpatch.differentiable`` call (forward + backward) against the same sampler with its
blockers removed by hand, on CPU, side by side in one run.

A Chatterbox-shaped Euler solver (CFG buffers refilled in place, ``x += v * dt``, ``@inference_mode``)
around an MLP estimator of width ``--dim`` (3 layers), batch 8, ``--steps`` steps. The reference is the
same computation written out of place with grad on. Interleaved pairs in alternating order; medians
and the median of per-pair ratios. The ratio is the cost of the ``__torch_function__`` mode (one Python
call per torch call), the copy-on-write copies of the overwritten buffers, and the managers' checks.

    python benchmarks/differentiable_overhead.py [--dims 64 1024] [--steps 16] [--pairs 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradpatch


class Estimator(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2 * dim, dim), torch.nn.SiLU(), torch.nn.Linear(dim, dim),
                                       torch.nn.SiLU(), torch.nn.Linear(dim, dim))

    def forward(self, x, mu):
        return self.net(torch.cat([x, mu], dim=-1))


class Solver(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.estimator = Estimator(dim)

    @torch.inference_mode()
    def forward(self, mu, noise, n_timesteps=16, cfg=0.7):
        x, b = noise.clone(), len(mu)
        x_in, mu_in = torch.zeros(2 * b, mu.shape[1]), torch.zeros(2 * b, mu.shape[1])
        for _ in range(n_timesteps):
            x_in[:b] = x_in[b:] = x
            mu_in[:b] = mu
            v, u = self.estimator.forward(x_in, mu_in).chunk(2)
            x += ((1 + cfg) * v - cfg * u) / n_timesteps
        return x


def reference(solver, mu, noise, n):
    x = noise
    for _ in range(n):
        v, u = solver.estimator(torch.cat([x, x]), torch.cat([mu, torch.zeros_like(mu)])).chunk(2)
        x = x + (1.7 * v - 0.7 * u) / n
    return x


def timed(run) -> float:
    start = time.perf_counter()
    run().square().mean().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'dim':>6}  {'by hand (ms)':>12}  {'differentiable (ms)':>19}  {'ratio':>6}")
    for dim in args.dims:
        torch.manual_seed(0)
        solver = Solver(dim)
        mu, noise = torch.randn(8, dim, requires_grad=True), torch.randn(8, dim)
        sample = gradpatch.differentiable(solver.forward, step="estimator", steps="n_timesteps")
        runs = {"hand": lambda: reference(solver, mu, noise, args.steps),
                "ours": lambda: sample(mu, noise, n_timesteps=args.steps)}
        for run in runs.values():
            timed(run)  # warm up
        times: dict[str, list[float]] = {"hand": [], "ours": []}
        for pair in range(args.pairs):
            for name in (("hand", "ours") if pair % 2 else ("ours", "hand")):
                times[name].append(timed(runs[name]))
        ratio = statistics.median(o / h for o, h in zip(times["ours"], times["hand"]))
        print(f"{dim:>6}  {1e3 * statistics.median(times['hand']):>12.2f}  "
              f"{1e3 * statistics.median(times['ours']):>19.2f}  {ratio:>6.2f}")


if __name__ == "__main__":
    main()
