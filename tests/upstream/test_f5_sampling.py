"""Differentiable F5-TTS sampling against the real upstream (f5-tts 1.1.22 in this environment).

Tiny random models, no downloads. Backbone weights that upstream initialises to zero (adaLN,
``proj_out``) are re-initialised, or the loss would be flat and earlier layers gradient-free.

Reference semantics checked here:

* ``cache=False`` gradients equal those of the undecorated upstream body (``inspect.unwrap``) run with
  grad on and the backbone's text cache off (a forward pre-hook sets ``cache=False``).
* ``grad_steps=K`` equals that same reference in which the transformer calls of the first ``N - K``
  solver steps run under ``no_grad`` (Euler with batched CFG: the first ``N - K`` calls; midpoint: two
  calls per step; RK4: four).
* ``checkpoint_steps=True`` equals the plain ``cache=False`` run (also in train mode with dropout: the
  recompute replays the RNG).

Older version families (0.x: 0.6.2; 1.0.0-1.1.5: 1.1.4; 1.1.6-1.1.18: 1.1.15) run in one background
interpreter on wheels installed from PyPI with ``--no-deps`` (plus jieba, which releases up to 1.1.9
import) into a cache directory (``GRADPATCH_TEST_CACHE``, default ``~/.cache/gradpatch-tests``). The
1.1.19 family (a thread-local text cache) was tagged but never published, so no installable package
carries it: its ``cfm.py`` equals 1.1.20's (same fingerprint, checked through that wheel) and its cache
is bypassed the same way, by passing ``cache=False`` to the backbone. These tests are marked slow, and
skip with the reason when pip cannot reach the index.
"""
from __future__ import annotations

import contextlib
import copy
import inspect

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("f5_tts")

import gradpatch  # noqa: E402
from support import (BackgroundCheck, Interleaved, assert_grads_equal, pypi_release, pypi_wheels,  # noqa: E402
                      upstream_method)
from gradpatch.testing import f5_cfm, f5_inputs  # noqa: E402
from gradpatch.patching.fingerprint import fingerprint_module, fingerprint_source  # noqa: E402
from gradpatch.sampling import run as sampling
from gradpatch.sampling.families import ode as ode_sampler  # noqa: E402
from gradpatch.patching.activation import known_patches  # noqa: E402

from f5_tts.model import CFM, DiT, MMDiT, UNetT  # noqa: E402
from f5_tts.model import cfm as cfm_module  # noqa: E402

RAW = inspect.unwrap(CFM.sample)  # the undecorated upstream body, patched or not
CURRENT = "3d59b67a10d9082a"  # CFM.sample of f5-tts 1.1.16-1.1.22
KNOWN = known_patches()["f5_tts.sample"].recognise.known  # fingerprint -> "family · provenance"


pytestmark = pytest.mark.usefixtures("single_thread")


def upstream_sample():
    return upstream_method(CFM, "sample")


def make(cls=DiT, seed=0, **extra):
    return f5_cfm(cls.__name__, seed, **extra)


def inputs(seed=1):
    return f5_inputs(seed)


@contextlib.contextmanager
def reference_hooks(net, no_grad_calls=0):
    """Backbone cache off; the first ``no_grad_calls`` transformer calls under no_grad."""
    calls = [0]

    def pre(module, args, kwargs):
        if "cache" in kwargs:
            kwargs["cache"] = False
        calls[0] += 1
        if calls[0] <= no_grad_calls:
            torch.set_grad_enabled(False)
        return args, kwargs

    def post(module, args, output):
        torch.set_grad_enabled(True)

    handles = [net.register_forward_pre_hook(pre, with_kwargs=True), net.register_forward_hook(post)]
    lazy = "_cache_local" in net.__dict__
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()
        if not lazy:  # upstream's clear_cache() creates it (1.1.20+); keep the model as it was
            net.__dict__.pop("_cache_local", None)


def grads_of(model, out, cond):
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).square().mean()
    model.zero_grad()
    cond.grad = None
    loss.backward()
    return [p.grad.clone() for p in model.transformer.parameters()] + [cond.grad.clone()]


def reference_grads(model, cond, text, no_grad_calls=0, **kw):
    cond = cond.clone().requires_grad_(True)
    with reference_hooks(model.transformer, no_grad_calls), torch.enable_grad():
        out, _ = RAW(model, cond, text, **kw)
    return grads_of(model, out, cond)


