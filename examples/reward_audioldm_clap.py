"""Reward fine-tuning of AudioLDM with a CLAP-style reward: a text-audio similarity from transformers'
``ClapModel``, backpropagated through AudioLDM's own ``sample_log`` (DDIM), ``decode_first_stage`` and
HiFi-GAN vocoder into the UNet.

AudioLDM's sampling path is ``@torch.no_grad()`` from top to bottom; under gradpatch ``sample_log`` and
``decode_first_stage`` take ``cache=False`` (``grad_steps=K``: a graph through the last K steps only).
The waveform is turned into a log-mel spectrogram with torchaudio (differentiable) for CLAP's audio
encoder; the reward is the cosine similarity of the audio embedding with a fixed text embedding.

Tiny random models here (no downloads): ``gradpatch.testing.audioldm_ldm`` and a ``ClapModel`` from a
small ``ClapConfig``. With pretrained ones: ``model = audioldm.build_model(model_name="audioldm-s-full")``
and ``ClapModel.from_pretrained("laion/clap-htsat-unfused")`` (48 kHz input: resample the 16 kHz
waveform first). Run: ``python examples/reward_audioldm_clap.py``.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("TQDM_DISABLE", "1")  # upstream's DDIM loop always draws a progress bar

import torch  # noqa: E402

import gradpatch  # noqa: E402
from gradpatch.testing import audioldm_cond, audioldm_ldm  # noqa: E402


def tiny_clap(seed: int = 3) -> torch.nn.Module:
    """A randomly initialised ``ClapModel`` (text and HTSAT audio towers), 32 mel bins, frozen."""
    from transformers import ClapConfig, ClapModel

    torch.manual_seed(seed)
    config = ClapConfig(
        text_config=dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32, projection_dim=16),
        audio_config=dict(spec_size=64, num_mel_bins=32, window_size=4, patch_size=2, patch_stride=2, hidden_size=32,
                          patch_embeds_hidden_size=16, depths=[1, 1], num_attention_heads=[2, 2], intermediate_size=32,
                          projection_dim=16, enable_fusion=False),
        projection_dim=16)
    return ClapModel(config).eval().requires_grad_(False)


class ClapReward(torch.nn.Module):
    """Cosine similarity between CLAP's embedding of a waveform and of a prompt's token ids."""

    def __init__(self, clap: torch.nn.Module, prompt_ids: torch.Tensor, sample_rate: int = 16000) -> None:
        super().__init__()
        import torchaudio

        self.clap = clap
        self.mel = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=256, hop_length=64, n_mels=32)
        with torch.no_grad():
            self.register_buffer("text", torch.nn.functional.normalize(self.features(
                clap.get_text_features(input_ids=prompt_ids)), dim=-1))

    @staticmethod
    def features(output: object) -> torch.Tensor:
        return output if torch.is_tensor(output) else output.pooler_output  # type: ignore[attr-defined]

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:  # (batch, samples) -> (batch,)
        log_mel = (self.mel(waveform) + 1e-5).log().transpose(-1, -2)[:, None]  # (batch, 1, frames, mels)
        audio = self.features(self.clap.get_audio_features(input_features=log_mel))  # type: ignore[operator]
        return (torch.nn.functional.normalize(audio, dim=-1) * self.text).sum(-1)


def generate(model: torch.nn.Module, cond: torch.Tensor, steps: int, grad_steps: int) -> torch.Tensor:
    """A waveform with a graph into the UNet: DDIM through ``sample_log``, the first stage, the vocoder."""
    uncond = torch.zeros_like(cond)
    z, _ = model.sample_log(cond, cond.shape[0], ddim=True, ddim_steps=steps, eta=0.0,  # type: ignore[operator]
                            unconditional_guidance_scale=2.0, unconditional_conditioning=uncond,
                            cache=False, grad_steps=grad_steps)
    mel = model.decode_first_stage(z, cache=False)  # type: ignore[operator]  # (batch, 1, frames, mel bins)
    return model.first_stage_model.vocoder(mel.squeeze(1).transpose(1, 2)).squeeze(1)  # type: ignore[operator,union-attr]


def main(argv: list[str] | None = None) -> list[float]:
    """Train; print and return the mean reward of each step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ddim-steps", type=int, default=4)
    parser.add_argument("--grad-steps", type=int, default=2)
    args = parser.parse_args(argv)
    model = audioldm_ldm(seed=0).train()  # the UNet trains; first stage and vocoder are frozen
    reward = ClapReward(tiny_clap(), torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0)))
    cond = audioldm_cond(2)
    unet = [p for p in model.model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(unet, lr=args.lr)
    print(f"AudioLDM (tiny, random) + CLAP reward: UNet of {sum(p.numel() for p in unet)} parameters, "
          f"{args.ddim_steps} DDIM steps, grad_steps={args.grad_steps}")
    rewards = []
    with gradpatch.applied("audioldm"):  # or gradpatch.apply("audioldm") once, at the top of a script
        for step in range(args.steps):
            torch.manual_seed(0)  # one fixed noise draw: the rise is the model's
            score = reward(generate(model, cond, args.ddim_steps, args.grad_steps))
            optimizer.zero_grad(set_to_none=True)
            (-score.mean()).backward()
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
