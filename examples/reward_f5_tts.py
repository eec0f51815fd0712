"""Reward fine-tuning of F5-TTS with a waveform reward: its DiT trained by a reward computed on audio
through the Vocos vocoder F5 uses, by a scorer that is itself ``@torch.no_grad()``.

Three no-grad walls stand between the reward and F5's transformer, each handled by gradpatch:
F5's ``CFM.sample`` (a catalogued fix: ``cache=False``, ``grad_steps=K``), Vocos' ``decode``
(``@torch.inference_mode()``) and the scorer's ``score`` (``@torch.no_grad()``): the latter two are
made differentiable on the spot with ``gradpatch.differentiable(fn)``, which lifts their grad-off
decorators for the call.

Tiny random models (no downloads): ``gradpatch.testing.f5_cfm`` (16 mel bins) and a Vocos built from
its classes at 16 mel bins. With pretrained ones: F5's ``load_model`` / ``load_vocoder`` from
``f5_tts.infer.utils_infer`` (``Vocos.from_pretrained("charactr/vocos-mel-24khz")``, 100 mel bins).
Run: ``python examples/reward_f5_tts.py``.
"""
from __future__ import annotations

import argparse

import torch

import gradpatch
from gradpatch.testing import f5_cfm, f5_inputs


def tiny_vocos(n_mels: int = 16, seed: int = 5) -> torch.nn.Module:
    """Vocos (the vocoder F5-TTS loads) with its own classes, tiny and random; frozen."""
    from vocos import Vocos
    from vocos.feature_extractors import MelSpectrogramFeatures
    from vocos.heads import ISTFTHead
    from vocos.models import VocosBackbone

    torch.manual_seed(seed)
    return Vocos(MelSpectrogramFeatures(sample_rate=24000, n_fft=256, hop_length=64, n_mels=n_mels),
                 VocosBackbone(input_channels=n_mels, dim=32, intermediate_dim=64, num_layers=2),
                 ISTFTHead(dim=32, n_fft=256, hop_length=64)).eval().requires_grad_(False)


class WaveformScorer(torch.nn.Module):
    """A frozen audio scorer as such scorers are often written: ``score`` under ``@torch.no_grad()``
    (a random 1-D conv net here; a quality or speaker-similarity model in practice)."""

    def __init__(self, seed: int = 6) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Conv1d(1, 8, 15, stride=4), torch.nn.Tanh(),
                                       torch.nn.Conv1d(8, 1, 9, stride=4)).requires_grad_(False)

    @torch.no_grad()
    def score(self, waveform: torch.Tensor) -> torch.Tensor:  # (batch, samples) -> (batch,)
        return self.net(waveform[:, None]).mean(dim=(1, 2))


def main(argv: list[str] | None = None) -> list[float]:
    """Train; print and return the mean reward of each step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--nfe", type=int, default=4, help="ODE steps of F5's sampler")
    parser.add_argument("--grad-steps", type=int, default=2)
    args = parser.parse_args(argv)
    model, (cond, text) = f5_cfm(), f5_inputs()
    model.train()
    vocoder, scorer = tiny_vocos(), WaveformScorer()
    decode = gradpatch.differentiable(vocoder.decode)  # Vocos.decode is @torch.inference_mode()
    score = gradpatch.differentiable(scorer.score)  # and the scorer @torch.no_grad()
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    print(f"F5-TTS (tiny, random) + Vocos + a no_grad waveform scorer: DiT of {sum(p.numel() for p in params)} "
          f"parameters, {args.nfe} ODE steps, grad_steps={args.grad_steps}")
    rewards = []
    with gradpatch.applied("f5_tts"):  # or gradpatch.apply("f5_tts") once, at the top of a script
        for step in range(args.steps):
            mel, _ = model.sample(cond, text, duration=24, steps=args.nfe, seed=0,  # one fixed noise draw
                                  cache=False, grad_steps=args.grad_steps)
            waveform = decode(mel.transpose(1, 2))  # (batch, frames, mels) -> (batch, samples)
            reward = score(waveform)
            optimizer.zero_grad(set_to_none=True)
            (-reward.mean()).backward()
            optimizer.step()
            rewards.append(reward.mean().item())
            print(f"  step {step:2d}  reward {rewards[-1]:+.4f}")
    quarter = max(1, len(rewards) // 4)
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    print(f"reward: first quarter {first:+.4f} -> last quarter {last:+.4f}")
    if not last > first:
        raise SystemExit("the reward did not rise")
    return rewards


if __name__ == "__main__":
    main()