def patched_grads(model, cond, text, **kw):
    cond = cond.clone().requires_grad_(True)
    out, _ = model.sample(cond, text, cache=False, **kw)
    assert out.grad_fn is not None
    return grads_of(model, out, cond)


def cache_is_clean(net):
    assert not {"forward", "clear_cache"} & vars(net).keys()
    assert "_cache_local" not in net.__dict__  # 1.1.20+: created lazily by any cache write or clear
    assert net.text_cond is None and net.text_uncond is None


def test_report_signature_and_revert():
    original_sample, original_odeint = CFM.__dict__["sample"], cfm_module.odeint
    assert fingerprint_module(cfm_module, ["CFM.sample"]) == CURRENT
    with gradpatch.applied("f5_tts") as report:
        records = {r.patch: r for r in report}
        assert records["f5_tts.sample"].status == "applied"
        assert records["f5_tts.sample"].variant == KNOWN[CURRENT]
        assert "1.1.16–1.1.22" in records["f5_tts.sample"].variant
        assert records["f5_tts.sample"].version == "1.1.22"
        params = inspect.signature(CFM.sample).parameters
        for name, default in [("cache", True), ("grad_steps", None), ("checkpoint_steps", False)]:
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default == default
        assert inspect.unwrap(CFM.sample) is RAW and CFM.sample.__wrapped__ is original_sample
        assert ode_sampler.differentiable_sampler(original_sample) is not ode_sampler.differentiable_sampler(original_sample)
    assert CFM.__dict__["sample"] is original_sample and cfm_module.odeint is original_odeint


def test_a_release_with_its_own_cache_flag_is_fixed_upstream():
    """PR #1299's shape (``sample(..., cache=True)``, no decorator) is left alone; edited code is unknown."""
    recognise = known_patches()["f5_tts.sample"].recognise

    def sample(self, cond, text, duration, *, lens=None, steps=32, cache: bool = True):
        """Stands in for a merged PR #1299."""

    assert recognise.identify(cfm_module, "CFM.sample", sample).verdict == "fixed"
    source = inspect.getsource(cfm_module).replace("self.eval()", "self.train(False)", 1)
    assert fingerprint_source(source, ["CFM.sample"]) not in KNOWN


@pytest.mark.parametrize("cfg", [0.0, 2.0])
def test_cache_true_is_upstream_bit_for_bit(cfg):
    model = make()
    cond, text = inputs()
    model.train()
    want, want_traj = upstream_sample()(model, cond, text, duration=20, steps=3, cfg_strength=cfg, seed=7)
    model.train()
    with gradpatch.applied("f5_tts"):
        got, got_traj = model.sample(cond, text, duration=20, steps=3, cfg_strength=cfg, seed=7)
    assert torch.equal(got, want) and torch.equal(got_traj, want_traj)
    assert got.grad_fn is None and not model.training  # upstream's eval(), unchanged


@pytest.mark.parametrize("cls", [DiT, UNetT, MMDiT])
@pytest.mark.parametrize("cfg", [0.0, 1.0, 2.0])
def test_gradients_equal_the_unwrapped_body(cls, cfg):
    model = make(cls).eval()
    cond, text = inputs()
    kw = dict(duration=20, steps=3, cfg_strength=cfg, seed=3)
    want = reference_grads(model, cond, text, **kw)
    with gradpatch.applied("f5_tts"):
        got = patched_grads(model, cond, text, **kw)
    assert all(p.grad is not None for p in model.transformer.parameters())
    assert_grads_equal(got, want)
    cache_is_clean(model.transformer)


def test_caller_mode_and_grad_mode_are_kept():
    model = make()
    cond, text = inputs()
    with gradpatch.applied("f5_tts"):
        model.train()
        with torch.no_grad():
            out, _ = model.sample(cond, text, duration=20, steps=2, cache=False)
            assert not torch.is_grad_enabled()
        assert out.grad_fn is not None
        assert all(m.training for m in model.modules())
        model.eval()
        model.sample(cond, text, duration=20, steps=2, cache=False)
        assert not any(m.training for m in model.modules())
        assert "eval" not in vars(model) and sampling.active_options() is None


