"""Copies, pickles and reverts around ``cache=False`` calls: a copy of a module taken during a call is
its own (none of gradpatch's attribute shadows come with it), a ``differentiable`` callable copies and
pickles like the bound method it wraps, a suspended generator holds no shadow, and ``revert()`` puts back
the checkpoint policy ``apply`` set. Gradients against the same loop written by hand, in float64."""
from __future__ import annotations

import copy
import importlib
import inspect
import io
import pickle
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
import foreign_samplers as fs  # noqa: E402

import gradpatch  # noqa: E402
from support import assert_grads_close, last_json, run_python, weighted_grads  # noqa: E402
from gradpatch.sampling import run as runner  # noqa: E402

SHADOWED = {"forward", "eval", "clear_cache", "__getstate__"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))

    def clear_cache(self) -> None:
        pass


def by_hand(net, x):
    """``net(x)`` written out with ``net``'s own weights."""
    return torch.tanh(nn.functional.linear(x, net.lin.weight, net.lin.bias))


def euler(net, x, steps=3, detach_at=None):
    for i in range(steps):
        if i == detach_at:
            x = x.detach()
        x = x + by_hand(net, x) / steps
    return x


@torch.no_grad()
def sample(net, x, steps=3, keep=None):
    """A sampler that hands the step module to ``keep`` half way (an EMA copy, a checkpoint file)."""
    for i in range(steps):
        x = x + net(x) / steps
        if i == 1 and keep is not None:
            keep(net)
    return x


@torch.no_grad()
def progressive(net, x, steps=3):
    for _ in range(steps):
        x = x + net(x) / steps
        yield x


class Student(nn.Module):
    """A model holding its differentiable sampler as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.sample_grad = gradpatch.differentiable(self.sample, step="net", steps="steps")

    @torch.no_grad()
    def sample(self, x, steps=3):
        self.eval()
        for _ in range(steps):
            x = x + self.net(x) / steps
        return x


def tiny(cls=Net, seed=0):
    torch.manual_seed(seed)
    return cls().double()


def noise(seed=1):
    return torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def own_weights_only(module, others, x):
    """``module`` computes with its own weights and its gradients go to it, none to ``others``."""
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    got, want = module(x), by_hand(module, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    params = [*module.parameters(), *others.parameters()]
    assert_grads_close(weighted_grads(got, params), weighted_grads(want, params))


def test_a_deepcopy_taken_during_a_call_is_its_own_module():
    net, x, kept = tiny(), noise(), []
    out = gradpatch.differentiable(sample, step="net")(net, x, keep=lambda n: kept.append(copy.deepcopy(n)))
    params = [x, *net.parameters()]
    assert_grads_close(weighted_grads(out, params), weighted_grads(euler(net, x), params))
    twin = kept[0]
    assert not SHADOWED & set(vars(twin)) and not SHADOWED & set(vars(net))
    own_weights_only(twin, net, x)


def test_torch_save_during_a_call_loads_a_module_without_shadows():
    net, x, kept = tiny(), noise(), []

    def save(module):
        buffer = io.BytesIO()
        torch.save(module, buffer)
        kept.append(buffer.getvalue())

    out = gradpatch.differentiable(sample, step="net")(net, x, keep=save)
    params = [x, *net.parameters()]
    assert_grads_close(weighted_grads(out, params), weighted_grads(euler(net, x), params))
    loaded = torch.load(io.BytesIO(kept[0]), weights_only=False)
    assert not SHADOWED & set(vars(loaded))
    own_weights_only(loaded, net, x)


def test_copies_of_a_catalogued_samplers_model_do_not_take_its_shadows():
    """runner's shadows (``eval`` kept, ``forward`` without cache, ``clear_cache`` inert) stay on the model."""
    model, x = tiny().train(), noise()
    with runner.differentiable(model, runner.SamplingOptions()), runner.text_cache_off(model):
        assert {"eval", "forward", "clear_cache"} <= set(vars(model))  # the shadows this test is about
        twin, saved, shallow = copy.deepcopy(model), pickle.dumps(model), copy.copy(model)
        assert model.eval() is model and model.training  # the model's own shadows still act
    loaded = pickle.loads(saved)
    for other in (twin, loaded, shallow):
        assert not SHADOWED & set(vars(other))
    twin.eval()
    assert not twin.training and model.training  # the copy's eval() is its own, the model's untouched
    own_weights_only(twin, model, x)
    own_weights_only(loaded, model, x)


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"checkpoint_steps": True}])
def test_a_deep_copied_model_samples_with_its_own_weights(options):
    """An EMA copy of a model holding ``differentiable(self.sample)``: the copy's callable is the copy's."""
    student, x = tiny(Student), noise()
    ema = copy.deepcopy(student)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5).add_(0.1)
    assert ema.sample_grad is not student.sample_grad
    out = ema.sample_grad(x, **options)
    want = euler(ema.net, x, detach_at=2 if options.get("grad_steps") else None)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    params = [x, *ema.parameters(), *student.parameters()]
    assert_grads_close(weighted_grads(out, params), weighted_grads(want, params))


