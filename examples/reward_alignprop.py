"""AlignProp-style reward fine-tuning of a diffusers pipeline: a LoRA on the UNet, trained by
backpropagating a differentiable reward through the sampler, with randomized truncation.

trl removed ``AlignPropTrainer`` in 0.24; the trainer was mostly a hand-copied ``__call__`` with the
gradient let through. With gradpatch the pipeline itself takes ``cache=False``: ``pipe(...,
cache=False, grad_steps=(lo, hi))`` returns images with a graph through the last K denoising steps,
K drawn per call in [lo, hi] (both ends included) from the pipeline's ``generator=`` (or torch's
default generator), as AlignProp's randomized truncation. For the same K the gradients equal trl
0.23.1's ``pipeline_step_with_grad`` (tests/project/test_reward_recipes.py).

The pipeline here is tiny and random (``gradpatch.testing.stable_diffusion_pipeline``); with a real
one: ``pipe = StableDiffusionPipeline.from_pretrained("stable-diffusion-v1-5/stable-diffusion-v1-5")``
and an aesthetic or CLIP reward. The reward here: the mean of a fixed random linear map of the
image (a toy score the LoRA can raise). Run: ``python examples/reward_alignprop.py``.
"""
from __future__ import annotations

import argparse

import torch

import gradpatch
from gradpatch.testing import add_lora, stable_diffusion_pipeline

SAMPLING = dict(height=16, width=16, num_inference_steps=4, guidance_scale=2.0, output_type="pt")


def reward_model(seed: int = 7) -> torch.nn.Module:
    """A toy differentiable reward on images (batch, 3, 16, 16) in [0, 1]: one score per image."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Tanh(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, 1), torch.nn.Flatten(0)).requires_grad_(False)


def loss_of(rewards: torch.Tensor) -> torch.Tensor:
    """AlignProp's loss (trl 0.23.1 ``AlignPropTrainer.calculate_loss``): maximize the mean reward."""
    return 10.0 - rewards.mean()


def sample(pipe: object, embeds: tuple[torch.Tensor, torch.Tensor], latents: torch.Tensor,
           grad_steps: int | tuple[int, int], **options: object) -> torch.Tensor:
    """Images with a graph through the last ``grad_steps`` steps (a range: K drawn per call, here from
    torch's default generator, since no ``generator=`` is passed); ``options`` override :data:`SAMPLING`."""
    batch = latents.shape[0]
    return pipe(prompt_embeds=embeds[0].expand(batch, -1, -1), negative_prompt_embeds=embeds[1].expand(batch, -1, -1),  # type: ignore[operator]
                latents=latents, cache=False, grad_steps=grad_steps, **{**SAMPLING, **options}).images


def main(argv: list[str] | None = None) -> list[float]:
    """Train; print and return the mean reward of each step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--grad-steps", type=int, nargs=2, default=(1, 3), metavar=("LO", "HI"))
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    pipe, embeds = stable_diffusion_pipeline()
    lora = add_lora(pipe.unet)  # type: ignore[attr-defined]
    reward = reward_model()
    optimizer = torch.optim.Adam(lora, lr=args.lr)
    latents = torch.randn(args.batch, 4, 8, 8, generator=torch.Generator().manual_seed(1))  # one fixed batch of noise
    torch.manual_seed(0)  # reproduces the K drawn at each step
    print(f"AlignProp on a tiny StableDiffusionPipeline: LoRA of {sum(p.numel() for p in lora)} parameters, "
          f"{SAMPLING['num_inference_steps']} steps, grad_steps={tuple(args.grad_steps)}")
    rewards = []
    with gradpatch.applied("diffusers"):  # or gradpatch.apply("diffusers") once, at the top of a script
        for step in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            score = reward(sample(pipe, embeds, latents, tuple(args.grad_steps)))
            loss_of(score).backward()
            optimizer.step()
            rewards.append(score.mean().item())
            print(f"  step {step:2d}  reward {rewards[-1]:+.4f}")
    quarter = max(1, len(rewards) // 4)
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    print(f"reward: first quarter {first:+.4f} -> last quarter {last:+.4f}")
    if not last > first:
        raise SystemExit("the reward did not rise")
    return rewards


if __name__ == "__main__":
    main()
