"""torch.func transforms through the fixed checkpoints, against plain autograd without checkpointing.

torch's own checkpoint refuses them ("don't yet support saved tensor hooks"), and a custom
``autograd.Function`` without ``setup_context`` too. Under an active transform gradpatch's
``checkpoint``, ``mixed_checkpoint`` and ``non_reentrant`` wrapper run the block directly, so each
transform gives its exact result (without the memory saving). Float64 throughout.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.func import functional_call, grad, hessian, jacrev, jvp, vjp, vmap
from torch.testing import assert_close

from gradpatch import settings
from gradpatch.checkpointing import checkpoint as ck

torch.set_num_threads(1)
TOL = dict(rtol=1e-10, atol=1e-12)


class Block(nn.Module):
    """A residual MLP block calling a checkpoint the way upstream code does."""

    def __init__(self, dim: int = 6, impl: str = "fixed") -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "fixed":
            return ck.checkpoint(self._forward, (x,), self.parameters(), True)
        if self.impl == "mixed":
            return ck.mixed_checkpoint(self._forward, {"x": x}, self.parameters(), True)
        if self.impl == "torch-bound":  # torch's checkpoint as gradpatch binds it in upstream modules
            return ck.non_reentrant(torch.utils.checkpoint.checkpoint)(self._forward, x, preserve_rng_state=True)
        if self.impl == "torch":
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def make(impl: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Block(impl=impl), Block(impl=impl), nn.Linear(6, 1)).double()
    model[1].fc1.weight.requires_grad_(False)  # a frozen parameter inside a checkpointed block
    return model


def set_impl(model: nn.Module, impl: str) -> None:
    for m in model.modules():
        if isinstance(m, Block):
            m.impl = impl


IMPLS = ["fixed", "mixed", "torch-bound"]
data = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
target = torch.randn(5, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def per_sample_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def loss(p, x, y):
        return F.mse_loss(functional_call(model, p, (x[None],)), y[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, data, target)


def test_torchs_own_checkpoint_refuses_the_transforms():
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        per_sample_grads(make("torch"))


@pytest.mark.parametrize("impl", IMPLS)
def test_per_sample_gradients_vmap_grad(impl):
    model = make("plain")
    want = {n: torch.stack([torch.autograd.grad(F.mse_loss(model(x[None]), y[None]), p)[0]
                            for x, y in zip(data, target)])
            for n, p in model.named_parameters() if p.requires_grad}
    set_impl(model, impl)
    got = per_sample_grads(model)
    assert got.keys() == want.keys() and len(want) == 15  # the frozen weight is left out
    for name in want:
        assert_close(got[name], want[name], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_jacrev_hessian_vjp_jvp_with_respect_to_inputs(impl):
    model = make("plain")
    x = data[:2].clone()
    ones = torch.ones(2, 1, dtype=torch.float64)
    want_jac = torch.autograd.functional.jacobian(model, x)
    want_hess = torch.autograd.functional.hessian(lambda v: model(v).square().sum(), x)
    want_vjp = torch.autograd.functional.vjp(model, x, ones)[1]
    want_jvp = torch.autograd.functional.jvp(model, x, x)[1]
    set_impl(model, impl)
    assert_close(jacrev(model)(x), want_jac, **TOL)
    assert_close(hessian(lambda v: model(v).square().sum())(x), want_hess, **TOL)
    assert_close(vjp(model, x)[1](ones)[0], want_vjp, **TOL)
    assert_close(jvp(model, (x,), (x,))[1], want_jvp, **TOL)


def maml(model: nn.Module, log_lr: nn.Parameter) -> dict[str, torch.Tensor]:
    """MAML: an inner step by torch.func.grad over functional_call, the outer one by autograd."""
    model.zero_grad(set_to_none=True)
    log_lr.grad = None
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def inner(p):
        return F.mse_loss(functional_call(model, p, (data[:3],)), target[:3])

    g = grad(inner)(params)
    fast = {n: p - log_lr.exp() * g[n] for n, p in params.items()}
    F.mse_loss(functional_call(model, fast, (data[3:],)), target[3:]).backward()
    return {**{n: p.grad.clone() for n, p in params.items()}, "log_lr": log_lr.grad.clone()}


# Not "torch-bound": torch's non-reentrant checkpoint, and so the wrapper, recomputes the outer step
# with the parameters functional_call has put back by then (0.19 off here, without any transform).
@pytest.mark.parametrize("impl", ["fixed", "mixed"])
def test_maml_with_functional_call_and_grad(impl):
    model = make("plain")
    log_lr = nn.Parameter(torch.tensor(-1.0, dtype=torch.float64))
    want = maml(model, log_lr)
    set_impl(model, impl)
    got = maml(model, log_lr)
    for name in want:
        assert_close(got[name], want[name], **TOL)
    # The checkpoint still recomputes outside the transform (the outer step's forward).
    assert model[1].fc1.weight.grad is None


def test_budget_policy_and_a_transform_after_ordinary_training():
    model = make("fixed")
    F.mse_loss(model(data), target).backward()  # the fast path first, as in training
    want = per_sample_grads(make("plain"))
    with settings.checkpoint_policy_scope("budget:1MiB"):
        got = per_sample_grads(model)
    for name in want:
        assert_close(got[name], want[name], **TOL)


def test_outside_transforms_the_checkpoint_still_recomputes():
    model = make("fixed")
    calls = []
    model[1].register_forward_pre_hook(lambda *_: calls.append(1))
    model[1].fc2.register_forward_pre_hook(lambda *_: calls.append(2))
    F.mse_loss(model(data), target).backward()
    assert calls == [1, 2, 2]  # forward, then the recompute in backward
    calls.clear()
    per_sample_grads(model)
    assert calls == [1, 2]  # under vmap(grad): once, no recompute