@pytest.mark.parametrize("library", ["pickle", "dill", "cloudpickle"])
def test_a_differentiable_callable_pickles(library):
    dumps, loads = importlib.import_module(library).dumps, importlib.import_module(library).loads
    student, x = tiny(Student), noise()
    model, method = loads(dumps((student, student.sample_grad)))  # a bound method's callable: with its object
    assert method is model.sample_grad and model is not student
    out = method(x, grad_steps=2)
    want = euler(model.net, x, detach_at=1)
    params = [x, *model.parameters(), *student.parameters()]
    assert_grads_close(weighted_grads(out, params), weighted_grads(want, params))

    function = loads(dumps(gradpatch.differentiable(sample, step="net", steps="steps")))  # a function's
    assert inspect.signature(function).parameters["cache"].default is False
    net = tiny(seed=2)
    out = function(net, x, checkpoint_steps=True)
    params = [x, *net.parameters()]
    assert_grads_close(weighted_grads(out, params), weighted_grads(euler(net, x), params))


def test_a_suspended_generator_holds_no_shadow():
    net, x = tiny(), noise()
    items = []
    for item in gradpatch.differentiable(progressive, step="net", steps="steps")(net, x, grad_steps=2):
        assert not SHADOWED & set(vars(net))  # between resumptions the module has its own forward
        items.append(item)
    params = [x, *net.parameters()]
    assert_grads_close(weighted_grads(items[-1], params), weighted_grads(euler(net, x, detach_at=1), params))


def test_a_generator_suspended_across_revert():
    gradpatch.differentiable("foreign_samplers:Progressive.p_sample_loop_progressive", step="model", steps="steps")
    try:
        torch.manual_seed(0)
        model = fs.Progressive().double()
        x, mu = noise(), noise(2)
        gen = model.p_sample_loop_progressive(x, mu, cache=False)
        next(gen)
    finally:
        gradpatch.revert()
    assert not SHADOWED & set(vars(model.model))
    last = list(gen)[-1]
    want = x
    for i in range(3):
        want = want + torch.tanh(model.model.l(want) + mu + i / 3) / 3
    params = [x, mu, *model.parameters()]
    assert_grads_close(weighted_grads(last, params), weighted_grads(want, params))


def test_revert_puts_back_the_policy_apply_set(fake_upstream):
    out = last_json(run_python("""
import json, gradpatch
from gradpatch import settings
seen = []
gradpatch.apply("fakeup", checkpoint="always", exclude=[])
gradpatch.apply("fakeup", checkpoint="never", exclude=[])
seen.append(settings.checkpoint_policy)
gradpatch.revert()
seen.append(settings.checkpoint_policy)
gradpatch.apply("fakeup", checkpoint="budget:1GB", exclude=[])
settings.set_checkpoint_policy("never")  # the user's own choice: revert leaves it
gradpatch.revert()
seen.append(settings.checkpoint_policy)
settings.set_checkpoint_policy("always")
gradpatch.apply("fakeup", exclude=[])  # no policy given: revert has nothing to put back
gradpatch.revert()
seen.append(settings.checkpoint_policy)
print(json.dumps(seen))
""", env={"GRADPATCH_EXCLUDE": "fakeup"}, pythonpath=[fake_upstream]))
    assert out == ["never", "respect", "never", "always"]


@pytest.mark.parametrize("library", ["pickle", "dill", "cloudpickle"])
def test_a_sampler_patched_in_place_pickles_by_name(library):
    dumps, loads = importlib.import_module(library).dumps, importlib.import_module(library).loads
    gradpatch.differentiable("foreign_samplers:InBody.sample", step="model", steps="steps")
    try:
        patched = vars(fs.InBody)["sample"]
        assert loads(dumps(patched)) is patched
        model = fs.InBody().double()
        clone, method = loads(dumps((model, model.sample)))
        assert method.__self__ is clone and method.__func__ is patched
    finally:
        gradpatch.revert()
