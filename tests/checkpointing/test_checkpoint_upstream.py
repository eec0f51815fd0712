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

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from checkpoint_models import (TARGETS, TOL, Target, assert_grads_equal, build, ck, freeze, install,  # noqa: F401
                               no_checkpoint, require_upstream, step)


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
