"""The flow-matching samplers ``differentiable_overhead.py`` times (``--flows``), each with upstream's loop
copied by hand with its blockers removed (no decorator, the CFG batch built with ``torch.cat``): the model
as upstream builds it (random weights, no downloads) and the inputs of one call.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def s3gen_reference(model: Any, n: int, mu: Any, mask: Any, spks: Any, cond: Any) -> Any:
    """``CausalConditionalCFM.forward`` + ``ConditionalCFM.solve_euler`` (chatterbox-tts 0.1.7), out of place."""
    x, rate, zero = torch.randn_like(mu), model.inference_cfg_rate, torch.zeros_like
    t_span = 1 - torch.cos(torch.linspace(0, 1, n + 1) * 0.5 * torch.pi)
    for t, r in zip(t_span[:-1], t_span[1:]):
        t, r = t[None], r[None]
        out = model.estimator.forward(x=torch.cat([x, x]), mask=torch.cat([mask, mask]), mu=torch.cat([mu, zero(mu)]),
                                      t=torch.cat([t, t]), spks=torch.cat([spks, zero(spks)]),
                                      cond=torch.cat([cond, zero(cond)]), r=None)
        v, v_uncond = out.chunk(2)
        x = x + (r - t) * ((1 + rate) * v - rate * v_uncond)
    return x


def matcha_reference(model: Any, n: int, mu: Any, mask: Any) -> Any:
    """``BASECFM.forward`` + ``BASECFM.solve_euler`` (matcha-tts 0.0.7.2), without the decorator."""
    x = torch.randn_like(mu)
    t_span = torch.linspace(0, 1, n + 1)
    t, dt = t_span[0], t_span[1] - t_span[0]
    for step in range(1, n + 1):
        x = x + dt * model.estimator(x, mask, mu, t, None, None)
        t = t + dt
        if step < n:
            dt = t_span[step + 1] - t
    return x


def s3gen_full(frames: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Chatterbox's S3Gen decoder as ``S3Token2Mel`` builds it (chatterbox-tts 0.1.7), random weights."""
    from chatterbox.models.s3gen.configs import CFM_PARAMS
    from chatterbox.models.s3gen.decoder import ConditionalDecoder
    from chatterbox.models.s3gen.flow_matching import CausalConditionalCFM

    torch.manual_seed(0)
    estimator = ConditionalDecoder(in_channels=320, out_channels=80, causal=True, channels=[256], dropout=0.0,
                                   attention_head_dim=64, n_blocks=4, num_mid_blocks=12, num_heads=8, act_fn="gelu")
    model = CausalConditionalCFM(in_channels=240, cfm_params=CFM_PARAMS, n_spks=1, spk_emb_dim=80,
                                 estimator=estimator).eval()
    g = torch.Generator().manual_seed(1)
    kw = dict(mu=torch.randn(1, 80, frames, generator=g), mask=torch.ones(1, 1, frames),
              spks=torch.randn(1, 80, generator=g), cond=torch.randn(1, 80, frames, generator=g))
    return model, kw


def matcha_full(frames: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Matcha-TTS's ``CFM`` as its published LJSpeech recipe builds it (decoder ``channels=[256, 256]``,
    80 mel channels, one speaker), random weights; ``frames`` a multiple of 4 (two downsamplings)."""
    from types import SimpleNamespace

    from matcha.models.components.flow_matching import CFM

    torch.manual_seed(0)
    decoder = dict(channels=[256, 256], dropout=0.05, attention_head_dim=64, n_blocks=1, num_mid_blocks=2,
                   num_heads=2, act_fn="snakebeta")
    model = CFM(160, 80, SimpleNamespace(solver="euler", sigma_min=1e-4), decoder, n_spks=1, spk_emb_dim=64).eval()
    g = torch.Generator().manual_seed(1)
    return model, dict(mu=torch.randn(1, 80, frames, generator=g), mask=torch.ones(1, 1, frames))


def flow_case(name: str, frames: int) -> tuple[str, torch.nn.Module, dict[str, Any], Callable[..., Any], tuple]:
    """``(upstream, model, kw, reference, inputs that require grad)``."""
    from gradpatch import testing_flow

    if name == "s3gen":
        return ("chatterbox", *s3gen_full(frames), s3gen_reference, ("mu", "spks", "cond"))
    if name == "s3gen-tiny":
        return ("chatterbox", *testing_flow.chatterbox_cfm(frames=frames), s3gen_reference, ("mu", "spks", "cond"))
    if name == "matcha":
        return ("matcha", *matcha_full(4 * (frames // 4)), matcha_reference, ("mu",))
    if name == "matcha-tiny":
        return ("matcha", *testing_flow.matcha_cfm(), matcha_reference, ("mu",))
    raise SystemExit(f"unknown flow {name!r}")