@pytest.mark.parametrize("method,per_step", [("euler", 1), ("midpoint", 2), ("rk4", 4)])
@pytest.mark.parametrize("k", [1, 2])
def test_grad_steps_equals_truncated_reference(method, per_step, k):
    model = make().eval()
    model.odeint_kwargs = dict(method=method)
    cond, text = inputs()
    steps = 4
    kw = dict(duration=20, steps=steps, cfg_strength=2.0, seed=5)
    want = reference_grads(model, cond, text, no_grad_calls=(steps - k) * per_step, **kw)
    full = reference_grads(model, cond, text, **kw)
    with gradpatch.applied("f5_tts"):
        got = patched_grads(model, cond, text, grad_steps=k, **kw)
        both = patched_grads(model, cond, text, grad_steps=k, checkpoint_steps=True, **kw)
    assert_grads_equal(got, want)
    assert_grads_equal(both, want)
    assert any(not torch.allclose(g, f) for g, f in zip(got[:-1], full[:-1]))  # truncation did something
    cache_is_clean(model.transformer)


@pytest.mark.parametrize("cls", [DiT, MMDiT])
def test_checkpoint_steps_equal_plain_in_train_mode(cls):
    model = make(cls, dropout=0.2).train()  # dropout on: the recompute must replay the RNG
    cond, text = inputs()
    kw = dict(duration=20, steps=4, cfg_strength=2.0, seed=9)
    with gradpatch.applied("f5_tts"):
        torch.manual_seed(0)
        plain = patched_grads(model, cond, text, **kw)
        torch.manual_seed(0)
        checkpointed = patched_grads(model, cond, text, checkpoint_steps=True, **kw)
    assert model.training
    assert_grads_equal(checkpointed, plain)
    cache_is_clean(model.transformer)
    copy.deepcopy(model)  # EMA copies work after sampling and recomputing (no thread-local cache)


def test_an_error_inside_sampling_restores_everything():
    model = make().train()
    net = model.transformer
    cond, text = inputs()
    calls = [0]

    def fail_second(module, args, kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("boom")

    handle = net.register_forward_pre_hook(fail_second, with_kwargs=True)
    with gradpatch.applied("f5_tts"):
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="boom"):
                model.sample(cond, text, duration=20, steps=3, cfg_strength=2.0, cache=False, checkpoint_steps=True)
            assert not torch.is_grad_enabled()
        handle.remove()
        assert model.training and all(m.training for m in model.modules())
        assert "eval" not in vars(model) and sampling.active_options() is None
        cache_is_clean(net)
        got, _ = model.sample(cond, text, duration=20, steps=2, cfg_strength=2.0, seed=1)
    model.train()
    want, _ = upstream_sample()(model, cond, text, duration=20, steps=2, cfg_strength=2.0, seed=1)
    assert torch.equal(got, want)


def test_bad_options_are_refused():
    model = make()
    cond, text = inputs()
    with gradpatch.applied("f5_tts"):
        with pytest.raises(ValueError, match="cache=False"):
            model.sample(cond, text, duration=20, steps=2, grad_steps=1)
        with pytest.raises(ValueError, match="positive"):
            model.sample(cond, text, duration=20, steps=2, cache=False, grad_steps=0)
        model.odeint_kwargs = dict(method="dopri5")
        with pytest.raises(ValueError, match="fixed-grid"):
            model.sample(cond, text, duration=20, steps=2, cache=False, grad_steps=1)
        with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
            model.sample(cond, text, duration=20, steps=2, cache=False)
        assert "eval" not in vars(model)
        cache_is_clean(model.transformer)


def test_the_solver_global_is_shadowed_only_during_calls_that_need_steps():
    import torchdiffeq

    model = make()
    cond, text = inputs()
    seen = []
    handle = model.transformer.register_forward_pre_hook(lambda *a: seen.append(cfm_module.odeint))
    with gradpatch.applied("f5_tts"):
        model.sample(cond, text, duration=20, steps=2, cache=False)
        model.sample(cond, text, duration=20, steps=2, cache=False, checkpoint_steps=True)
    handle.remove()
    assert seen[0] is torchdiffeq.odeint and seen[-1] is not torchdiffeq.odeint
    assert seen[-1].__wrapped__ is torchdiffeq.odeint and cfm_module.odeint is torchdiffeq.odeint


