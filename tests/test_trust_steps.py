"""``grad_steps`` and ``checkpoint_steps`` of :func:`gradpatch.differentiable` held to DRaFT-K by hand: the
same loop written out with grad, the latent detached at the top of the loop before step N-K (float64)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import gradpatch  # noqa: E402
from conftest import assert_grads_close, weighted_grads  # noqa: E402

N = 4


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, generator=g, dtype=torch.float64).requires_grad_(),
            torch.randn(2, 4, generator=g, dtype=torch.float64).requires_grad_())


class Velocity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x) + mu)


# --- checkpoint_steps: an evaluation that leaves the fast path runs once (issue 28, item 10) -------------


class Noisy(nn.Module):
    """A step that reads a closed-over tensor with history (the fast path's node cannot take it) and draws
    a dropout-like mask from its own ``torch.Generator``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cond: torch.Tensor | None = None
        self.generator = torch.Generator().manual_seed(5)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        mask = (torch.rand(x.shape, generator=self.generator, dtype=x.dtype) > 0.3).to(x.dtype)
        return torch.tanh(self.lin(x) + self.cond) * mask


class NoisySampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Noisy()

    @torch.no_grad()
    def sample(self, x: torch.Tensor, steps: int = N) -> torch.Tensor:
        for _ in range(steps):
            x = x + self.net(x) / steps
        return x


@pytest.mark.parametrize("escapes", [True, False], ids=["hook-path", "fast-path"])
def test_an_evaluation_leaving_the_fast_path_runs_once_and_draws_its_generator_once(escapes):
    """Before: the first evaluation ran twice (5 calls for 4 steps), the seeded sample 0.248 off the loop by
    hand; and every recompute drew the step's own generator again (a gradient 0.12 off)."""
    torch.manual_seed(0)
    model = NoisySampler().double()
    x, mu = _inputs()
    params = [x, mu, *model.parameters()]

    cond = (lambda: mu * 2.0) if escapes else (lambda: mu)  # a closed-over tensor with history: the hook path
    model.net.cond, model.net.calls = cond(), 0
    model.net.generator.manual_seed(5)
    out = gradpatch.differentiable(model.sample, step="net")(x, checkpoint_steps=True)
    calls = model.net.calls
    got = weighted_grads(out, params)

    model.net.cond = cond()
    model.net.generator.manual_seed(5)
    want = x
    for _ in range(N):
        want = want + model.net(want) / N
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert calls == N
    assert_grads_close(got, weighted_grads(want, params), rtol=1e-9)
