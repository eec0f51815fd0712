"""gradpatch.differentiable held to its contract on foreign code (tests/foreign_samplers.py): one
pattern each, gradients compared with the same code with its blockers removed by hand, upstream shown
failing in the same test."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

sys.path.insert(0, str(Path(__file__).parents[1]))
import foreign_samplers as fs  # noqa: E402

import gradpatch  # noqa: E402
from support import assert_grads_equal, last_json, run_python  # noqa: E402


def euler(net, x, mu, steps, detach_at=None):
    """The Euler loop of EveryLevel/Imagen/InBody/Progressive, blockers removed by hand."""
    for i in range(steps):
        if i == detach_at:
            x = x.detach()
        x = x + net(x, mu, i / steps) / steps
    return x


def cfg_euler(net, noise, mu, n, cfg=0.5, detach_at=None):
    """Buffers.solve_euler out of place, blockers removed by hand."""
    x = noise
    for i in range(n):
        if i == detach_at:
            x = x.detach()
        v = net(torch.cat([x, x]), torch.cat([mu, torch.zeros_like(mu)]), i / n)
        v, u = v.chunk(2)
        x = x + ((1.0 + cfg) * v - cfg * u) / n
    return x


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, generator=g).requires_grad_(), torch.randn(2, 4, generator=g).requires_grad_())


def grads(loss, *tensors):
    return list(torch.autograd.grad(loss, tensors, allow_unused=True))


def make(cls, seed=0):
    torch.manual_seed(seed)
    return cls()


@pytest.mark.parametrize("cls, method", [(fs.EveryLevel, "sample"), (fs.Imagen, "sample"), (fs.InBody, "sample"),
                                         (fs.Progressive, "p_sample_loop")])
def test_every_grad_off_construct_of_the_sampler(cls, method):
    model = make(cls)
    x, mu = inputs()
    assert not getattr(model, method)(x, mu, steps=3).requires_grad  # upstream: no graph
    out = gradpatch.differentiable(getattr(model, method), step="model", steps="steps")(x, mu, steps=3)
    params = list(model.parameters())
    got = grads(out.square().sum(), x, mu, *params)
    want = grads(euler(model.model, x, mu, 3).square().sum(), x, mu, *params)
    assert_grads_equal(got, want)


def test_generator_yielding_inside_no_grad():
    model = make(fs.Progressive)
    x, mu = inputs()
    for _ in model.p_sample_loop_progressive(x, mu):
        assert not torch.is_grad_enabled()  # upstream: the caller's loop body runs without grad
    assert torch.is_grad_enabled()
    items, modes = [], []
    for item in gradpatch.differentiable(model.p_sample_loop_progressive)(x, mu):
        modes.append(torch.is_grad_enabled())
        items.append(item)
    assert modes == [True] * 3 and all(item.requires_grad for item in items)
    params = list(model.parameters())
    assert_grads_equal(grads(items[-1].sum(), x, mu, *params), grads(euler(model.model, x, mu, 3).sum(), x, mu, *params))
    with torch.no_grad():  # the caller's mode, at every yield
        assert [torch.is_grad_enabled() for _ in gradpatch.differentiable(model.p_sample_loop_progressive)(x, mu)] \
            == [False] * 3


def test_networks_run_as_written():
    model = make(fs.WithStopGrad)
    x, mu = inputs()
    out = gradpatch.differentiable(model.sample)(x, mu)
    params = list(model.parameters())
    got = grads(out.square().sum(), x, mu, *params)
    assert_grads_equal(got, grads(euler(model.model, x, mu, 3).square().sum(), x, mu, *params))
    net = model.model  # the same network with its stop-gradients removed gives other gradients
    lifted = lambda x, mu, t: torch.tanh(net.l(x) / (net.l(x).abs().mean() + 1.0) + mu + t) / (x.norm(dim=-1, keepdim=True) + 1)  # noqa: E731
    other = grads(euler(lifted, x, mu, 3).square().sum(), x, mu, *params)
    assert not torch.allclose(got[0], other[0])


def test_caller_no_grad_is_honoured():
    model = make(fs.EveryLevel)
    x, mu = inputs()
    with torch.no_grad():
        assert not gradpatch.differentiable(model.sample)(x, mu).requires_grad
    with torch.inference_mode():
        assert not gradpatch.differentiable(model.sample)(x, mu).requires_grad
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("cls", [fs.EveryLevel, fs.Imagen])
def test_eval_inside_the_sampler_keeps_the_callers_modes(cls):
    model = make(cls)
    model.train()
    model.model.drop.eval()
    x, mu = inputs()
    model.sample(x, mu)  # upstream flips them
    assert (model.training, model.model.drop.training) != (True, False)
    model.train()
    model.model.drop.eval()
    model.model.modes.clear()
    gradpatch.differentiable(model.sample)(x, mu)
    assert model.model.modes == [True] * 3
    assert model.training and model.model.training and not model.model.drop.training


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_module_the_sampler_attaches_takes_its_parents_mode(training):
    """imagen's ``sample`` rebuilds ``self.unets = nn.ModuleList([*self.unets])`` inside its
    ``eval_decorator`` (whose ``train(was_training)`` then sets the new container's mode): with that
    call inert, the new container takes its parent's mode, and the sampler's object is found although
    the decorator's signature names it ``model``, not ``self``, and is patched as a class attribute."""

    class Cascade(fs.Imagen):
        @torch.no_grad()
        @fs.eval_decorator
        def sample(self, x, mu, steps=3):
            self.stages = torch.nn.ModuleList([self.model])
            return self.p_sample_loop(x, mu, steps)

    model = make(Cascade).train(training)
    Cascade.sample = gradpatch.differentiable(vars(Cascade)["sample"])
    x, mu = inputs()
    assert Cascade.sample(model, x, mu).requires_grad
    assert all(m.training is training for m in model.modules())


def test_buffers_refilled_and_state_updated_in_place():
    model = make(fs.Buffers)
    noise, mu = inputs()
    with pytest.raises(RuntimeError, match="inplace"):  # upstream with grad on
        model.solve_euler(noise.clone(), mu, 4, 0.5).sum().backward()
    out = gradpatch.differentiable(model.forward, step="estimator", steps="n_timesteps")(mu, noise)
    params = list(model.parameters())
    got = grads(out.square().sum(), noise, mu, *params)
    assert_grads_equal(got, grads(cfg_euler(model.estimator, noise, mu, 4).square().sum(), noise, mu, *params))


def test_a_tensor_saved_before_thousands_of_dropped_graphs_is_still_copied(monkeypatch):
    """Copy on write notes each saved tensor weakly, per storage, and sweeps the dead notes as they grow:
    a call that builds and drops thousands of graphs keeps a small registry, and a buffer saved before
    them and refilled after is still copied (gradients of the out-of-place computation)."""
    from gradpatch.sampling.generic.copy_on_write import CopyOnWrite

    live = []
    sweep = CopyOnWrite.sweep

    def counted(self):
        sweep(self)
        live.append(sum(map(len, self.saved.values())))

    monkeypatch.setattr(CopyOnWrite, "sweep", counted)

    @torch.no_grad()
    def sampler(x, w):
        buf = torch.zeros(2, 4)
        buf[:] = x
        y = buf * w  # saves buf
        for _ in range(3000):
            ((x * 2) * (w * 2)).sum()  # a graph built and dropped: two tensors saved
        buf[:] = 0  # y's backward needs the values buf had
        return y

    x, w = inputs()
    got = grads(gradpatch.differentiable(sampler)(x, w).square().sum(), x, w)
    assert_grads_equal(got, grads((x * w).square().sum(), x, w))
    assert live and max(live) < 50


def test_a_parameter_saved_at_every_step_and_updated_by_a_callback():
    """A leaf that requires grad is held once while it is unchanged (a parameter saved at every step);
    the caller's callback updating it under its own ``no_grad`` (an EMA-style step) makes the steps
    before keep a copy and the steps after save the new values."""
    x, w = inputs()

    @torch.no_grad()
    def sampler(x, w, callback):
        for i in range(4):
            x = x * w + x
            callback(i)
        return x

    def callback(i):
        if i == 1:
            with torch.no_grad():
                w.mul_(0.5)

    w0 = w.detach().clone()
    out = gradpatch.differentiable(sampler)(x, w, callback)
    got = grads(out.square().sum(), x, w)
    with torch.no_grad():
        w.copy_(w0)
    want_x = x
    for i in range(4):
        value = w if i < 2 else w + (0.5 * w0 - w0)  # the same leaf, its values after the update
        want_x = want_x * value + want_x
    assert_grads_equal(got, grads(want_x.square().sum(), x, w))


@pytest.mark.parametrize("checkpoint_steps", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_grad_steps_is_a_graph_through_the_last_k_steps(k, checkpoint_steps):
    model = make(fs.Buffers)
    noise, mu = inputs()
    sample = gradpatch.differentiable(model.forward, step="estimator", steps="n_timesteps")
    out = sample(mu, noise, grad_steps=k, checkpoint_steps=checkpoint_steps)
    params = list(model.parameters())
    got = grads(out.square().sum(), noise, mu, *params)
    want = grads(cfg_euler(model.estimator, noise, mu, 4, detach_at=4 - k if k < 4 else None).square().sum(), noise, mu, *params)
    if k < 4:
        assert got[0] is None and want[0] is None  # the initial noise: none (DRaFT-K)
        got, want = got[1:], want[1:]
    assert_grads_equal(got, want)


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 3, "checkpoint_steps": True},
                                     {"checkpoint_steps": True}])
