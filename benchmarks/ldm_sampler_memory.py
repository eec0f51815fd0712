"""Saved activations and time of AudioLDM's own ``DDIMSampler.sample(cache=False)`` under gradpatch.

A tiny random real AudioLDM ``LatentDiffusion`` (``gradpatch.testing.audioldm_ldm``; ``--medium`` for
the ~20M-parameter UNet), batch 1 with classifier-free guidance 2.0 (one batched UNet call per step),
4 x 16 x 16 latents. For N DDIM steps, forward (sampling + ``decode_first_stage(cache=False)``) and
backward in three ways: plain (every step builds a graph), ``checkpoint_steps=True`` (each UNet
evaluation recomputed in backward) and ``grad_steps=1`` (only the last step builds a graph). Saved
bytes are counted as in ``sampler_memory.py`` (peak of the unique storages autograd holds, parameters
excluded; a checkpointed evaluation's own saves are recomputed, so not counted). Deterministic on CPU.

    HF_HUB_OFFLINE=1 python benchmarks/ldm_sampler_memory.py [--steps 8 32] [--medium] [--repeats 3]

Target: ``checkpoint_steps`` at the largest N saves >= 5x fewer bytes than plain (exit 1 if missed).
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # upstream's DDIM loop always shows a progress bar
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import gradpatch  # noqa: E402
from sampler_memory import SavedMeter, sweep  # noqa: E402  (the sibling script: one way of counting)


def measure(model, cond, steps: int, options: dict) -> tuple[int, float]:
    from audioldm.latent_diffusion.ddim import DDIMSampler

    meter = SavedMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        z, _ = DDIMSampler(model).sample(steps, 1, (4, 16, 16), cond, verbose=False, unconditional_guidance_scale=2.0,
                                         unconditional_conditioning=torch.zeros_like(cond), cache=False, **options)
        mel = model.decode_first_stage(z, cache=False)
    mel.square().mean().backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return meter.peak, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--medium", action="store_true", help="the ~20M-parameter UNet (AUDIOLDM_MEDIUM)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per mode (memory is deterministic)")
    parser.add_argument("--quick", action="store_true", help="accepted for make bench; one run per mode")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from gradpatch.testing import AUDIOLDM_MEDIUM, AUDIOLDM_TINY, audioldm_cond, audioldm_ldm

    with gradpatch.applied("audioldm"):
        model = audioldm_ldm(**(AUDIOLDM_MEDIUM if args.medium else AUDIOLDM_TINY)).eval()
        cond = audioldm_cond(1)
        params = sum(p.numel() for p in model.model.parameters())
        print(f"AudioLDM LatentDiffusion, {params / 1e6:.1f}M-parameter UNet, 4x16x16 latents, CFG 2.0, DDIM; "
              f"forward + decode + backward with cache=False; {args.threads} thread(s); torch {torch.__version__}")
        print(f"{'steps':>5}  {'mode':<17}{'saved MB':>10}{'x fewer':>9}{'time s':>9}{'x plain':>9}")
        measure(model, cond, 2, {})  # warm-up
        ok = sweep(lambda n, options: measure(model, cond, n, options), args.steps, args.repeats)
    print(f"checkpoint_steps at {max(args.steps)} steps: {'meets' if ok else 'MISSES'} the >= 5x target")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
