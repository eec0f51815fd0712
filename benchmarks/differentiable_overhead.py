"""Time of a ``gradpatch.differentiable`` call (forward + backward) against the same sampler with its
blockers removed by hand, on CPU (one thread), side by side in one run.

MLP rows: a Chatterbox-shaped Euler solver (CFG buffers refilled in place, ``x += v * dt``,
``@inference_mode``) around an MLP estimator of width ``--dims`` (3 layers), batch 8, ``--steps``
steps. The reference is the same computation written out of place with grad on. A second line puts
the call against the solver as written with its decorator removed, which runs under grad as it is
(nothing it saves for backward is overwritten): the buffer refills' own cost is then on both sides.

Flow-matching rows (``--flows``), the catalogued samplers through their patched entry
(``model(..., cache=False)``, which runs ``gradpatch.differentiable``), each against upstream's loop
copied by hand with its blockers removed (no decorator, the CFG batch built with ``torch.cat``):
``s3gen``, Chatterbox's S3Gen decoder (chatterbox-tts: ``CausalConditionalCFM`` with the causal
``ConditionalDecoder`` at the size ``S3Token2Mel`` builds, 71 M parameters, random weights), on
``--frames`` mel frames; ``matcha``, Matcha-TTS's ``CFM`` at the size its LJSpeech recipe builds (decoder
channels 256, 256, random weights), on ``--frames`` rounded down to a multiple of 4; ``s3gen-tiny``, the same classes at 16 channels
(:func:`gradpatch.testing_flow.chatterbox_cfm`, what the tests run); ``matcha-tiny``, Matcha-TTS's
``CFM`` (matcha-tts, :func:`gradpatch.testing_flow.matcha_cfm`: no in-place refills, so only the
call's machinery). ``--flow-steps`` Euler steps (Chatterbox's default is 10).

Interleaved pairs in alternating order, per-run thread CPU time; the medians and the median of the
per-pair ratios. The ratio is the cost of the ``__torch_function__`` mode (one Python call per torch
call), the saved-tensor hooks (one Python call per tensor saved), the copy-on-write copies of the
overwritten buffers and the call's own setup; the tiny rows are where it shows most. ``--mode-floor``
adds a ``no-op mode`` row under each MLP row: the hand-written sampler run under a
``__torch_function__`` mode that only calls through, and its ratio to the sampler alone. It is what
intercepting every torch call costs by itself, the floor of any design that does. ``--anatomy`` adds,
under each MLP row and against the sampler as written, the call with copy on write's parts taken out
(benchmark-only variants, never offered: this sampler writes into no tensor it saved, so its gradients
stay right; one that did would fail in backward): ``no mode`` (its ``__torch_function__`` mode never on
the stack), ``no pack hook`` (its saved-tensor hooks never pushed) and ``neither``, what is left being
the call's own setup and its per-step routing; under each flow row too, against the hand-written loop (a
variant that fails in backward, as Chatterbox's refills do without copy on write, says so).

    python benchmarks/differentiable_overhead.py [--dims 64 256 1024] [--steps 16] [--pairs 15]
        [--flows s3gen matcha s3gen-tiny matcha-tiny] [--frames 50] [--flow-steps 10] [--flow-pairs 5] [--mode-floor]
        [--anatomy]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Callable

import torch

import gradpatch
from flow_samplers import flow_case  # the sibling script: the flow rows' samplers


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


class CallThrough(torch.overrides.TorchFunctionMode):
    """A ``__torch_function__`` mode that only calls through (``--mode-floor``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def under_call_through(run: Callable[[], Any]) -> Callable[[], Any]:
    def wrapped() -> Any:
        with CallThrough():
            return run()

    return wrapped


@contextlib.contextmanager
def without(mode: bool, hooks: bool):
    """Benchmark-only (``--anatomy``): copy on write's mode and/or pack hook taken out of every call."""
    from gradpatch.sampling.generic.copy_on_write import CopyOnWrite

    enter, exit_, pushed = CopyOnWrite.__enter__, CopyOnWrite.__exit__, CopyOnWrite.hooks

    def enter_without_mode(self):
        out = enter(self)
        torch._C._pop_torch_function_stack()
        return out

    def exit_without_mode(self, *exc):
        torch._C._push_on_torch_function_stack(self)
        return exit_(self, *exc)

    if mode:
        CopyOnWrite.__enter__, CopyOnWrite.__exit__ = enter_without_mode, exit_without_mode
    if hooks:
        CopyOnWrite.hooks = lambda self: contextlib.nullcontext()
    try:
        yield
    finally:
        CopyOnWrite.__enter__, CopyOnWrite.__exit__, CopyOnWrite.hooks = enter, exit_, pushed


def taken_out(run: Callable[[], Any], mode: bool, hooks: bool) -> Callable[[], Any]:
    def wrapped() -> Any:
        with without(mode, hooks):
            return run()

    return wrapped


def timed(run: Callable[[], Any]) -> float:
    start = time.thread_time()  # one thread (set_num_threads(1)); CPU backward runs in the calling thread
    out = run()
    (out[0] if isinstance(out, tuple) else out).square().mean().backward()
    return time.thread_time() - start


def compare(runs: dict[str, Callable[[], Any]], pairs: int, params: list[torch.Tensor]) -> dict[str, list[float]]:
    """Each run's times, in the same interleaved rounds (the order alternates every round)."""
    for run in runs.values():
        timed(run)  # warm up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for pair in range(pairs):
        for name in (list(runs) if pair % 2 else list(reversed(runs))):
            for p in params:
                p.grad = None
            times[name].append(timed(runs[name]))
    return times


def against_hand(times: dict[str, list[float]], name: str = "ours") -> tuple[float, float, float]:
    """Median times of ``hand`` and ``name`` and the median of the per-round ratios."""
    ratio = statistics.median(o / h for o, h in zip(times[name], times["hand"]))
    return statistics.median(times["hand"]), statistics.median(times[name]), ratio


def row(name: str, hand: float, ours: float, ratio: float) -> None:
    print(f"{name:>14}  {1e3 * hand:>12.2f}  {1e3 * ours:>19.2f}  {ratio:>6.2f}", flush=True)


def part_row(name: str, base: float, part: float, ratio: float, against: str) -> None:
    """A ``--anatomy`` row: the call with part of copy on write taken out, against ``against``."""
    print(f"{name:>14}  {'':>12}  {1e3 * part:>19.2f}  {ratio:>6.2f}  (against {against}; unsafe, see above)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--flows", nargs="*", default=["s3gen-tiny", "matcha-tiny", "s3gen", "matcha"])
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--flow-steps", type=int, default=10)
    parser.add_argument("--flow-pairs", type=int, default=5)
    parser.add_argument("--mode-floor", action="store_true",
                        help="also time the hand-written MLP sampler under a call-through __torch_function__ mode")
    parser.add_argument("--anatomy", action="store_true",
                        help="also time the calls without copy on write's mode, pack hook, or both (unsafe)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'sampler':>14}  {'by hand (ms)':>12}  {'differentiable (ms)':>19}  {'ratio':>6}", flush=True)
    parts = {"no mode": (True, False), "no pack hook": (False, True), "neither": (True, True)}
    for dim in args.dims:
        torch.manual_seed(0)
        solver = Solver(dim)
        mu, noise = torch.randn(8, dim, requires_grad=True), torch.randn(8, dim)
        sample = gradpatch.differentiable(solver.forward, step="estimator", steps="n_timesteps")
        runs = {"hand": lambda: reference(solver, mu, noise, args.steps),
                "ours": lambda: sample(mu, noise, n_timesteps=args.steps)}
        runs["body"] = lambda: Solver.forward.__wrapped__(solver, mu, noise, args.steps)
        if args.mode_floor:
            runs["floor"] = under_call_through(runs["hand"])
        if args.anatomy:
            for name, (mode, hooks) in parts.items():
                runs[name] = taken_out(runs["ours"], mode, hooks)
        times = compare(runs, args.pairs, [mu, *solver.parameters()])
        row(f"mlp {dim}", *against_hand(times))
        body, ours, ratio = against_hand({"hand": times["body"], "ours": times["ours"]})
        print(f"{'':>14}  {1e3 * body:>12.2f}  {1e3 * ours:>19.2f}  {ratio:>6.2f}  (against the sampler as written, "
              "its decorator removed)", flush=True)
        if args.mode_floor:
            _, floor, ratio = against_hand(times, "floor")
            print(f"{'no-op mode':>14}  {'':>12}  {1e3 * floor:>19.2f}  {ratio:>6.2f}  (by hand, under a call-through "
                  "__torch_function__ mode)", flush=True)
        for name in parts if args.anatomy else ():
            part_row(name, *against_hand({"hand": times["body"], "ours": times[name]}), "the sampler as written")
    for flow in args.flows:
        upstream, model, kw, ref, inputs = flow_case(flow, args.frames)
        for key in inputs:
            kw[key] = kw[key].clone().requires_grad_()
        n = args.flow_steps
        with gradpatch.applied(upstream):
            runs = {"hand": lambda: ref(model, n, **kw), "ours": lambda: model(**kw, n_timesteps=n, cache=False)}
            pairs = args.pairs if "tiny" in flow else args.flow_pairs
            failing = {}
            if args.anatomy:
                for name, (mode, hooks) in parts.items():
                    runs[name] = taken_out(runs["ours"], mode, hooks)
                    try:  # a sampler that writes into what it saved (Chatterbox's refills) fails without them
                        timed(runs[name])
                    except RuntimeError as error:
                        failing[name] = str(error).split(".")[0]
                        del runs[name]
            times = compare(runs, pairs, [*(kw[key] for key in inputs), *model.parameters()])
            row(flow, *against_hand(times))
            for name in parts if args.anatomy else ():
                if name in failing:
                    print(f"{name:>14}  fails in backward: {failing[name][:60]}...", flush=True)
                else:
                    part_row(name, *against_hand(times, name), "the hand-written sampler")


if __name__ == "__main__":
    main()