def test_a_module_level_odeint_numbers_the_steps(options):
    pytest.importorskip("torchdiffeq")
    model = make(fs.OdeCFM).train()
    cond = inputs()[1]
    out = gradpatch.differentiable(model.sample, step="odeint")(cond, **options)
    assert model.training
    net = model.transformer

    def cfg(x, mu, t):
        pred = net(x, mu, t)
        return pred + (pred - net(x, torch.zeros_like(mu), t)) * 2.0  # the ODE's velocity; euler() steps 1/4

    k = options.get("grad_steps")
    want = euler(lambda x, mu, t: cfg(x, mu, torch.tensor(t)), cond * 0.5, cond, 4, detach_at=4 - k if k else None)
    params = list(model.parameters())
    assert_grads_equal(grads(out.square().sum(), cond, *params), grads(want.square().sum(), cond, *params))


def test_checkpoint_steps_matches_the_plain_run():
    model = make(fs.EveryLevel)
    x, mu = inputs()
    sample = gradpatch.differentiable(model.sample, step="p_sample")
    params = list(model.parameters())
    got = grads(sample(x, mu, checkpoint_steps=True).square().sum(), x, mu, *params)
    assert_grads_equal(got, grads(euler(model.model, x, mu, 3).square().sum(), x, mu, *params))


