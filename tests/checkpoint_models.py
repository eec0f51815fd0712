"""Models and measurements shared by the checkpoint tests (``tests/checkpointing``).

The real upstream UNets as the engine will patch them (:data:`TARGETS`: AudioLDM, AudioLDM2, ldm,
guided-diffusion), with ``install`` putting the fix, upstream or no checkpoint at the names upstream
looks up, ``step`` returning every gradient and ``assert_grads_equal`` comparing them; and the
``budget:<size>`` tests' chain of checkpointed blocks with its allocator measurement (``extra``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile
from torch.testing import assert_close

import gradpatch

from gradpatch.checkpointing import checkpoint as ck
from gradpatch.checkpointing.checkpoint import checkpoint

torch.set_num_threads(1)
TOL = dict(rtol=1e-5, atol=1e-6)
TINY = dict(image_size=16, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=1,
            attention_resolutions=[2], channel_mult=(1, 2), num_head_channels=16,
            use_checkpoint=True)


@dataclass
class Target:
    name: str
    util: str  # module defining checkpoint / CheckpointFunction
    users: tuple[str, ...]  # modules that bound the name `checkpoint`
    build: Callable[[float], nn.Module]
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    attention: str  # parameter-name fragment of an attention layer
    frozen_fails: bool = True  # upstream raises with frozen parameters (V1/V2)


def _audioldm(dropout: float) -> nn.Module:
    from audioldm.latent_diffusion.openaimodel import UNetModel
    return UNetModel(**TINY, use_spatial_transformer=True, extra_film_condition_dim=16,
                     extra_film_use_concat=True, dropout=dropout)


def _audioldm2(dropout: float) -> nn.Module:
    from audioldm2.latent_diffusion.modules.diffusionmodules.openaimodel import UNetModel
    return UNetModel(**TINY, context_dim=[16], dropout=dropout)


def _ldm(dropout: float) -> nn.Module:
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    return UNetModel(**TINY, dropout=dropout)


def _guided(dropout: float) -> nn.Module:
    from guided_diffusion.unet import UNetModel
    return UNetModel(**TINY, dropout=dropout)


def _aux(batch: int, *shape: int) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(7))


TARGETS = {t.name: t for t in [
    Target("audioldm", "audioldm.latent_diffusion.util",
           ("audioldm.latent_diffusion.attention", "audioldm.latent_diffusion.openaimodel"),
           _audioldm, lambda m, x: m(x, torch.tensor([3, 500]), y=_aux(len(x), 16)), "attn2."),
    # AudioLDM2 passes (x, context, mask) and mask is None here: upstream fails even unfrozen.
    Target("audioldm2", "audioldm2.latent_diffusion.modules.diffusionmodules.util",
           ("audioldm2.latent_diffusion.modules.attention",
            "audioldm2.latent_diffusion.modules.diffusionmodules.openaimodel"),
           _audioldm2, lambda m, x: m(x, torch.tensor([3, 500]), context_list=[_aux(len(x), 5, 16)],
                                      context_attn_mask_list=[None]), "attn2."),
    Target("ldm", "ldm.modules.diffusionmodules.util",
           ("ldm.modules.attention", "ldm.modules.diffusionmodules.openaimodel"),
           _ldm, lambda m, x: m(x, torch.tensor([3, 500])), ".qkv."),
    Target("guided", "guided_diffusion.nn", ("guided_diffusion.unet",),
           _guided, lambda m, x: m(x, torch.tensor([3, 500])), ".qkv.", frozen_fails=False),
]}


def no_checkpoint(func, inputs, params=(), flag=True):
    return func(*inputs)


def install(mp: pytest.MonkeyPatch, target: Target, impl: str) -> None:
    """impl: "upstream" (leave as is), "fixed" (what the engine does) or "none" (the reference)."""
    if impl == "upstream":
        return
    for name in target.users:
        mp.setattr(importlib.import_module(name), "checkpoint",
                   ck.checkpoint if impl == "fixed" else no_checkpoint)
    if impl == "fixed":
        util = importlib.import_module(target.util)
        mp.setattr(util, "CheckpointFunction", ck.CheckpointFunction)


def require_upstream(target: Target) -> None:
    util = importlib.import_module(target.util)
    users = [importlib.import_module(name) for name in target.users]
    if util.CheckpointFunction.__module__ != target.util or any(
            user.checkpoint is not util.checkpoint for user in users):
        pytest.skip("gradpatch active in this process (GRADPATCH set): upstream already fixed")


def build(target: Target, dropout: float = 0.0) -> nn.Module:
    require_upstream(target)
    torch.manual_seed(0)
    model = target.build(dropout)
    for p in model.parameters():  # zero-initialised output layers would block every gradient
        if p.dim() > 1 and not p.any():
            nn.init.normal_(p, std=0.02)
    return model


def step(model: nn.Module, target: Target, x: torch.Tensor, seed: int = 1) -> dict:
    """One training step; returns the gradient of every parameter (None if it got none) and of x."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    target.call(model, x).square().mean().backward()
    out = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    out["<input>"] = x.grad
    return out


def assert_grads_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        if w is None:
            assert got[name] is None, f"{name} should get no gradient"
        else:
            assert got[name] is not None, f"{name} got no gradient"
            assert_close(got[name], w, **TOL, msg=lambda m: f"{name}: {m}")


def freeze(model: nn.Module, target: Target, scenario: str) -> None:
    if scenario == "cross-attention-only":
        for n, p in model.named_parameters():
            p.requires_grad_(target.attention in n)
    elif scenario == "norms-frozen":
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.GroupNorm)):
                m.requires_grad_(False)
    elif scenario == "encoder-frozen":
        model.input_blocks.requires_grad_(False)
    elif scenario == "all-frozen":
        model.requires_grad_(False)


def allocated_after_forward(model, x) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = TARGETS["audioldm"].call(model, x)
    del out
    return sum(e.self_cpu_memory_usage for e in prof.events())


# --- budget:<size>: a chain of checkpointed blocks, memory measured at the allocator --------------

class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return checkpoint(self._forward, (x,), self.parameters(), True)

    def _forward(self, x):
        return self.drop(torch.tanh(self.linear(x))).sigmoid()


def chain(n: int = 8, width: int = 128) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(width) for _ in range(n)])


def extra(model, x, policy: str, autocast: bool = False) -> int:
    """Bytes still allocated after the forward and the loss (allocator events; autocast's cached
    weight casts freed)."""
    with gradpatch.checkpoint_policy_scope(policy), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x).mean()  # saves nothing: the last output is held only by its own graph
    del loss
    return sum(e.self_cpu_memory_usage for e in prof.events())
