"""Copy on write's mode taken off the step's later evaluations (``CopyOnWrite.unwatched``): a network
whose first recorded evaluations write nothing saved runs its later ones without the mode; one whose
writes need copy on write keeps it; a write into what an earlier evaluation saved keeps it too; a write
that appears only later, unseen, fails in backward instead of giving a wrong gradient."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parents[1]))
import foreign_samplers as fs  # noqa: E402

import gradpatch  # noqa: E402
from gradpatch.sampling.generic.call import WATCHED_EVALUATIONS  # noqa: E402
from gradpatch.sampling.generic.copy_on_write import CopyOnWrite  # noqa: E402
from support import assert_grads_equal  # noqa: E402

STEPS = 5


def grads(loss, *tensors):
    return list(torch.autograd.grad(loss, tensors, allow_unused=True))


def watched() -> bool:
    return any(isinstance(mode, CopyOnWrite) for mode in torch.overrides._get_current_function_mode_stack())


class Net(torch.nn.Module):
    """``sigmoid`` saves its output; ``scale_from`` on, the output is scaled in place (copy on write keeps
    what sigmoid saved)."""

    def __init__(self, scale_from: int | None = None) -> None:
        super().__init__()
        self.lin, self.scale_from, self.calls, self.seen = torch.nn.Linear(4, 4), scale_from, 0, []

    def forward(self, x):
        self.seen.append(watched())
        h = self.lin(x).sigmoid()
        if self.scale_from is not None and self.calls >= self.scale_from:
            h.mul_(0.5)
        self.calls += 1
        return h


def reference(net: Net, x):
    for i in range(STEPS):
        h = net.lin(x).sigmoid()
        if net.scale_from is not None and i >= net.scale_from:
            h = h * 0.5
        x = x + h
    return x


@torch.no_grad()
def euler(net, x):
    for _ in range(STEPS):
        x += net(x)
    return x


def test_a_network_that_writes_nothing_saved_runs_its_later_evaluations_unwatched():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 4, requires_grad=True)
    out = gradpatch.differentiable(euler, step="net")(net, x.clone())
    assert net.seen == [True] * WATCHED_EVALUATIONS + [False] * (STEPS - WATCHED_EVALUATIONS)
    params = [x, *net.parameters()]
    assert_grads_equal(grads(out.square().sum(), *params), grads(reference(net, x).square().sum(), *params))


def test_a_network_whose_writes_need_copy_on_write_stays_watched():
    torch.manual_seed(0)
    net, x = Net(scale_from=0), torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="inplace"):  # upstream with grad on
        euler.__wrapped__(net, x.clone()).sum().backward()
    net.seen.clear()
    out = gradpatch.differentiable(euler, step="net")(net, x.clone())
    assert net.seen == [True] * STEPS
    params = [x, *net.parameters()]
    assert_grads_equal(grads(out.square().sum(), *params), grads(reference(net, x).square().sum(), *params))


def test_a_step_refilling_what_the_previous_evaluation_saved_stays_watched():
    """The step is a method that refills a buffer its network saved in the previous evaluation: nothing
    is saved at the first refill, the second one needs a copy."""
    model = fs.Buffers()
    torch.manual_seed(0)
    noise, mu = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    seen = []

    class Refilling(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.buf = model.estimator, torch.zeros(2, 4)

        def forward(self, x, mu, t):
            seen.append(watched())
            self.buf[:] = x
            return self.net(self.buf, mu, t)  # its first Linear saves buf

    step = Refilling()

    @torch.no_grad()
    def sampler(x, mu):
        for i in range(STEPS):
            x += step(x, mu, i / STEPS)
        return x

    out = gradpatch.differentiable(sampler, step=step)(noise.clone(), mu)
    assert seen == [True] * STEPS
    want = noise
    for i in range(STEPS):
        want = want + model.estimator(want, mu, i / STEPS)
    params = [noise, mu, *model.parameters()]
    assert_grads_equal(grads(out.square().sum(), *params), grads(want.square().sum(), *params))


def test_a_write_unseen_in_a_later_evaluation_fails_in_backward():
    torch.manual_seed(0)
    net, x = Net(scale_from=WATCHED_EVALUATIONS + 1), torch.randn(2, 4, requires_grad=True)
    out = gradpatch.differentiable(euler, step="net")(net, x.clone())
    assert net.seen[-1] is False
    with pytest.raises(RuntimeError, match="modified in place by a write gradpatch did not see"):
        out.sum().backward()


@pytest.mark.parametrize("k", [2, STEPS - 1])
def test_grad_steps_evaluations_outside_the_graph_are_not_judged(k):
    """Evaluations before the last ``k`` record nothing: the first two recorded ones decide (the second
    one writes into what it saved)."""
    torch.manual_seed(0)
    first = STEPS - k
    net, x = Net(scale_from=first + 1), torch.randn(2, 4, requires_grad=True)
    out = gradpatch.differentiable(euler, step="net", steps=lambda arguments: STEPS)(net, x.clone(), grad_steps=k)
    assert net.seen[first:] == [True] * k
    with torch.no_grad():
        want = x.clone()
        for i in range(first):
            want = want + net.lin(want).sigmoid()
    for i in range(first, STEPS):
        want = want + net.lin(want).sigmoid() * (0.5 if i > first else 1.0)
    params = list(net.parameters())
    assert_grads_equal(grads(out.square().sum(), *params), grads(want.square().sum(), *params))
