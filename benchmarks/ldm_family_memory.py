"""Saved activations and time of the native samplers of AudioLDM2, AudioSR and stable-diffusion-sdkit's
``ldm`` with ``cache=False`` under gradpatch: plain, ``checkpoint_steps=True`` and ``grad_steps=1``.

Tiny random real ``LatentDiffusion`` models (``gradpatch.testing_ldm``), batch 2, 4 x 8 x 8 latents,
classifier-free guidance 3.0 (AudioLDM2/AudioSR: two UNet calls per DDIM step; sdkit: one batched
call; PLMS on AudioLDM2 without guidance, as upstream cannot concatenate its dict conditionings).
Forward (sampling + ``decode_first_stage(cache=False)``) and backward, side by side in one run. Saved
bytes are counted as in ``sampler_memory.py`` (peak of the unique storages autograd holds, parameters
excluded). Deterministic on CPU.

    HF_HUB_OFFLINE=1 python benchmarks/ldm_family_memory.py [--steps 32] [--only sdkit-ddim ...]

Target: ``checkpoint_steps`` saves >= 5x fewer bytes than plain at the largest N (exit 1 if missed).
"""
from __future__ import annotations

import argparse
import importlib
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import gradpatch  # noqa: E402
from sampler_memory import SavedMeter, sweep  # noqa: E402  (the sibling script: one way of counting)

CASES = {  # name: (upstream, package, builder package or None for sdkit, sampler, guidance)
    "audioldm2-ddim": ("audioldm2", "audioldm2.latent_diffusion.models", "audioldm2", "ddim", True),
    "audioldm2-plms": ("audioldm2", "audioldm2.latent_diffusion.models", "audioldm2", "plms", False),
    "audiosr-ddim": ("audiosr", "audiosr.latent_diffusion.models", "audiosr", "ddim", True),
    "sdkit-ddim": ("ldm", "ldm.models.diffusion", None, "ddim", True),
    "sdkit-plms": ("ldm", "ldm.models.diffusion", None, "plms", True),
    "sdkit-dpm": ("ldm", "ldm.models.diffusion", None, "dpm", True),
}


def sampler_of(package: str, kind: str, model):
    if kind == "dpm":
        return importlib.import_module(f"{package}.dpm_solver.sampler").DPMSolverSampler(model)
    cls = getattr(importlib.import_module(f"{package}.{kind}"), "DDIMSampler" if kind == "ddim" else "PLMSSampler")
    return cls(model)


def measure(case: tuple, built: tuple, steps: int, options: dict) -> tuple[int, float]:
    from gradpatch.testing_ldm import LATENT

    _, package, _, kind, guidance = case
    model, cond, uncond = built
    extra = dict(unconditional_guidance_scale=3.0, unconditional_conditioning=uncond) if guidance else {}
    meter = SavedMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        z, _ = sampler_of(package, kind, model).sample(steps, 2, LATENT, cond, verbose=False, cache=False,
                                                        **extra, **options)
        image = model.decode_first_stage(z, cache=False)
    image.square().mean().backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return meter.peak, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[32])
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per mode (memory is deterministic)")
    parser.add_argument("--quick", action="store_true", help="make bench: audioldm2-ddim and sdkit-dpm only")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.only = ["audioldm2-ddim", "sdkit-dpm"]
    from gradpatch.testing_ldm import audioldm2_model, sdkit_model

    print(f"tiny LatentDiffusion, batch 2, 4x8x8 latents; forward + decode + backward with cache=False; "
          f"{args.threads} thread(s); torch {torch.__version__}")
    print(f"{'case':<17}{'steps':>5}  {'mode':<17}{'saved MB':>10}{'x fewer':>9}{'time s':>9}{'x plain':>9}")
    ok = True
    for name in args.only:
        case = CASES[name]
        with gradpatch.applied(case[0]):
            built = audioldm2_model(case[2]) if case[2] else sdkit_model()
            measure(case, built, 2, {})  # warm-up
            ok &= sweep(lambda n, options: measure(case, built, n, options), args.steps, args.repeats,
                        label=f"{name:<17}")
    print(f"checkpoint_steps at {max(args.steps)} steps: {'meets' if ok else 'MISSES'} the >= 5x target everywhere")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