def test_a_concurrent_cache_true_call_is_unaffected():
    """Thread A (cache=False, checkpoint_steps) holds its shadows while thread B samples the same model
    with cache=True: B must get upstream's output bit for bit, A the reference gradients."""
    model = make().eval()
    cond, text = inputs()
    kw = dict(duration=20, steps=3, cfg_strength=2.0, seed=3)
    want_b, _ = upstream_sample()(model, cond, text, **kw)
    want_a = reference_grads(model, cond, text, **kw)
    order, got = Interleaved(), {}

    def run_a():
        got["a"] = patched_grads(model, cond, text, checkpoint_steps=True, **kw)

    def run_b():
        got["b"], _ = model.sample(cond, text, **kw)
        model.transformer.__dict__.pop("_cache_local", None)  # B's own upstream cache write

    handle = model.transformer.register_forward_pre_hook(order.pause)
    with gradpatch.applied("f5_tts"):
        order.run(run_a, run_b)
    handle.remove()
    assert torch.equal(got["b"], want_b)
    assert_grads_equal(got["a"], want_a)
    assert "eval" not in vars(model) and cfm_module.odeint.__module__.startswith("torchdiffeq")
    cache_is_clean(model.transformer)


def test_distilling_a_student_lowers_its_loss():
    teacher = make(seed=1)
    student = make(seed=2, dropout=0.0).train()
    cond, text = inputs()
    kw = dict(duration=16, steps=2, cfg_strength=2.0, seed=11)
    with gradpatch.applied("f5_tts"):
        target, _ = teacher.sample(cond, text, **kw)  # cache=True: plain inference
        optimiser = torch.optim.Adam(student.transformer.parameters(), lr=3e-3)
        losses = []
        for _ in range(12):
            out, _ = student.sample(cond, text, cache=False, **kw)
            loss = torch.nn.functional.mse_loss(out, target)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        ema = copy.deepcopy(student)  # the usual EMA copy still works
    assert student.training and ema is not None
    assert losses[-1] < 0.7 * losses[0], losses


# --- older version families, in one interpreter of their own -----------------------------------------

# Every f5-tts release on PyPI (1.1.18 and 1.1.19 were tagged but never published; 1.1.19's cfm.py is
# byte-identical to 1.1.20's, so its fingerprint is checked through that wheel).
PUBLISHED = ["0.3.4", "0.6.2", "1.0.0", "1.0.3", "1.0.8", "1.1.0", "1.1.4", "1.1.5", "1.1.6", "1.1.7", "1.1.8",
             "1.1.9", "1.1.10", "1.1.15", "1.1.16", "1.1.17", "1.1.20", "1.1.21", "1.1.22"]

# One interpreter checks every family in turn: torch and F5's dependencies are imported once, f5_tts
# itself is purged from sys.modules and imported again from the next directory. The first family is
# patched as it is imported (apply() before the import), the others after (apply() on a loaded module).
CHECK = r"""
import contextlib, inspect, os, sys, types, torch
torch.set_num_threads(1)
import gradpatch
from release_check import main, switch_to

def load(root):
    switch_to(root, "f5_tts")
    # f5_tts.model's __init__ also imports the trainer (datasets, wandb, ...): skip it, import what
    # sample() needs.
    package = types.ModuleType("f5_tts.model")
    package.__path__ = [os.path.join(root, "f5_tts", "model")]
    sys.modules["f5_tts.model"] = package
    from f5_tts.model import cfm
    from f5_tts.model.backbones.dit import DiT
    return cfm, DiT

def run(cfm_module, DiT):
    CFM = cfm_module.CFM
    raw, original = inspect.unwrap(CFM.sample), CFM.sample.__wrapped__
    torch.manual_seed(0)
    net = DiT(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, mel_dim=16, text_num_embeds=32, text_dim=16)
    with torch.no_grad():
        for p in net.parameters():
            if not p.any():
                p.normal_(std=0.05)
    model = CFM(transformer=net, mel_spec_kwargs=dict(n_mel_channels=16)).eval()
    g = torch.Generator().manual_seed(1)
    cond, text = torch.randn(1, 8, 16, generator=g), torch.randint(0, 32, (1, 6), generator=g)
    kw = dict(duration=20, steps=3, cfg_strength=2.0, seed=3)
    calls = [0]

    @contextlib.contextmanager
    def hooks(no_grad_calls=0):
        calls[0] = 0
        def pre(module, args, kwargs):
            if "cache" in kwargs:
                kwargs["cache"] = False
            calls[0] += 1
            if calls[0] <= no_grad_calls:
                torch.set_grad_enabled(False)
            return args, kwargs
        def post(*args):
            torch.set_grad_enabled(True)
        handles = [net.register_forward_pre_hook(pre, with_kwargs=True), net.register_forward_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def grads(out, c):
        model.zero_grad()
        (out * torch.linspace(-1, 1, out.shape[-1])).square().mean().backward()
        return [p.grad.clone() for p in net.parameters()] + [c.grad.clone()]

    def reference(no_grad_calls=0):
        c = cond.clone().requires_grad_(True)
        with hooks(no_grad_calls), torch.enable_grad():
            out, _ = raw(model, c, text, **kw)
        return grads(out, c)

    def patched(**options):
        c = cond.clone().requires_grad_(True)
        out, _ = model.sample(c, text, cache=False, **options, **kw)
        return grads(out, c)

    def close(a, b):
        return all(torch.allclose(x, y, rtol=1e-5, atol=1e-8) for x, y in zip(a, b))

    want = reference()
    per_step = calls[0] // kw["steps"]
    got = patched()
    result = dict(
        file=cfm_module.__file__,
        records={r.patch: [str(r.status), r.variant, r.version] for r in gradpatch.report()},
        grads=close(got, want) and all(bool(torch.isfinite(x).all()) for x in got),
        per_step=per_step,
        grad_steps=close(patched(grad_steps=1), reference(no_grad_calls=(kw["steps"] - 1) * per_step)),
        checkpoint=close(patched(checkpoint_steps=True), want),
    )
    model.train()
    out, _ = model.sample(cond, text, cache=False, **kw)
    result["train_kept"] = model.training and out.grad_fn is not None
    model.train()
    a, _ = model.sample(cond, text, **kw)
    model.train()
    b, _ = original(model, cond, text, **kw)
    result["cache_true_equal"] = bool(torch.equal(a, b)) and not model.training
    result["cache_clean"] = (getattr(net, "text_cond", None) is None
                             and not {"forward", "clear_cache", "eval"} & (vars(net).keys() | vars(model).keys()))
    return result

main("f5_tts", load, lambda loaded: run(*loaded))
"""


