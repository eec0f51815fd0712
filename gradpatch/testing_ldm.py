"""Tiny, randomly initialised real ``LatentDiffusion`` models of the CompVis ldm family, for tests and
benchmarks: AudioLDM2 (PyPI ``audioldm2``), AudioSR (PyPI ``audiosr``, an AudioLDM2 clone) and the SD2 /
ControlNet code that PyPI ``stable-diffusion-sdkit`` ships as the package ``ldm``.

Each builder instantiates the upstream class from an upstream-style config: the real ``LatentDiffusion``,
``DiffusionWrapper``, ``UNetModel`` (32 channels, two levels, one spatial transformer) and
``AutoencoderKL`` first stage (32 channels, 16x16 input, 8x8x4 latents), with the zero-initialised output
layers re-initialised (:func:`gradpatch.testing.reinit_zero_weights`), and returns it with a matching
conditioning and an unconditional conditioning for classifier-free guidance. Nothing is downloaded.

One substitution, only while an AudioLDM2/AudioSR model is constructed: ``DDPM.__init__`` always builds a
CLAP audio encoder (``CLAPAudioEmbeddingClassifierFreev2``) whose constructor loads a RoBERTa tokenizer
from the Hugging Face hub, and which sampling never calls. The builder puts :class:`NoCLAP` in its place
for the duration of the constructor; the samplers, the UNet and the first stage stay upstream's.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

import torch

from gradpatch.testing import reinit_zero_weights

LATENT = (4, 8, 8)
"""Latent shape (channels, time/height, frequency/width) of every model built here."""


class NoCLAP(torch.nn.Module):
    """Stands in for AudioLDM2's CLAP audio encoder while a tiny model is built (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


@contextlib.contextmanager
def _replaced(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _unet(package: str, **extra: Any) -> dict[str, Any]:
    return {"target": f"{package}.modules.diffusionmodules.openaimodel.UNetModel",
            "params": dict(image_size=8, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=1,
                           attention_resolutions=[2], channel_mult=[1, 2], num_head_channels=16,
                           use_spatial_transformer=True, transformer_depth=1, **extra)}


def _ddconfig(**extra: Any) -> dict[str, Any]:
    return dict(double_z=True, z_channels=4, resolution=16, ch=32, ch_mult=[1, 2], num_res_blocks=1,
                attn_resolutions=[], dropout=0.0, **extra)


def _finish(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    reinit_zero_weights(model, std=0.05, seed=seed)
    return model.eval()


def audioldm2_model(package: str = "audioldm2", seed: int = 0,
                    batch: int = 2) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A tiny ``{package}.latent_diffusion.models.ddpm.LatentDiffusion`` (``package`` is ``"audioldm2"``
    or ``"audiosr"``) conditioned by FiLM on a 16-dimensional embedding, on the CPU, in eval mode; and
    ``(model, cond, uncond)`` where the conditionings are dicts as AudioLDM2's samplers take them.

    The first stage is built with ``image_key="mel"`` so that it does not build a full-size HiFi-GAN
    vocoder (only ``mel_spectrogram_to_waveform`` uses it). ``device="cpu"`` is passed, which
    ``sample_log`` hands to ``DDIMSampler`` (whose own default is CUDA).
    """
    ddpm = importlib.import_module(f"{package}.latent_diffusion.models.ddpm")
    first = {"target": f"{package}.latent_encoder.autoencoder.AutoencoderKL",
             "params": dict(embed_dim=4, image_key="mel",
                            ddconfig=_ddconfig(mel_bins=16, downsample_time=False, in_channels=1, out_ch=1))}
    cond_stage = {"film_tiny": {"cond_stage_key": "text", "conditioning_key": "film", "target": "torch.nn.Identity"}}
    torch.manual_seed(seed)
    with _replaced(ddpm, "CLAPAudioEmbeddingClassifierFreev2", NoCLAP):
        model = ddpm.LatentDiffusion(
            first_stage_config=first, cond_stage_config=cond_stage,
            unet_config=_unet(f"{package}.latent_diffusion", extra_film_condition_dim=16, context_dim=[None]),
            sampling_rate=16000, timesteps=1000, linear_start=0.0015, linear_end=0.0195, latent_t_size=8,
            latent_f_size=8, channels=4, first_stage_key="fbank", parameterization="eps", scale_factor=1.0,
            device="cpu")
    generator = torch.Generator().manual_seed(seed + 1)
    cond = {"film_tiny": torch.randn(batch, 1, 16, generator=generator)}
    uncond = {"film_tiny": torch.randn(batch, 1, 16, generator=generator)}
    return _finish(model, seed), cond, uncond


def sdkit_model(seed: int = 0, batch: int = 2) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny ``ldm.models.diffusion.ddpm.LatentDiffusion`` (stable-diffusion-sdkit: the SD2 code)
    conditioned by cross-attention on a 3-token, 16-dimensional context (SD2's linear-in-transformer
    UNet), on the CPU, in eval mode, no EMA; and ``(model, cond, uncond)`` context tensors."""
    ddpm = importlib.import_module("ldm.models.diffusion.ddpm")
    first = {"target": "ldm.models.autoencoder.AutoencoderKL",
             "params": dict(embed_dim=4, monitor=None, lossconfig={"target": "torch.nn.Identity"},
                            ddconfig=_ddconfig(in_channels=3, out_ch=3))}
    torch.manual_seed(seed)
    model = ddpm.LatentDiffusion(
        first_stage_config=first, cond_stage_config={"target": "torch.nn.Identity"},
        unet_config=_unet("ldm", context_dim=16, use_linear_in_transformer=True, legacy=False),
        timesteps=1000, linear_start=0.00085, linear_end=0.012, image_size=8, channels=4,
        conditioning_key="crossattn", first_stage_key="jpg", cond_stage_key="txt", parameterization="eps",
        scale_factor=0.18215, use_ema=False)
    generator = torch.Generator().manual_seed(seed + 1)
    cond, uncond = (torch.randn(batch, 3, 16, generator=generator) for _ in range(2))
    return _finish(model, seed), cond, uncond
