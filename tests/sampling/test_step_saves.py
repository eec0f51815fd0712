"""``checkpoint_steps``: what a checkpointed denoiser evaluation's forward saves is freed when it returns,
also under a module hook that ties the dropped graph into a reference cycle (a tensor hook closing over
the output it is registered on), or that keeps one of its tensors on the module (``stored-output``). That cycle runs through autograd's C++ nodes, which the garbage collector
does not see: a forward saving as autograd does (without ``gradpatch.checkpointing.saves``' hooks) would
keep that evaluation's activations for good (measured: 2.1 MB kept here instead of 1.07 MB). Bytes still allocated after the forward are measured at the allocator
(the profiler's memory events); gradients are held to the plain ``cache=False`` call (float64)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from support import assert_grads_close
from gradpatch.sampling.options import SamplingOptions
from gradpatch.sampling.run import differentiable, run_step

WIDTH, STEPS = 256, 4


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).sigmoid())


def _sample(net, x0, options):
    with differentiable(net, options):
        x = x0
        for i in range(STEPS):
            x = x + run_step(i, STEPS, net, x) * 0.1
    return x


def _kept_and_grads(net, x0, options, tracker):
    outs = []
    with tracker():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            outs.append(_sample(net, x0, options))
        kept = sum(e.self_cpu_memory_usage for e in prof.events())
        params = [x0, *net.parameters()]
        for p in params:
            p.grad = None
        outs.pop().square().sum().backward()
    return kept, [p.grad.clone() for p in params]


@contextlib.contextmanager
def _cycle(net):
    """A forward hook on the last layer registering, on its output, a tensor hook that reads that output:
    output -> its node -> the hook -> the output, a cycle only the garbage collector frees."""
    def hook(module, args, out):
        out.register_hook(lambda grad: grad if out.shape == grad.shape else grad)

    handle = net.b.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _stored(net):
    """A forward hook keeping the last layer's output on the module (an attention store, say): that output
    holds the evaluation's whole graph, until the next evaluation replaces it."""
    def hook(module, args, out):
        net.stored = out

    handle = net.b.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        net.__dict__.pop("stored", None)


@pytest.mark.parametrize("held", ["none", "cycle", "stored"], ids=["no-hooks", "reference-cycle", "stored-output"])
def test_each_evaluation_frees_what_it_saved_and_gradients_equal_the_plain_call(held):
    net = Net().double()
    tracker = {"none": contextlib.nullcontext, "cycle": lambda: _cycle(net), "stored": lambda: _stored(net)}[held]
    x0 = torch.randn(64, WIDTH, dtype=torch.float64, requires_grad=True)
    plain_kept, want = _kept_and_grads(net, x0, SamplingOptions(), tracker)
    kept, got = _kept_and_grads(net, x0, SamplingOptions(checkpoint_steps=True), tracker)
    print(f"kept after the forward: plain {plain_kept}, checkpoint_steps {kept}")
    # Plain keeps each evaluation's activations (4 x 64 x 1024 doubles, twice, per step); checkpointed,
    # about one latent per step.
    assert kept * 4 < plain_kept, (kept, plain_kept)
    assert kept <= STEPS * 3 * x0.nbytes, (kept, x0.nbytes)
    assert_grads_close(got, want, rtol=1e-10)
