"""Tiny, randomly initialised real upstream models, for tests, the demo, notebooks and benchmarks.

Nothing here downloads weights. Each builder imports its upstream package when called.
"""
from __future__ import annotations

from typing import Any, cast

import torch


def reinit_zero_weights(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> torch.nn.Module:
    """Give every all-zero weight tensor small random values.

    Diffusion models zero-initialise output layers (AudioLDM's final conv, DiT's adaLN and ``proj_out``)
    so that training starts from the identity; with those zeros the loss is constant and earlier
    layers get no gradient at all, which makes every gradient comparison vacuous.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.numel() and not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model


AUDIOLDM_TINY = dict(image_size=16, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=1,
                     attention_resolutions=[2], channel_mult=(1, 2), num_head_channels=16,
                     use_spatial_transformer=True, extra_film_condition_dim=16, extra_film_use_concat=True)

#: About 20M parameters: for benchmarks that need more than a toy.
AUDIOLDM_MEDIUM = dict(AUDIOLDM_TINY, model_channels=128, num_res_blocks=2, attention_resolutions=[4, 2],
                       channel_mult=(1, 2, 2), num_head_channels=32)


def audioldm_unet(seed: int = 0, **overrides: object) -> torch.nn.Module:
    """AudioLDM's ``UNetModel`` (PyPI audioldm), tiny unless overridden, zero layers re-initialised."""
    from audioldm.latent_diffusion.openaimodel import UNetModel

    torch.manual_seed(seed)
    return reinit_zero_weights(UNetModel(**{**AUDIOLDM_TINY, **overrides}), seed=seed)


AUDIOLDM_FIRST_STAGE_TINY = dict(
    embed_dim=4, image_key="fbank", subband=1,
    ddconfig=dict(double_z=True, z_channels=4, resolution=32, in_channels=1, out_ch=1, ch=32, ch_mult=(1, 2),
                  num_res_blocks=1, attn_resolutions=[], dropout=0.0))
"""A tiny AudioLDM ``AutoencoderKL`` (32 channels: upstream's GroupNorm needs multiples of 32): 1 x 32 x 32
mels to 4 x 16 x 16 latents, with a tiny HiFi-GAN vocoder (see :func:`audioldm_ldm`)."""


def _tiny_vocoder(config: object, device: object) -> torch.nn.Module:
    """Upstream's ``get_vocoder`` with a small HiFi-GAN config (32 mel bins, 32 channels): the full one
    has 55M parameters and takes ~10 s to build; the vocoder is used only for waveforms."""
    from audioldm import hifigan
    from audioldm.hifigan.utilities import HIFIGAN_16K_64

    tiny = dict(HIFIGAN_16K_64, num_mels=32, upsample_initial_channel=32, resblock_kernel_sizes=[3],
                resblock_dilation_sizes=[[1, 3, 5]])
    vocoder = hifigan.Generator(hifigan.AttrDict(tiny))
    vocoder.eval()
    vocoder.remove_weight_norm()
    return vocoder.to(device)


def audioldm_ldm(seed: int = 0, *, use_ema: bool = True, device: str = "cpu", **unet: object) -> torch.nn.Module:
    """A real AudioLDM ``LatentDiffusion`` (PyPI audioldm), randomly initialised: the tiny UNet of
    :func:`audioldm_unet` (FiLM conditioning, ``c`` of shape ``(batch, 1, 16)``), the tiny first stage
    above, 4 x 16 x 16 latents, 1000-step linear schedule, EMA on by default. The first stage doubles
    as conditioning stage (no CLAP, nothing downloaded); zero-initialised layers are re-initialised.
    The UNet's parameters train; the first stage is frozen (upstream's choice). The vocoder is a small
    HiFi-GAN built by upstream's code from a smaller config (upstream's builder is swapped for the
    construction only)."""
    from audioldm.ldm import LatentDiffusion
    from audioldm.variational_autoencoder import autoencoder

    torch.manual_seed(seed)
    full_vocoder, autoencoder.get_vocoder = autoencoder.get_vocoder, _tiny_vocoder
    try:
        model = LatentDiffusion(
            device=device, first_stage_config={"target": "audioldm.variational_autoencoder.autoencoder.AutoencoderKL",
                                               "params": AUDIOLDM_FIRST_STAGE_TINY},
            cond_stage_config="__is_first_stage__", conditioning_key="film", cond_stage_key="fbank",
            first_stage_key="fbank", scale_factor=1.0, timesteps=1000, linear_start=0.0015, linear_end=0.0195,
            channels=4, latent_t_size=16, latent_f_size=16, use_ema=use_ema, monitor=None,
            unet_config={"target": "audioldm.latent_diffusion.openaimodel.UNetModel",
                         "params": {**AUDIOLDM_TINY, **unet}})
    finally:
        autoencoder.get_vocoder = full_vocoder
    reinit_zero_weights(model.model, seed=seed)
    if use_ema:
        model.model_ema = type(model.model_ema)(model.model)  # the EMA starts from the re-initialised weights
    return model.to(device)


def audioldm_cond(batch: int = 2, seed: int = 1) -> torch.Tensor:
    """A FiLM conditioning for :func:`audioldm_ldm`: ``(batch, 1, 16)``."""
    return torch.randn(batch, 1, 16, generator=torch.Generator().manual_seed(seed))


def audioldm_batch(batch: int = 2, seed: int = 0, size: int = 16) -> dict[str, torch.Tensor]:
    """Synthetic inputs for :func:`audioldm_unet`: latents, timesteps, a FiLM embedding, a target."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, 4, size, size, generator=generator),
        "timesteps": torch.randint(0, 1000, (batch,), generator=generator),
        "y": torch.randn(batch, 16, generator=generator),
        "target": torch.randn(batch, 4, size, size, generator=generator),
    }


def f5_cfm(backbone: str = "DiT", seed: int = 0, **extra: object) -> torch.nn.Module:
    """F5-TTS's ``CFM`` around a tiny ``DiT``, ``UNetT`` or ``MMDiT`` (16 mel bins, 32 text tokens)."""
    from f5_tts.model import CFM, DiT, MMDiT, UNetT

    cls = {"DiT": DiT, "UNetT": UNetT, "MMDiT": MMDiT}[backbone]
    torch.manual_seed(seed)
    kw: dict[str, object] = dict(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, mel_dim=16, text_num_embeds=32)
    if cls is not MMDiT:
        kw["text_dim"] = 16
    net = reinit_zero_weights(cls(**kw, **extra), std=0.05, seed=seed)
    return CFM(transformer=net, mel_spec_kwargs=dict(n_mel_channels=16))


def f5_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A conditioning mel (1 x 8 frames x 16 bins) and text tokens for :func:`f5_cfm`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 8, 16, generator=generator), torch.randint(0, 32, (1, 6), generator=generator)


