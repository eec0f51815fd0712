"""The fixed checkpoint inside the real upstream UNets, as the engine will install it.

Targets (all installed, real code): AudioLDM and AudioLDM2 (V1), ldm from stable-diffusion-sdkit
(V2), guided-diffusion-sdk (V3, whose own fix already handles frozen parameters). The fix is
installed by monkeypatching the names upstream looks up at call time (``checkpoint`` in the modules
that import it, ``CheckpointFunction`` in the module defining it); the reference is the same model
with ``checkpoint = lambda f, i, p, flag: f(*i)``. Each scenario first shows upstream failing (an
exception or wrong gradients), then the fix matching the reference for every parameter at rtol=1e-5.

ldm's ``UNetModel`` imports omegaconf (not installed) when given a ``context_dim``, so its UNet runs
without cross-attention and its ``SpatialTransformer`` is tested on its own.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from gradpatch.checkpointing import checkpoint as ck

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


@pytest.mark.parametrize("scenario", ["cross-attention-only", "norms-frozen", "encoder-frozen",
                                      "all-frozen"])
@pytest.mark.parametrize("name", TARGETS)
def test_frozen_subsets(name, scenario, monkeypatch):
    target = TARGETS[name]
    model = build(target)
    freeze(model, target, scenario)
    x = torch.randn(2, 4, 16, 16, requires_grad=scenario == "all-frozen")
    with monkeypatch.context() as mp:
        install(mp, target, "none")
        want = step(model, target, x)
    assert any(g is not None for g in want.values())
    if target.frozen_fails:
        with pytest.raises((RuntimeError, AttributeError), match="does not require grad|NoneType"):
            step(model, target, x)
    with monkeypatch.context() as mp:
        install(mp, target, "fixed")
        assert_grads_equal(step(model, target, x), want)


@pytest.mark.parametrize("name", ["audioldm", "guided"])
def test_dropout_same_seed(name, monkeypatch):
    """Dropout inside checkpointed ResBlocks: upstream recomputes with other masks (V1 and V3)."""
    target = TARGETS[name]
    model = build(target, dropout=0.3)
    x = torch.randn(2, 4, 16, 16)
    with monkeypatch.context() as mp:
        install(mp, target, "none")
        want = step(model, target, x)
    upstream = step(model, target, x)
    assert not all(torch.allclose(upstream[n], want[n], rtol=1e-3)
                   for n in want if want[n] is not None)
    with monkeypatch.context() as mp:
        install(mp, target, "fixed")
        assert_grads_equal(step(model, target, x), want)


def input_gradient_penalty(model: nn.Module, target: Target) -> dict:
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    model.zero_grad(set_to_none=True)
    loss = target.call(model, x).square().mean()
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + 10 * gx.square().sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_double_backward_guided(monkeypatch):
    """V3 (frozen parameters fine) still drops second-order terms: a gradient penalty is wrong."""
    target = TARGETS["guided"]
    model = build(target)
    with monkeypatch.context() as mp:
        install(mp, target, "none")
        want = input_gradient_penalty(model, target)
    upstream = input_gradient_penalty(model, target)
    assert not all(torch.allclose(upstream[n], want[n], rtol=1e-3) for n in want)
    with monkeypatch.context() as mp:
        install(mp, target, "fixed")
        assert_grads_equal(input_gradient_penalty(model, target), want)


def test_ldm_spatial_transformer_without_context(monkeypatch):
    """V2's BasicTransformerBlock passes (x, None) when there is no context: upstream breaks."""
    from ldm.modules.attention import SpatialTransformer

    target = TARGETS["ldm"]
    require_upstream(target)
    torch.manual_seed(0)
    block = SpatialTransformer(32, 2, 16, context_dim=[None], use_checkpoint=True)
    nn.init.normal_(block.proj_out.weight, std=0.02)
    block.norm.requires_grad_(False)
    x = torch.randn(2, 32, 4, 4)

    def grads() -> list:
        block.zero_grad(set_to_none=True)
        block(x).square().mean().backward()
        return [p.grad for p in block.parameters() if p.requires_grad]

    with monkeypatch.context() as mp:
        install(mp, target, "none")
        want = grads()
    with pytest.raises(AttributeError, match="NoneType"):
        grads()
    with monkeypatch.context() as mp:
        install(mp, target, "fixed")
        for g, w in zip(grads(), want):
            assert_close(g, w, **TOL)


def maml_step(model: nn.Module, target: Target, log_lr: nn.Parameter) -> dict:
    """Inner step on the cross-attention weights with a learnable learning rate; outer on all."""
    model.zero_grad(set_to_none=True)
    log_lr.grad = None
    params = dict(model.named_parameters())
    inner = [n for n in params if target.attention in n]
    support = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    query = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    loss = target.call(model, support).square().mean()
    grads = torch.autograd.grad(loss, [params[n] for n in inner], create_graph=True)
    fast = {n: params[n] - log_lr.exp() * g for n, g in zip(inner, grads)}
    outer = target.call(lambda *a, **k: torch.func.functional_call(model, fast, a, k), query)
    outer.square().mean().backward()
    out = {n: p.grad for n, p in model.named_parameters()}
    out["log_lr"] = log_lr.grad
    return out


def test_maml_learnable_inner_lr(monkeypatch):
    target = TARGETS["audioldm"]
    model = build(target)
    log_lr = nn.Parameter(torch.tensor(2.0))  # large steps: fast and slow weights differ clearly
    with monkeypatch.context() as mp:
        install(mp, target, "none")
        want = maml_step(model, target, log_lr)
    # Upstream's outer backward recomputes after functional_call has put the slow weights back: the
    # fast weights (and the learning rate) get no gradient at all.
    upstream = maml_step(model, target, log_lr)
    assert upstream["log_lr"] is None and want["log_lr"] is not None
    with monkeypatch.context() as mp:
        install(mp, target, "fixed")
        got = maml_step(model, target, log_lr)
    assert_grads_equal(got, want)
    # The learning rate's gradient is ~1e-6, below the absolute tolerance: check it relatively. It
    # is off by 2e-3 if the outer backward recomputes with the slow weights functional_call put
    # back.
    assert_close(got["log_lr"], want["log_lr"], rtol=1e-4, atol=0)
