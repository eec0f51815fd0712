"""DiffSinger's rectified flow (GitHub only): the declared fix on a replica of its sampler.

``patches/diffsinger.py`` documents the opt-in (``gradpatch.differentiable(
"modules.core.reflow:RectifiedFlow.forward", step="velocity_fn")``; the path is too generic to declare).
The replica below has the
shape of every version of that file: ``@torch.no_grad()`` on ``inference`` and on the step methods,
which update the state in place after the network read it (``x += v * dt``), the step count read from a
global ``hparams``. The declared fix is compared with the same loop written out of place by hand, for
Euler and RK4; upstream's body, unwrapped, is shown failing in backward.
"""
from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from support import assert_grads_close  # noqa: E402
import gradpatch  # noqa: E402
from gradpatch.patching import catalogue  # noqa: E402
from gradpatch.patching.activation import known_patches  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
hparams = {"sampling_algorithm": "euler", "sampling_steps": 3, "infer": False}
M, T = 4, 5


class Velocity(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = torch.nn.Conv1d(M, 16, 3, padding=1)
        self.c = torch.nn.Conv1d(8, 16, 1)
        self.t = torch.nn.Linear(1, 16)
        self.out = torch.nn.Conv1d(16, M, 3, padding=1)

    def forward(self, x, t, cond):
        h = self.x(x[:, 0]) + self.c(cond) + self.t(t[:, None] / 1000)[..., None]
        return self.out(torch.tanh(h))[:, None]


class RectifiedFlow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.velocity_fn, self.out_dims, self.num_feats, self.time_scale_factor = Velocity(), M, 1, 1000

    def forward(self, condition, gt_spec=None, src_spec=None, infer=True):
        cond = condition.transpose(1, 2)
        return self.inference(cond, b=condition.shape[0], device=condition.device)

    @torch.no_grad()
    def sample_euler(self, x, t, dt, cond):
        x += self.velocity_fn(x, self.time_scale_factor * t, cond) * dt
        t += dt
        return x, t

    @torch.no_grad()
    def sample_rk4(self, x, t, dt, cond):
        k_1 = self.velocity_fn(x, self.time_scale_factor * t, cond)
        k_2 = self.velocity_fn(x + 0.5 * k_1 * dt, self.time_scale_factor * (t + 0.5 * dt), cond)
        k_3 = self.velocity_fn(x + 0.5 * k_2 * dt, self.time_scale_factor * (t + 0.5 * dt), cond)
        k_4 = self.velocity_fn(x + k_3 * dt, self.time_scale_factor * (t + dt), cond)
        x += (k_1 + 2 * k_2 + 2 * k_3 + k_4) * dt / 6
        t += dt
        return x, t

    @torch.no_grad()
    def inference(self, cond, b=1, x_end=None, device=None):
        x = torch.randn(b, self.num_feats, self.out_dims, cond.shape[2], device=device)
        infer_step = hparams['sampling_steps']
        dt = 1.0 / max(1, infer_step)
        algorithm_fn = {'euler': self.sample_euler, 'rk4': self.sample_rk4}.get(hparams['sampling_algorithm'])
        dts = torch.tensor([dt]).to(x)
        for i in range(infer_step):
            x, _ = algorithm_fn(x, i * dts, dt, cond)
        return x.float().transpose(2, 3).squeeze(1)


def reference(model, condition, algorithm):
    """The replica's sampling written by hand: no decorators, the state updated out of place."""
    cond, steps = condition.transpose(1, 2), hparams["sampling_steps"]
    v = lambda x, t: model.velocity_fn(x, 1000 * t, cond)  # noqa: E731
    x, dt = torch.randn(condition.shape[0], 1, M, cond.shape[2]), 1.0 / steps
    for i in range(steps):
        t = torch.tensor([i * dt])
        if algorithm == "euler":
            x = x + v(x, t) * dt
        else:
            k_1 = v(x, t)
            k_2 = v(x + 0.5 * k_1 * dt, t + 0.5 * dt)
            k_3 = v(x + 0.5 * k_2 * dt, t + 0.5 * dt)
            k_4 = v(x + k_3 * dt, t + dt)
            x = x + (k_1 + 2 * k_2 + 2 * k_3 + k_4) * dt / 6
    return x.transpose(2, 3).squeeze(1)


@pytest.fixture
def patched():
    """The opt-in ``patches/diffsinger.py`` documents, on the replica's module (both entries)."""
    diffsinger = __import__(f"{catalogue.builtin_package().__name__}.diffsinger", fromlist=["FIX"])
    records = [gradpatch.differentiable(f"{__name__}:RectifiedFlow.{name}", step="velocity_fn")
               for name in ("forward", "inference")]
    assert all(r.status.value == "applied" and known_patches()[r.patch].fix == diffsinger.FIX for r in records)
    yield
    gradpatch.revert(*[r.patch for r in records])


def _setup(algorithm):
    hparams["sampling_algorithm"] = algorithm
    torch.manual_seed(0)
    model = RectifiedFlow()
    condition = torch.randn(1, T, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    return model, condition


def _grads(out, model, condition):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return torch.autograd.grad((out * weight).sum(), [condition, *model.parameters()])


@pytest.mark.parametrize("algorithm", ["euler", "rk4"])
def test_upstream_in_place_steps_fail_even_unwrapped(algorithm):
    model, condition = _setup(algorithm)
    assert not model(condition).requires_grad
    originals = {n: vars(RectifiedFlow)[n] for n in ("inference", "sample_euler", "sample_rk4")}
    try:
        for name, method in originals.items():
            setattr(RectifiedFlow, name, inspect.unwrap(method))
        out = model(condition)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    finally:
        for name, method in originals.items():
            setattr(RectifiedFlow, name, method)


@pytest.mark.parametrize("options", [{}, {"checkpoint_steps": True}], ids=["plain", "checkpoint_steps"])
@pytest.mark.parametrize("algorithm", ["euler", "rk4"])
def test_declared_fix_gives_the_out_of_place_gradients(patched, algorithm, options):
    model, condition = _setup(algorithm)
    torch.manual_seed(3)
    got = _grads(model(condition, cache=False, **options), model, condition)
    torch.manual_seed(3)
    want = _grads(reference(model, condition, algorithm), model, condition)
    assert_grads_close(got, want)
    assert all(w.any() for w in want)


def test_grad_steps_is_refused_with_the_reason(patched):
    model, condition = _setup("euler")
    with pytest.raises(ValueError, match="steps="):
        model(condition, cache=False, grad_steps=1)