def test_refusals_say_what_and_where():
    x, mu = inputs()
    with pytest.raises(gradpatch.NotDifferentiableError, match=r"ema_scope\(\) at .*foreign_samplers.py"):
        gradpatch.differentiable(make(fs.Ema).log_images)(x, mu)
    with pytest.raises(gradpatch.NotDifferentiableError, match=r"numpy\(\) at .*foreign_samplers.py"):
        gradpatch.differentiable(make(fs.ToNumpy).sample_numpy)(x, mu)
    with pytest.raises(gradpatch.NotDifferentiableError, match="numpy.ndarray: the result left torch"):
        gradpatch.differentiable(make(fs.ToNumpy).sample_detached)(x, mu)
    with pytest.raises(gradpatch.NotDifferentiableError, match=r"held in a variable .*foreign_samplers.py:\d+"):
        gradpatch.differentiable(make(fs.HeldManager).sample)(x, mu)


def test_inference_tensors_never_leak():
    model = make(fs.Leaky)
    x, mu = inputs()
    assert model.sample(x, mu)[1].is_inference()
    out, level = gradpatch.differentiable(model.sample)(x, mu)
    assert not out.is_inference() and not level.is_inference() and out.requires_grad


def test_options_are_validated_like_every_patched_sampler():
    model = make(fs.Buffers)
    noise, mu = inputs()
    sample = gradpatch.differentiable(model.forward, step="estimator", steps="n_timesteps")
    for bad in ("False", 0, None):
        with pytest.raises(TypeError, match="cache must be True or False"):
            sample(mu, noise, cache=bad)
    with pytest.raises(ValueError, match="grad_steps must be a positive integer"):
        sample(mu, noise, grad_steps=0)
    with pytest.raises(ValueError, match="cache=True"):
        sample(mu, noise, cache=True, grad_steps=1)
    with pytest.raises(ValueError, match="needs steps="):
        gradpatch.differentiable(model.forward, step="estimator")(mu, noise, grad_steps=1)
    with pytest.raises(ValueError, match="need step="):
        gradpatch.differentiable(model.forward)(mu, noise, checkpoint_steps=True)
    with pytest.raises(RuntimeError, match="called 4 times, but steps says 5"):
        gradpatch.differentiable(model.forward, step="estimator", steps=lambda arguments: 5)(mu, noise, grad_steps=1)
    assert torch.equal(sample(mu, noise, cache=np.True_), model(mu, noise))


def test_string_target_patched_in_place_reported_and_reverted():
    original = vars(fs.Buffers)["forward"]
    model = make(fs.Buffers)
    noise, mu = inputs()
    before = model(mu, noise)
    try:
        record = gradpatch.differentiable("foreign_samplers:Buffers.forward", step="estimator", steps="n_timesteps")
        assert record.status == gradpatch.Status.APPLIED
        assert vars(fs.Buffers)["forward"] is not original
        assert any(r.target == "foreign_samplers:Buffers.forward" and r.status == "applied" for r in gradpatch.report())
        assert torch.equal(model(mu, noise), before) and not model(mu, noise).requires_grad  # cache=True: upstream
        out = model(mu, noise, cache=False, grad_steps=2)
        params = list(model.parameters())
        assert_grads_equal(grads(out.sum(), mu, *params),
                           grads(cfg_euler(model.estimator, noise, mu, 4, detach_at=2).sum(), mu, *params))
    finally:
        gradpatch.revert()
    assert vars(fs.Buffers)["forward"] is original
    assert "differentiable:foreign_samplers:Buffers.forward" not in gradpatch.known_patches()  # apply() won't redo it