def stable_diffusion_pipeline(seed: int = 0) -> tuple[object, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny diffusers ``StableDiffusionPipeline`` (8x8 latents, no tokenizer, no safety checker) and
    a pair of (prompt, negative prompt) embeddings to pass as ``prompt_embeds``."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
                                norm_num_groups=4, attention_head_dim=4)
    vae = AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        norm_num_groups=4, sample_size=16)
    text = CLIPTextModel(CLIPTextConfig(bos_token_id=0, eos_token_id=2, pad_token_id=1, hidden_size=16,
                                        intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
                                        vocab_size=100, projection_dim=16))
    for model in (unet, vae, text):
        reinit_zero_weights(cast(torch.nn.Module, model), std=0.05, seed=seed)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=None, unet=unet,
                                   scheduler=DDIMScheduler(clip_sample=False, set_alpha_to_one=False, steps_offset=1),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    cast(Any, pipe).set_progress_bar_config(disable=True)  # DiffusionPipeline's (hidden from mypy)
    with torch.no_grad():
        embeds = text(torch.randint(3, 100, (1, 6)))[0], text(torch.randint(3, 100, (1, 6)))[0]
    return pipe, embeds


def add_lora(unet: torch.nn.Module, rank: int = 2) -> list[torch.nn.Parameter]:
    """Freeze a diffusers UNet and add a randomly initialised peft LoRA on its attention projections;
    return the LoRA parameters (the only ones that train)."""
    from peft import LoraConfig

    unet.requires_grad_(False)
    cast(Any, unet).add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                                           target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    params = [p for n, p in unet.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    return params
