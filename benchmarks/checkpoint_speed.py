"""Training-step time and saved activations of checkpoint variants on AudioLDM's real UNet.

Run:  PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/checkpoint_speed.py [--quick]
      [--device cuda]

Variants, with every parameter trainable so that upstream V1 works: no checkpoint at all; upstream
V1 (``audioldm.latent_diffusion.util.checkpoint``); plain ``torch.utils.checkpoint`` with
``use_reentrant=False``; gradpatch's fixed checkpoint as the engine installs it, with policy
``respect`` and with policy ``never``. Models: the tiny UNet (only the transformer blocks, which
upstream always checkpoints), the same with ``use_checkpoint=True`` (ResBlocks too), and a
17M-parameter one with ``use_checkpoint=True``; with ``--device cuda``, also AudioLDM-S's own UNet
(185M parameters, its 8x256x16 latent, batch 4; upstream checkpoints its transformer blocks).

On the CPU (one thread) the machine is shared, so the clock is the thread's CPU time
(``time.thread_time``), which other processes disturb much less than wall time. On CUDA it is wall
time between synchronisations. Either way the variants are interleaved, every round running one
step of each in a fresh random order; ratios are medians over rounds of the per-round ratio, whose
quartiles show the noise. Saved activations are measured at the allocator level (bytes still
allocated after the forward, output included): with the profiler's memory events on the CPU, with
``torch.cuda.memory_allocated`` on CUDA. Both also count V1's ``ctx`` attributes, which saved-tensor
hooks would not see.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

import audioldm.latent_diffusion.attention as attention
import audioldm.latent_diffusion.openaimodel as openaimodel
import audioldm.latent_diffusion.util as util
from audioldm.latent_diffusion.openaimodel import UNetModel

from gradpatch import settings
from gradpatch.checkpointing import checkpoint as fixed

V1 = util.checkpoint


def _torch_nr(func, inputs, params, flag):
    if not flag:
        return func(*inputs)
    return torch.utils.checkpoint.checkpoint(func, *inputs, use_reentrant=False)


# name -> (checkpoint function, checkpoint policy)
VARIANTS: dict[str, tuple[Callable, str]] = {
    "no-ckpt": (lambda func, inputs, params, flag: func(*inputs), "respect"),
    "V1": (V1, "respect"),
    "torch-NR": (_torch_nr, "respect"),
    "fixed": (fixed.replace_checkpoint(V1), "respect"),  # what the engine installs
    "never": (fixed.replace_checkpoint(V1), "never"),
}

_SMALL = dict(in_channels=4, out_channels=4, extra_film_condition_dim=16)
MODELS = {  # name -> (UNet kwargs, latent shape, batch size)
    "tiny": (dict(_SMALL, model_channels=32, num_res_blocks=1, attention_resolutions=[2],
                  channel_mult=(1, 2), num_head_channels=16), (4, 16, 16), 2),
    "tiny-all-blocks": (dict(_SMALL, model_channels=32, num_res_blocks=1, attention_resolutions=[2],
                             channel_mult=(1, 2), num_head_channels=16, use_checkpoint=True),
                        (4, 16, 16), 2),
    "medium": (dict(_SMALL, model_channels=64, num_res_blocks=2, attention_resolutions=[4, 2],
                    channel_mult=(1, 2, 3), num_head_channels=32, use_checkpoint=True),
               (4, 16, 16), 2),
    # audioldm.utils.default_audioldm_config()'s UNet, for 10 s of audio
    "audioldm-s": (dict(in_channels=8, out_channels=8, extra_film_condition_dim=512,
                        model_channels=128, attention_resolutions=[8, 4, 2], num_res_blocks=2,
                        channel_mult=(1, 2, 3, 5), num_head_channels=32), (8, 256, 16), 4),
}
DEVICE = torch.device("cpu")
AUTOCAST: torch.dtype | None = None  # the forward's autocast dtype, if any


@contextlib.contextmanager
def use(variant: str) -> Iterator[None]:
    func, policy = VARIANTS[variant]
    saved = attention.checkpoint, openaimodel.checkpoint, settings.checkpoint_policy
    attention.checkpoint = openaimodel.checkpoint = func
    settings.checkpoint_policy = policy
    try:
        yield
    finally:
        attention.checkpoint, openaimodel.checkpoint, settings.checkpoint_policy = saved


def build(kwargs: dict, shape: tuple[int, int, int], n: int) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = UNetModel(image_size=shape[1], use_spatial_transformer=True,
                      extra_film_use_concat=True, **kwargs)
    for p in model.parameters():  # the output conv starts at zero: no gradient would flow
        if p.dim() > 1 and not p.any():
            torch.nn.init.normal_(p, std=0.02)
    batch = (torch.randn(n, *shape), torch.randint(0, 1000, (n,)),
             torch.randn(n, kwargs["extra_film_condition_dim"]))
    return model.to(DEVICE), tuple(t.to(DEVICE) for t in batch)


def forward(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, t, y = batch
    with torch.autocast(DEVICE.type, dtype=AUTOCAST, enabled=AUTOCAST is not None):
        return model(x, t, y=y)


def step(model: torch.nn.Module, batch: tuple) -> float:
    model.zero_grad(set_to_none=True)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward(model, batch).float().square().mean().backward()
        torch.cuda.synchronize()
        return time.perf_counter() - start
    start = time.thread_time()
    forward(model, batch).float().square().mean().backward()
    return time.thread_time() - start


def peak_bytes(model: torch.nn.Module, batch: tuple) -> int:
    """CUDA only: the training step's peak allocation beyond what was allocated before it."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward(model, batch).float().square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """The profiler's C++ side prints start/stop lines on fd 2; hide them."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def saved_bytes(model: torch.nn.Module, batch: tuple) -> int:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = forward(model, batch)
        torch.cuda.synchronize()
        saved = torch.cuda.memory_allocated() - before
        del out
        return saved
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = forward(model, batch)
    del out
    return sum(e.self_cpu_memory_usage for e in prof.events())


