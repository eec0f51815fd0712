"""``grad_steps`` and ``checkpoint_steps`` of :func:`gradpatch.differentiable` held to DRaFT-K by hand: the
same loop written out with grad, the latent detached at the top of the loop before step N-K (float64)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import gradpatch  # noqa: E402
from support import assert_grads_close, weighted_grads  # noqa: E402

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


@pytest.mark.parametrize("escapes, checkpoint_steps", [(True, True), (False, True), (False, "budget:1")],
                         ids=["hook-path", "fast-path", "budget"])
def test_an_evaluation_leaving_the_fast_path_runs_once_and_draws_its_generator_once(escapes, checkpoint_steps):
    """Before: the first evaluation ran twice (5 calls for 4 steps), the seeded sample 0.248 off the loop by
    hand; and every recompute drew the step's own generator again (a gradient 0.12 off)."""
    torch.manual_seed(0)
    model = NoisySampler().double()
    x, mu = _inputs()
    params = [x, mu, *model.parameters()]

    cond = (lambda: mu * 2.0) if escapes else (lambda: mu)  # a closed-over tensor with history: the hook path
    model.net.cond, model.net.calls = cond(), 0
    model.net.generator.manual_seed(5)
    out = gradpatch.differentiable(model.sample, step="net")(x, checkpoint_steps=checkpoint_steps)
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


# --- grad_steps with step="odeint": never silently ignored (issue 28, item 2) ----------------------------

_ODE_SAMPLERS = '''
import torch
import torchdiffeq
from torchdiffeq import odeint, odeint_adjoint


class Field(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, t, x):
        return torch.tanh(self.lin(x) + t)


@torch.no_grad()
def by_attribute(field, x, steps=4):
    return torchdiffeq.odeint(field, x, torch.linspace(0, 1, steps + 1, dtype=x.dtype), method="euler")[-1]


@torch.no_grad()
def adjoint(field, x, steps=4):
    return odeint_adjoint(field, x, torch.linspace(0, 1, steps + 1, dtype=x.dtype), method="euler",
                          adjoint_params=tuple(field.parameters()))
'''


@pytest.fixture(scope="module")
def ode_module():
    import sys
    import types

    pytest.importorskip("torchdiffeq")
    module = types.ModuleType("gradpatch_test_ode_samplers")
    sys.modules[module.__name__] = module
    exec(compile(_ODE_SAMPLERS, "<ode samplers>", "exec"), vars(module))
    yield module
    del sys.modules[module.__name__]


def _hand_euler(field, x, steps=N, detach_at=None):
    ts = torch.linspace(0, 1, steps + 1, dtype=x.dtype)
    for i in range(steps):
        x = x.detach() if i == detach_at else x
        x = x + (ts[i + 1] - ts[i]) * field(ts[i], x)
    return x


@pytest.mark.parametrize("k", [1, 2])
def test_grad_steps_with_odeint_called_by_attribute_says_it_had_no_effect(ode_module, k):
    """Before: the untruncated gradient, silently (a norm 10.2 / 8.73 in the report's scenario)."""
    torch.manual_seed(0)
    field = ode_module.Field().double()
    x, _ = _inputs()
    sample = gradpatch.differentiable(ode_module.by_attribute, step="odeint", steps="steps")
    plain = sample(field, x)  # no option: the plain graph, as before
    assert_grads_close(weighted_grads(plain, [x, *field.parameters()]),
                       weighted_grads(_hand_euler(field, x), [x, *field.parameters()]), rtol=1e-9)
    with pytest.raises(RuntimeError, match="grad_steps had no effect"):
        sample(field, x, grad_steps=k)
    with pytest.raises(RuntimeError, match="checkpoint_steps had no effect"):
        sample(field, x, checkpoint_steps=True)


@pytest.mark.parametrize("options", [{"grad_steps": 1}, {"checkpoint_steps": True}])
def test_grad_steps_with_odeint_adjoint_is_refused(ode_module, options):
    torch.manual_seed(0)
    field = ode_module.Field().double()
    x, _ = _inputs()
    sample = gradpatch.differentiable(ode_module.adjoint, step="odeint_adjoint", steps="steps")
    with pytest.raises(RuntimeError, match="odeint_adjoint"):
        sample(field, x, **options)


