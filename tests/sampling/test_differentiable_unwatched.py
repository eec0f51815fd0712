"""Copy on write taken off the step's later evaluations (``gradpatch.sampling.generic.unwatched``): a
network whose first recorded evaluations write nothing saved runs its later ones without the mode, and
without the pack hook while the call has needed no copy; one whose writes need copy on write keeps
both; a sampler refilling what an evaluation saved keeps the pack hook; the caller's saved-tensor hooks
still get every tensor; a write that appears only later, unseen, fails in backward instead of giving a
wrong gradient."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parents[1]))
import foreign_samplers as fs  # noqa: E402

import gradpatch  # noqa: E402
from gradpatch.checkpointing.compat import top_saved_tensors_hooks  # noqa: E402
from gradpatch.sampling.generic.call import WATCHED_EVALUATIONS  # noqa: E402
from gradpatch.sampling.generic.copy_on_write import CopyOnWrite  # noqa: E402
from support import assert_grads_equal  # noqa: E402

STEPS = 5


def grads(loss, *tensors):
    return list(torch.autograd.grad(loss, tensors, allow_unused=True))


def watched() -> bool:
    return any(isinstance(mode, CopyOnWrite) for mode in torch.overrides._get_current_function_mode_stack())


def packed_by_copy_on_write() -> bool:
    top = top_saved_tensors_hooks()
    return top is not None and str(getattr(top[1], "__module__", "")).startswith("gradpatch.sampling.generic")


READABLE_HOOKS = hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")  # torch 2.2 on


class Net(torch.nn.Module):
    """``sigmoid`` saves its output; ``scale_from`` on, the output is scaled in place (copy on write keeps
    what sigmoid saved)."""

    def __init__(self, scale_from: int | None = None) -> None:
        super().__init__()
        self.lin, self.scale_from, self.calls, self.seen, self.hooked = torch.nn.Linear(4, 4), scale_from, 0, [], []

    def forward(self, x):
        self.seen.append(watched())
        self.hooked.append(packed_by_copy_on_write())
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
        x += net(x)  # writes what the Linear saved in the step before: copy on write acts at every step
    return x


@torch.no_grad()
def euler_out_of_place(net, x):
    for _ in range(STEPS):
        x = x + net(x)
    return x


def test_a_network_that_writes_nothing_saved_runs_its_later_evaluations_unwatched():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 4, requires_grad=True)
    out = gradpatch.differentiable(euler, step="net")(net, x.clone())
    assert net.seen == [True] * WATCHED_EVALUATIONS + [False] * (STEPS - WATCHED_EVALUATIONS)
    assert net.hooked == [READABLE_HOOKS] * STEPS  # the sampler's `x +=` needs the copies: packed throughout
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


@pytest.mark.parametrize("outer", [False, True])
def test_a_call_that_needs_no_copy_leaves_the_later_evaluations_to_torch(outer):
    """Nothing written after being saved: the later evaluations run without the pack hook too; under
    the caller's ``save_on_cpu`` they save through it, as without gradpatch."""
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 4, requires_grad=True)
    packed = []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if outer else contextlib.nullcontext()
    with hooks:
        out = gradpatch.differentiable(euler_out_of_place, step="net")(net, x.clone())
    later = STEPS - WATCHED_EVALUATIONS
    assert net.seen == [True] * WATCHED_EVALUATIONS + [False] * later
    if READABLE_HOOKS:  # torch 2.1 cannot tell which hooks are innermost: the pack hook stays on there
        assert net.hooked == [True] * WATCHED_EVALUATIONS + [False] * later
    if outer and READABLE_HOOKS:  # every evaluation's saves reached the caller's hooks (the Linear's input, the
        assert len(packed) >= 2 * STEPS  # sigmoid's output); on torch 2.1 copy on write stands in front of them
    params = [x, *net.parameters()]
    assert_grads_equal(grads(out.square().sum(), *params), grads(reference(net, x).square().sum(), *params))


@pytest.mark.parametrize("sampler", [euler, euler_out_of_place])
def test_a_write_unseen_in_a_later_evaluation_fails_in_backward(sampler):
    """Under ``euler`` the call keeps the pack hook (its ``x +=`` needs copies): copy on write's own
    check refuses. Under ``euler_out_of_place`` the later evaluations run without it: torch's version
    counter refuses (on torch 2.1, where the pack hook stays on, copy on write's check)."""
    torch.manual_seed(0)
    net, x = Net(scale_from=WATCHED_EVALUATIONS + 1), torch.randn(2, 4, requires_grad=True)
    out = gradpatch.differentiable(sampler, step="net")(net, x.clone())
    assert net.seen[-1] is False
    hooked = sampler is euler and READABLE_HOOKS
    assert net.hooked[-1] is hooked
    unhooked = sampler is euler_out_of_place and READABLE_HOOKS
    message = "modified by an inplace operation" if unhooked else "modified in place by a write gradpatch did not see"
    with pytest.raises(RuntimeError, match=message):
        out.sum().backward()
