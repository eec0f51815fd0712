"""Fine-tune only the cross-attention of a (tiny, random) real AudioLDM UNet.

Upstream AudioLDM checkpoints every transformer block with the OpenAI/CompVis ``CheckpointFunction``,
forced on whatever ``use_checkpoint`` says, and that function cannot differentiate with respect to a
frozen parameter. So freezing everything but cross-attention fails at the first ``backward()``. This
script shows the failure, applies gradpatch (after audioldm was imported: gradpatch also rebinds the
names other modules imported), checks the fixed gradients against a run without checkpointing, and
trains a few steps on synthetic data. Run: ``make demo`` (or ``python examples/finetune_audioldm.py``).
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

import gradpatch
from gradpatch.testing import audioldm_batch, audioldm_unet


def denoising_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    prediction = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
    return torch.nn.functional.mse_loss(prediction, batch["target"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    started = time.perf_counter()

    model = audioldm_unet()
    summary = gradpatch.trainable(model, include=["*attn2*"])
    print(f"AudioLDM UNet, {summary}".splitlines()[0])
    batch = audioldm_batch(batch=4)

    print("\n1. upstream AudioLDM, cross-attention only trainable:")
    try:
        denoising_loss(model, batch).backward()
        print("   backward() worked (unexpected for upstream audioldm 0.1.1)")
    except RuntimeError as error:
        print(f"   backward() raised: {str(error).splitlines()[0]}")
    model.zero_grad(set_to_none=True)

    print("\n2. the same step under gradpatch:")
    report = gradpatch.apply("audioldm")
    print("   " + str(report).replace("\n", "\n   "))
    fix = next(record for record in report if record.patch == "audioldm.checkpoint")  # the one this step needs
    print(f"   {fix.patch}: {fix.status} ({fix.reason})")
    denoising_loss(model, batch).backward()
    fixed = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with gradpatch.checkpoint_policy_scope("never"):  # the reference: no recomputation at all
        denoising_loss(model, batch).backward()
    reference = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    worst = max(((fixed[n] - reference[n]).abs().max() / reference[n].abs().max().clamp_min(1e-12)).item()
                for n in reference)
    print(f"   gradients of {len(fixed)} trainable tensors; vs. no checkpointing: "
          f"max relative difference {worst:.1e} (same set: {fixed.keys() == reference.keys()})")
    model.zero_grad(set_to_none=True)

    print(f"\n3. training the cross-attention for {args.steps} steps on synthetic data:")
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    with torch.no_grad():
        before = denoising_loss(model, batch).item()
    for _ in tqdm(range(args.steps), ncols=80, desc="   steps"):
        optimizer.zero_grad(set_to_none=True)
        denoising_loss(model, batch).backward()
        optimizer.step()
    with torch.no_grad():
        after = denoising_loss(model, batch).item()
    print(f"   loss {before:.4f} -> {after:.4f}; total time {time.perf_counter() - started:.1f} s")
    if not after < before:
        raise SystemExit("the loss did not decrease")


if __name__ == "__main__":
    main()