def interleaved(model: torch.nn.Module, batch: tuple, variants: list[str], rounds: int,
                warmup: int) -> dict[str, list[float]]:
    """Step times: every round runs each variant once, in a fresh random order."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    order, rng = list(variants), random.Random(0)
    for r in range(warmup + rounds):
        rng.shuffle(order)
        for variant in order:
            with use(variant):
                elapsed = step(model, batch)
            if r >= warmup:
                times[variant].append(elapsed)
    return times


def paired(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratio a/b."""
    ratios = [x / y for x, y in zip(times[a], times[b])]
    low, median, high = statistics.quantiles(ratios, n=4)
    return median, low, high


def table(name: str, rounds: int, warmup: int) -> None:
    model, batch = build(*MODELS[name])
    n_params = sum(p.numel() for p in model.parameters())
    times = interleaved(model, batch, list(VARIANTS), rounds, warmup)
    memory = {}
    for variant in VARIANTS:
        with use(variant):
            memory[variant] = saved_bytes(model, batch)
    print(f"\n== {name}: {n_params / 1e6:.1f}M params, {rounds} rounds of all variants ==")
    print(f"{'variant':9} {'median step':>12} {'/V1 paired':>11} {'quartiles':>14} "
          f"{'saved after fwd':>16}")
    for variant in VARIANTS:
        median, low, high = paired(times, variant, "V1")
        print(f"{variant:9} {statistics.median(times[variant]) * 1e3:10.1f}ms {median:11.3f} "
              f"{low:6.3f}..{high:5.3f} {memory[variant] / 2**20:13.2f}MiB")
    print("ratios: " + "   ".join(f"{a}/{b} = {paired(times, a, b)[0]:.3f}" for a, b in
                                    [("fixed", "V1"), ("never", "V1"), ("fixed", "no-ckpt")]))


def head_to_head(name: str, rounds: int) -> None:
    """The acceptance number: fixed against V1 alone, with rounds enough to resolve differences of
    about 1% on a loaded machine (the per-round ratio scatters by 5 to 10%)."""
    model, batch = build(*MODELS[name])
    times = interleaved(model, batch, ["V1", "fixed"], rounds, 5)
    median, low, high = paired(times, "fixed", "V1")
    error = 1.25 * (high - low) / 1.35 / len(times["V1"]) ** 0.5  # standard error of the median
    print(f"\n== {name}, fixed vs V1 only, {rounds} rounds ==\nfixed/V1 = {median:.3f} "
          f"+- {error:.3f} (quartiles {low:.3f}..{high:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, tiny model only")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        table("tiny", 40, 5)
        table("medium", 40, 5)
        table("audioldm-s", 20, 3)
        head_to_head("tiny", 200)
        head_to_head("medium", 200)
        head_to_head("audioldm-s", 60)
        return
    torch.set_num_threads(1)
    if args.quick:
        table("tiny", 10, 2)
        head_to_head("tiny", 60)
        return
    table("tiny", 20, 2)
    table("tiny-all-blocks", 20, 2)
    table("medium", 8, 1)
    head_to_head("tiny", 300)
    head_to_head("medium", 40)


if __name__ == "__main__":
    main()