FAMILIES = {  # family label -> (PyPI version tested, fingerprint, transformer calls per Euler step with CFG)
    "f5-tts 0.x": ("0.6.2", "2b1f6863e33517df", 2),
    "f5-tts 1.0.0–1.1.5": ("1.1.4", "fdc19253b2ba73fc", 2),
    "f5-tts 1.1.6–1.1.18": ("1.1.15", "442a5972be99d634", 1),
}


@pytest.fixture(scope="module", autouse=True)
def families(request):
    yield from BackgroundCheck.fixture(request, CHECK, {
        family: (lambda v=version: pypi_release(f"f5-tts=={v}", "jieba")) for family, (version, _, _) in FAMILIES.items()})


CHECKED = ("grads", "grad_steps", "checkpoint", "train_kept", "cache_true_equal", "cache_clean")


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_older_family(family, families):
    version, fingerprint, per_step = FAMILIES[family]
    path, result = families.result(family)
    source = (path / "f5_tts" / "model" / "cfm.py").read_text(encoding="utf-8")
    assert fingerprint_source(source, ["CFM.sample"]) == fingerprint
    assert KNOWN[fingerprint].startswith(family + " · ")
    assert result["file"].startswith(str(path))
    assert result["records"]["f5_tts.sample"] == ["applied", KNOWN[fingerprint], version]
    assert result["per_step"] == per_step
    assert [key for key in CHECKED if not result[key]] == []


def published(label: str) -> list[str]:
    """The PyPI versions a catalogue label names (``PyPI f5-tts 1.0.0, 1.1.6–1.1.10 and git ...``)."""
    if "PyPI f5-tts " not in label:
        return []
    listed = label.split("PyPI f5-tts ", 1)[1].split(" (", 1)[0].split(" and ", 1)[0]
    return [item.strip() for item in listed.split(",")]


@pytest.mark.slow
def test_every_published_release_is_catalogued():
    """The fingerprint of every release's CFM.sample is known, under a label that names its version."""
    import zipfile

    from packaging.version import Version

    wheels = pypi_wheels("f5-tts", PUBLISHED)
    if isinstance(wheels, str):
        pytest.skip(wheels)
    assert sorted(w.name.split("-")[1] for w in wheels) == sorted(PUBLISHED)
    for wheel in wheels:
        version = Version(wheel.name.split("-")[1])
        with zipfile.ZipFile(wheel) as archive:
            digest = fingerprint_source(archive.read("f5_tts/model/cfm.py").decode(), ["CFM.sample"])
        assert digest in KNOWN, (version, digest)
        spans = [item.partition("–") for item in published(KNOWN[digest])]
        assert any(Version(low) <= version <= Version(high or low) for low, _, high in spans), (version, KNOWN[digest])