# --- grad_steps: a trainable pre-net applied to the latent before the step (issue 28, item 1) -----------


class Looped(nn.Module):
    """An Euler loop with a trainable ``pre`` on the latent, placed by ``layout``: ``"pre"`` at the top of
    the loop (``x = pre(x); v = step(x)``), ``"post"`` on the step's output, ``"end"`` at the end of the
    loop body (after the update: it makes the next step's input), ``"helper"`` inside a per-step method
    that calls the step (ldm's ``p_sample_ddim``)."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout, self.pre, self.net = layout, nn.Linear(4, 4), Velocity()

    def body(self, x, mu, steps):
        if self.layout == "pre":
            x = self.pre(x)
        v = self.net(x, mu)
        if self.layout == "post":
            v = self.pre(v)
        return x, v

    def helper(self, x, mu, steps):
        h = torch.sin(self.pre(x))
        return x + self.net(h, mu) / steps

    @torch.no_grad()
    def sample(self, x, mu, steps=N):
        for i in range(steps):
            if self.layout == "helper":
                x = self.helper(x, mu, steps)
                continue
            x, v = self.body(x, mu, steps)
            x = x + v / steps
            if self.layout == "end":
                x = self.pre(x)
        return x

    def by_hand(self, x, mu, steps=N, detach_at=None):
        """The same loop with grad, the latent detached at the top of the loop before step ``detach_at``."""
        for i in range(steps):
            x = x.detach() if i == detach_at else x
            if self.layout == "helper":
                x = self.helper(x, mu, steps)
                continue
            x, v = self.body(x, mu, steps)
            x = x + v / steps
            if self.layout == "end":
                x = self.pre(x)
        return x


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["pre", "post", "end", "helper"])
@pytest.mark.parametrize("checkpoint_steps", [False, True], ids=["", "checkpoint_steps"])
def test_grad_steps_gives_a_pre_net_its_share_of_step_n_minus_k(layout, k, checkpoint_steps):
    """Before (layout "pre"): ``pre.weight`` got no gradient with K=1 where the loop by hand gives one, and
    another than the loop's with K=2 (norms 0 and 1.83 for 1.83 and 3.77 in the report's scenario)."""
    torch.manual_seed(0)
    model = Looped(layout).double()
    x, mu = _inputs()
    params = [x, mu, *model.parameters()]
    sample = gradpatch.differentiable(model.sample, step="net", steps="steps")
    got = weighted_grads(sample(x, mu, grad_steps=k, checkpoint_steps=checkpoint_steps), params)
    want = weighted_grads(model.by_hand(x, mu, detach_at=N - k if k < N else None), params)
    assert_grads_close(got, want, rtol=1e-9)


class LastStepApart(Looped):
    """The last step written after the loop: between the two calls, no way back to the loop's top."""

    @torch.no_grad()
    def sample(self, x, mu, steps=N):
        for i in range(steps - 1):
            x, v = self.body(x, mu, steps)
            x = x + v / steps
        x, v = self.body(x, mu, steps)
        return x + v / steps


def test_grad_steps_refuses_a_parameter_it_cannot_place():
    torch.manual_seed(0)
    x, mu = _inputs()
    model = LastStepApart("post").double()  # pre(v) of step N-2 or of step N-1? not told by the layout
    with pytest.raises(RuntimeError, match="cannot be told"):
        gradpatch.differentiable(model.sample, step="net", steps="steps")(x, mu, grad_steps=1)
    model = LastStepApart("none").double()  # only the update between them: DRaFT-K's cut
    params = [x, mu, *model.parameters()]
    got = weighted_grads(gradpatch.differentiable(model.sample, step="net", steps="steps")(x, mu, grad_steps=1),
                         params)
    assert_grads_close(got, weighted_grads(model.by_hand(x, mu, detach_at=N - 1), params), rtol=1e-9)


# --- grad_steps with guidance that differentiates through the step itself (issue 28, item 14) -----------


