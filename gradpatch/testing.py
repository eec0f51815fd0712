"""Tiny, randomly initialised real upstream models, for tests, the demo, notebooks and benchmarks.

Nothing here downloads weights. Each builder imports its upstream package when called.
"""
from __future__ import annotations

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


def audioldm_batch(batch: int = 2, seed: int = 0, size: int = 16) -> dict[str, torch.Tensor]:
    """Synthetic inputs for :func:`audioldm_unet`: latents, timesteps, a FiLM embedding, a target."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, 4, size, size, generator=generator),
        "timesteps": torch.randint(0, 1000, (batch,), generator=generator),
        "y": torch.randn(batch, 16, generator=generator),
        "target": torch.randn(batch, 4, size, size, generator=generator),
    }