def test_string_target_patched_when_imported(tmp_path):
    result = run_python("""
        import json, sys
        import gradpatch
        record = gradpatch.differentiable("foreign_samplers:InBody.sample", step="model", steps="steps")
        statuses = [str(record.status)]
        assert "torch" not in sys.modules and "foreign_samplers" not in sys.modules
        import torch, foreign_samplers as fs
        original = fs.InBody.sample.__wrapped__
        statuses.append(str(gradpatch.report()[-1].status))
        model = fs.InBody()
        x = torch.randn(2, 4, requires_grad=True)
        graph = [model.sample(x, x).requires_grad, model.sample(x, x, cache=False, grad_steps=1).requires_grad]
        gradpatch.revert()
        print(json.dumps([statuses, graph, fs.InBody.sample is original]))
    """, pythonpath=[Path(__file__).parents[1]])
    assert last_json(result) == [["deferred", "applied"], [False, True], True]


def test_a_concurrent_upstream_call_in_another_thread_is_unaffected():
    """Thread A pauses inside a differentiable call (torch's managers patched at class level meanwhile)
    while thread B runs upstream's decorated sampler: B gets no graph and its own eval(), A its graph."""
    from support import Interleaved

    a, b = make(fs.EveryLevel), make(fs.EveryLevel)
    a.train(), b.train()
    x, mu = inputs()
    order, got = Interleaved(), {}
    a.model.register_forward_pre_hook(order.pause)

    def run_a():
        got["a"] = gradpatch.differentiable(a.sample)(x, mu)

    def run_b():
        got["b"] = b.sample(x, mu)
        got["b modes"] = b.training

    order.run(run_a, run_b)
    assert not got["b"].requires_grad and got["b modes"] is False
    assert got["a"].requires_grad and a.training
    params = list(a.parameters())
    assert_grads_equal(grads(got["a"].sum(), x, *params), grads(euler(a.model, x, mu, 3).sum(), x, *params))
    assert torch.no_grad.__enter__.__module__ == "torch.autograd.grad_mode"  # patches gone after the call


def test_a_catalogue_declaration_and_an_unknown_version_opted_in():
    """A ``patches/`` entry declares a sampler made differentiable with ``sampler(step=, steps=)``:
    its fingerprint known, it is applied like any patch; a version it does not know is left alone with
    an UnknownCodeWarning, and the string form opts it in."""
    from gradpatch.patching import activation
    from gradpatch.patching.fingerprint import Fingerprints
    from gradpatch.patching.patch import Patch
    from gradpatch.sampling.generic.any_sampler import sampler

    original = vars(fs.Buffers)["forward"]
    digest = Fingerprints({}).identify(fs, "Buffers.forward", original).label
    fix = sampler(step="estimator", steps="n_timesteps")
    known = Patch("foreign.cfm", "foreign_samplers:Buffers.forward", fix, Fingerprints({digest: "foreign 1.0"}),
                  "foreign", "Buffers.forward(cache=False)")
    other = known._replace(name="foreign_next.cfm", upstream="foreign_next", recognise=Fingerprints({"0" * 16: "2.0"}))
    model = make(fs.Buffers)
    noise, mu = inputs()
    try:
        activation.known_patches().update({known.name: known, other.name: other})
        (record,) = gradpatch.apply("foreign")
        assert (record.status, record.variant) == (gradpatch.Status.APPLIED, "foreign 1.0")
        assert model(mu, noise, cache=False, grad_steps=1).requires_grad and not model(mu, noise).requires_grad
        gradpatch.revert("foreign")
        with pytest.warns(gradpatch.UnknownCodeWarning):
            (record,) = gradpatch.apply("foreign_next")
        assert record.status == gradpatch.Status.SKIPPED and vars(fs.Buffers)["forward"] is original
        opted = gradpatch.differentiable("foreign_samplers:Buffers.forward", step="estimator", steps="n_timesteps")
        assert opted.status == gradpatch.Status.APPLIED and model(mu, noise, cache=False).requires_grad
    finally:
        gradpatch.revert()
        for name in (known.name, other.name):
            activation.known_patches().pop(name, None)
    assert vars(fs.Buffers)["forward"] is original