class Guided(nn.Module):
    """DPS-style guidance: the step evaluated inside the sampler's own ``torch.enable_grad()`` on a detached
    copy of the latent, ``torch.autograd.grad`` of a loss on its output. ``inside``: the state update is
    written inside that block too."""

    def __init__(self, inside: bool) -> None:
        super().__init__()
        self.inside, self.pre, self.net = inside, nn.Linear(4, 4), Velocity()

    def step(self, x, mu, steps):
        h = self.pre(x)
        with torch.enable_grad():
            xg = h.detach().requires_grad_()
            eps = self.net(xg, mu)
            g, = torch.autograd.grad((eps - 0.5).square().sum(), xg, retain_graph=True)
            if self.inside:
                return x + eps / steps - 0.1 * g
        return x + eps / steps - 0.1 * g

    @torch.no_grad()
    def sample(self, x, mu, steps=N):
        for i in range(steps):
            x = self.step(x, mu, steps)
        return x

    def by_hand(self, x, mu, steps=N, detach_at=None):
        for i in range(steps):
            x = x.detach() if i == detach_at else x
            x = self.step(x, mu, steps)
        return x


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("inside", [False, True], ids=["update-after", "update-inside"])
def test_grad_steps_with_guidance_through_the_step(inside, k):
    """Before: "element 0 of tensors does not require grad" in the first cut step."""
    torch.manual_seed(0)
    model = Guided(inside).double()
    x, mu = _inputs()
    params = [x, mu, *model.parameters()]
    out = gradpatch.differentiable(model.sample, step="net", steps="steps")(x, mu, grad_steps=k)
    assert_grads_close(weighted_grads(out, params),
                       weighted_grads(model.by_hand(x, mu, detach_at=N - k if k < N else None), params), rtol=1e-9)


# --- torch.compile(fullgraph=True) around a cache=False call (issue 28, item 24) -------------------------


def test_fullgraph_compile_of_a_call_says_what_to_compile_instead():
    """Before: dynamo's internal "ContextVar mutation not supported" from gradpatch's machinery. On torch
    2.1 (in the Makefile's lower-torch list), before: without fullgraph the call raised this refusal instead
    of running eagerly (dynamo split the untraced entry at its raise and ran the rest), and under fullgraph
    the error named neither the reason nor what to do."""
    torch.manual_seed(0)
    model = Looped("pre")
    x, mu = (t.float() for t in _inputs())
    sample = gradpatch.differentiable(model.sample, step="net", steps="steps")

    def train_step(x, mu):
        return sample(x, mu, grad_steps=2)

    with pytest.raises(RuntimeError, match="compile the denoiser or the step module instead"):
        torch.compile(train_step, fullgraph=True)(x, mu)
    params = [x, mu, *model.parameters()]
    out = torch.compile(train_step)(x, mu)  # without fullgraph: the call runs eagerly, as written
    assert_grads_close(weighted_grads(out, params), weighted_grads(model.by_hand(x, mu, detach_at=N - 2), params))


class PostNetOutside(Looped):
    """``v = proj(step(x))`` and the next step called on the latent as it is: no operation on the latent
    between the top of the loop and step N-K (nothing to see the loop by but the call itself)."""

    @torch.no_grad()
    def sample(self, x, mu, steps=N):
        for i in range(steps):
            v = self.pre(self.net.forward(x, mu))
            x = x + v / steps
        return x

    def by_hand(self, x, mu, steps=N, detach_at=None):
        for i in range(steps):
            x = x.detach() if i == detach_at else x
            x = x + self.pre(self.net(x, mu)) / steps
        return x


@pytest.mark.parametrize("k", [1, 2])
def test_grad_steps_with_a_post_net_and_no_operation_before_the_step(k):
    torch.manual_seed(0)
    model = PostNetOutside("post").double()
    x, mu = _inputs()
    params = [x, mu, *model.parameters()]
    out = gradpatch.differentiable(model.sample, step="net", steps="steps")(x, mu, grad_steps=k)
    assert_grads_close(weighted_grads(out, params), weighted_grads(model.by_hand(x, mu, detach_at=N - k), params),
                       rtol=1e-9)
