"""Saved activations and time of a differentiable diffusers pipeline call (gradpatch's ``cache=False``).

A tiny random StableDiffusionPipeline (no downloads) runs forward + backward with ``cache=False`` in
three ways: plain (every step builds a graph), ``checkpoint_steps=True`` (each UNet call recomputed in
backward) and ``grad_steps=1`` (only the last step builds a graph). Saved bytes are counted as
``sampler_memory.py`` counts them: the peak of the unique tensor storages autograd holds for backward,
parameters excluded (a checkpointed UNet call's own graph lives while it runs, so the peak includes
one call's activations). Times are the best of ``--repeats`` runs, one thread.

    HF_HUB_OFFLINE=1 python benchmarks/diffusers_memory.py [--quick] [--size 32] [--steps 8 32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import gradpatch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sampler_memory import SavedMeter  # noqa: E402  (the sibling script: one way of counting)


def build(seed: int = 0):
    from gradpatch.testing import add_lora, stable_diffusion_pipeline

    pipe, embeds = stable_diffusion_pipeline(seed)
    pipe.vae.requires_grad_(False)
    return pipe, add_lora(pipe.unet), embeds


def measure(pipe, params, embeds, steps: int, size: int, options: dict) -> tuple[int, float]:
    """(saved bytes, seconds) of one forward + backward."""
    excluded = {p.untyped_storage().data_ptr() for m in (pipe.unet, pipe.vae, pipe.text_encoder)
                for p in m.parameters()}
    meter = SavedMeter(excluded)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        images = pipe(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], height=size, width=size,
                      num_inference_steps=steps, guidance_scale=2.0, output_type="pt",
                      generator=torch.Generator().manual_seed(0), cache=False, **options).images
    (images - 1.0).pow(2).mean().backward()
    elapsed = time.perf_counter() - start
    for p in params:
        p.grad = None
    return meter.peak, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="steps 4 and 8, one repeat")
    parser.add_argument("--steps", type=int, nargs="+", default=None, help="default: 8 32")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (latents: half)")
    parser.add_argument("--repeats", type=int, default=None, help="default: 3 (1 with --quick)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    steps_list = args.steps or ([4, 8] if args.quick else [8, 32])
    repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    pipe, params, embeds = build()
    modes = {"plain": {}, "checkpoint_steps": {"checkpoint_steps": True}, "grad_steps=1": {"grad_steps": 1}}
    print(f"tiny StableDiffusionPipeline, {args.size}x{args.size} px, CFG 2.0, DDIM; forward + backward; "
          f"best of {repeats}; {args.threads} thread(s); torch {torch.__version__}")
    print(f"{'steps':>5}  {'mode':<17}{'saved MB':>10}{'x plain':>9}{'time s':>9}{'x plain':>9}")
    with gradpatch.applied("diffusers"):
        measure(pipe, params, embeds, 2, args.size, {})  # warm-up: first-use kernel setup
        for steps in steps_list:
            base = None
            for mode, options in modes.items():
                runs = [measure(pipe, params, embeds, steps, args.size, options) for _ in range(repeats)]
                saved, seconds = runs[0][0], min(r[1] for r in runs)
                base = base or (saved, seconds)
                print(f"{steps:>5}  {mode:<17}{saved / 2**20:>10.2f}{saved / base[0]:>9.3f}"
                      f"{seconds:>9.3f}{seconds / base[1]:>9.2f}")


if __name__ == "__main__":
    main()
