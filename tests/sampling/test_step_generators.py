"""``checkpoint_steps``: the ``torch.Generator`` objects a denoiser evaluation reaches through its modules
(``gradpatch.sampling.steps.generators``) are replayed in its recompute, also where the call's notes of
which module attributes hold them are read at later evaluations: a generator on a submodule, one
reassigned between two evaluations of the same call; and where an evaluation reads a tensor with history
it was not given (a conditioning computed with grad outside), which the fixed checkpoint's node cannot take
after running it: the call's first evaluation keeps the graph it ran, a later one runs again on the hook
path drawing the same numbers (global RNG and generator). Held
to the loop written out by hand (float64)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradpatch
from support import assert_grads_close, weighted_grads

N = 4


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.generator = torch.Generator().manual_seed(5)
        self.cond: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, read: bool = True) -> torch.Tensor:
        mask = (torch.rand(x.shape, generator=self.generator, dtype=x.dtype) > 0.3).to(x.dtype)
        if read and self.cond is not None:  # read, not given: the node cannot take the evaluation
            x = x + self.cond * torch.rand(x.shape, dtype=x.dtype)
        return torch.tanh(self.lin(x)) * mask


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Inner()))

    def forward(self, x: torch.Tensor, read: bool = True) -> torch.Tensor:
        return self.body[1][0](self.body[0](x), read)


class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Outer()

    def inner(self) -> Inner:
        return self.net.body[1][0]

    @torch.no_grad()
    def sample(self, x: torch.Tensor, reseed: bool, late: bool = False) -> torch.Tensor:
        for i in range(N):
            if reseed and i == 2:  # a new generator object on the same attribute, mid-call
                self.inner().generator = torch.Generator().manual_seed(11)
            x = x + self.net(x, not late or i >= 1) / N  # late: the first evaluation reads no cond
        return x


@pytest.mark.parametrize("escape", [None, "first", "later"],
                         ids=["node", "first-reads-a-tensor-not-given", "later-reads-a-tensor-not-given"])
@pytest.mark.parametrize("reseed", [False, True], ids=["same-generator", "generator-reassigned"])
@pytest.mark.parametrize("checkpoint_steps", [True, "budget:1"], ids=["recompute", "budget"])
def test_a_submodule_generator_is_replayed_in_every_recompute(reseed, checkpoint_steps, escape):
    """Before, with the generator reassigned mid-call: the recomputes of the evaluations before that drew
    from the new generator (a gradient 0.069 off, 77% relative); the forward was right."""
    torch.manual_seed(0)
    model = Sampler().double()
    encoder = nn.Linear(3, 4).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    params = [x, *model.parameters(), *encoder.parameters()]

    def start(seed: int) -> None:
        model.inner().generator = torch.Generator().manual_seed(5)
        model.inner().cond = encoder(torch.ones(3, dtype=torch.float64)) if escape else None
        torch.manual_seed(seed)

    late = escape == "later"  # the first evaluation reads no cond: a later one is the first the node cannot take
    start(3)
    out = gradpatch.differentiable(model.sample, step="net")(x, reseed, late, checkpoint_steps=checkpoint_steps)
    got = weighted_grads(out, params)

    start(3)
    want = x
    for i in range(N):
        if reseed and i == 2:
            model.inner().generator = torch.Generator().manual_seed(11)
        want = want + model.net(want, not late or i >= 1) / N
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert_grads_close(got, weighted_grads(want, params), rtol=1e-9)
