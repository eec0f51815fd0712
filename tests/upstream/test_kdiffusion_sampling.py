"""Differentiable k-diffusion samplers against the real upstream (k-diffusion 0.1.1.post1 here).

The denoiser is k-diffusion's own ``k_diffusion.layers.Denoiser`` (Karras preconditioning) around a
tiny random convolutional network with dropout; no weights, no downloads. Every one of the 13
``sample_*`` functions is checked:

* ``cache=True`` is the upstream function bit for bit (no graph), and upstream itself gives no graph.
* ``cache=False`` gradients (every parameter and the input noise) equal those of the undecorated
  upstream body (``inspect.unwrap``) run with grad on, to 1e-5 relative.
* ``checkpoint_steps=True`` gives the same gradients (in train mode with dropout: the recompute replays
  the RNG) and autograd saves fewer bytes during the forward (``saved_tensors_hooks``).
* ``grad_steps=K`` (fixed-step samplers) equals the undecorated body with a ``model`` wrapper that runs
  the first calls under ``no_grad``: as many as the first N-K steps make, counted from the algorithm
  (Heun, DPM-2, DPM-2 ancestral, DPM++ 2S ancestral and DPM++ SDE make two calls per step and one in the
  last, whose next sigma is 0; the others one), not from the fix's loop tracking. The total number of
  calls is checked against that count. The parameters' gradients equal the reference's and the noise
  gets none: the latent entering step N-K is detached. The two adaptive samplers refuse ``grad_steps``.

Slow: every PyPI release's samplers (0.0.3 to 0.1.1.post1, wheels) hash to catalogue entries whose
labels span that release; 0.0.5, 0.0.7, 0.0.10 and 0.0.15, which carry every fingerprint 0.0.16 on
does not, are installed ``--no-deps`` (with resize-right, which they import) and checked the same way in
one background interpreter; ``GRADPATCH=1`` alone patches on import in a fresh interpreter.
"""
from __future__ import annotations

import inspect
import warnings

import pytest

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # clip-anytorch imports pkg_resources, which warns of its removal
    K = pytest.importorskip("k_diffusion")

import gradpatch  # noqa: E402
from support import (BackgroundCheck, Interleaved, assert_grads_equal, last_json, pypi_release,  # noqa: E402
                      pypi_wheels, run_python)
from saved_memory import saved_bytes_at_backward  # noqa: E402
from gradpatch.patching.activation import known_patches  # noqa: E402
from gradpatch.patching.fingerprint import fingerprint_module  # noqa: E402
from gradpatch.sampling import run as sampling
from gradpatch.sampling.families import functions as function_sampler  # noqa: E402
from k_diffusion import sampling as kd  # noqa: E402
from tqdm import trange  # noqa: E402  (the fake sampler below loops like upstream)

pytestmark = pytest.mark.usefixtures("single_thread")

TWO_CALLS = {"sample_heun", "sample_dpm_2", "sample_dpm_2_ancestral", "sample_dpmpp_2s_ancestral", "sample_dpmpp_sde"}
ADAPTIVE = {"sample_dpm_fast", "sample_dpm_adaptive"}
ALL = [name for name in vars(kd) if name.startswith("sample_")]
FIXED = [name for name in ALL if name not in ADAPTIVE]
STEPS, SIGMA_MIN, SIGMA_MAX = 4, 0.05, 5.0
SIGMAS = kd.get_sigmas_karras(STEPS, SIGMA_MIN, SIGMA_MAX)


class Tiny(torch.nn.Module):
    """``inner_model(x, sigma)`` for ``K.layers.Denoiser``: two convolutions, a sigma embedding, dropout."""

    def __init__(self, channels=2, hidden=16, dropout=0.0):
        super().__init__()
        self.inp = torch.nn.Conv1d(channels, hidden, 3, padding=1)
        self.emb = torch.nn.Linear(1, hidden)
        self.drop = torch.nn.Dropout(dropout)
        self.out = torch.nn.Conv1d(hidden, channels, 3, padding=1)

    def forward(self, x, sigma):
        h = self.inp(x) + self.emb(sigma.reshape(-1, 1).log())[..., None]
        return self.out(self.drop(torch.tanh(h)))


def make(dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return K.layers.Denoiser(Tiny(dropout=dropout), sigma_data=0.5)


NOISE = torch.randn(2, 2, 12, generator=torch.Generator().manual_seed(1))


def call(fn, model, x, name, **options):
    if name == "sample_dpm_fast":
        return fn(model, x, SIGMA_MIN, SIGMA_MAX, 5, disable=True, **options)
    if name == "sample_dpm_adaptive":
        return fn(model, x, SIGMA_MIN, SIGMA_MAX, rtol=0.1, atol=0.1, disable=True, **options)
    return fn(model, x, SIGMAS, disable=True, **options)


def grads(model, name, fn=None, denoiser=None, **options):
    """Gradients of a fixed loss over every parameter of ``model`` and the input noise, sampling with
    ``fn`` (default: ``kd.<name>`` as currently installed) and ``denoiser`` (default: ``model``).
    Seeded: the ancestral and SDE samplers draw noise."""
    fn = fn or getattr(kd, name)
    x = (NOISE * SIGMA_MAX).requires_grad_(True)
    torch.manual_seed(3)
    out = call(fn, denoiser or model, x, name, **options)
    assert out.grad_fn is not None
    loss = (out * torch.linspace(-1, 2, out.shape[-1])).square().mean()
    model.zero_grad()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    return [p.grad.clone() for p in model.parameters()] + [None if x.grad is None else x.grad.clone()]


def reference(model, name, no_grad_calls=0):
    """The undecorated upstream body, grad on, its first ``no_grad_calls`` model calls under no_grad.
    Returns the gradients and how many calls the body made."""
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        with torch.set_grad_enabled(calls[0] > no_grad_calls):
            return model(*args, **kwargs)

    with torch.enable_grad():
        got = grads(model, name, fn=inspect.unwrap(getattr(kd, name)), denoiser=counted)
    return got, calls[0]


def calls_per_step(name):
    """Model calls in each of the STEPS steps, from the algorithm (the last sigma is 0)."""
    return [2] * (STEPS - 1) + [1] if name in TWO_CALLS else [1] * STEPS


@pytest.fixture(scope="module", autouse=True)
def patched():
    """Applied once for the module: applying walks every loaded module's globals to rebind (about a
    second per apply with k-diffusion's imports loaded)."""
    gradpatch.apply("k_diffusion")
    yield
    gradpatch.revert("k_diffusion")


def upstream(name):
    """``kd.<name>`` as upstream defines it."""
    fn = getattr(kd, name)
    return fn.__wrapped__ if "gradpatch" in fn.__code__.co_filename else fn  # wraps() copied the names


def test_every_sampler_is_patched_and_reverted():
    assert sorted(ALL) == sorted(n.split(".", 1)[1] for n in known_patches() if n.startswith("k_diffusion."))
    records = {r.patch: r for r in gradpatch.report()}
    originals = {name: upstream(name) for name in ALL}
    for name in ALL:
        record = records[f"k_diffusion.{name}"]
        assert record.status == "applied" and record.version == "0.1.1.post1"
        assert "–0.1.1.post1 · PyPI k-diffusion" in record.variant
        digest = fingerprint_module(kd, [name])
        assert known_patches()[f"k_diffusion.{name}"].recognise.known[digest] == record.variant
        patched = getattr(kd, name)
        assert patched is not originals[name] and patched.__wrapped__ is originals[name]
        params = inspect.signature(patched).parameters
        for keyword, default in [("cache", True), ("grad_steps", None), ("checkpoint_steps", False)]:
            assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY and params[keyword].default == default
    gradpatch.revert("k_diffusion")
    try:
        assert {name: getattr(kd, name) for name in ALL} == originals
    finally:
        gradpatch.apply("k_diffusion")


@pytest.mark.parametrize("name", ALL)
def test_cache_true_is_upstream_bit_for_bit(name):
    model = make()
    x = (NOISE * SIGMA_MAX).requires_grad_(True)
    torch.manual_seed(5)
    want = call(upstream(name), model, x, name)
    assert want.grad_fn is None  # upstream: no graph, whatever the caller's grad mode
    torch.manual_seed(5)
    got = call(getattr(kd, name), model, x, name)
    assert torch.equal(got, want) and got.grad_fn is None


@pytest.mark.parametrize("name", ALL)
def test_cache_false_gradients_equal_the_unwrapped_body(name):
    model = make().eval()
    with pytest.raises(AssertionError):
        grads(model, name, fn=upstream(name))  # upstream: the output has no graph
    want, _ = reference(model, name)
    got = grads(model, name, cache=False)
    assert_grads_equal(got, want)
    assert sampling.active_options() is None


@pytest.mark.parametrize("name", ALL)
def test_checkpoint_steps_equal_gradients_with_fewer_saved_bytes(name):
    model = make(dropout=0.2).train()  # dropout on: the recompute must replay the RNG
    plain, plain_bytes = saved_bytes_at_backward(model, lambda: grads(model, name, cache=False))
    checkpointed, checkpointed_bytes = saved_bytes_at_backward(model, lambda: grads(model, name, cache=False, checkpoint_steps=True))
    assert model.training
    assert_grads_equal(checkpointed, plain)
    assert checkpointed_bytes < plain_bytes, (checkpointed_bytes, plain_bytes)


@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("k", [1, 2])
def test_grad_steps_equals_a_reference_with_early_calls_under_no_grad(name, k):
    model = make().eval()
    per_step = calls_per_step(name)
    want, total_calls = reference(model, name, no_grad_calls=sum(per_step[:STEPS - k]))
    assert total_calls == sum(per_step)  # the per-step count the reference relies on
    full, _ = reference(model, name)
    got = grads(model, name, cache=False, grad_steps=k)
    both = grads(model, name, cache=False, grad_steps=k, checkpoint_steps=True)
    everything = grads(model, name, cache=False, grad_steps=STEPS)
    # A graph only through the last K steps: the latent entering step N-K is detached, so the noise
    # gets no gradient (the reference's early no_grad calls still leave it the state's identity path)
    # and the parameters get those of the last K steps' calls.
    assert got[-1] is None and both[-1] is None and want[-1] is not None
    assert_grads_equal(got[:-1], want[:-1])
    assert_grads_equal(both[:-1], want[:-1])
    assert_grads_equal(everything, full)  # K >= N is the plain run
    assert any(not torch.allclose(g, f) for g, f in zip(got[:-1], full[:-1]))  # truncation did something
    assert kd.trange.__module__.startswith("tqdm")  # the loop shadow lasted the call only


@pytest.mark.parametrize("name", sorted(ADAPTIVE))
def test_adaptive_samplers_refuse_grad_steps(name):
    model = make()
    with pytest.raises(ValueError, match="chooses its steps as it goes.*checkpoint_steps"):
        call(getattr(kd, name), model, NOISE, name, cache=False, grad_steps=1)
    assert sampling.active_options() is None


def test_modes_and_bad_options():
    model = make(dropout=0.2).train()
    with torch.no_grad():
        out = kd.sample_heun(model, NOISE, SIGMAS, disable=True, cache=False)
        assert not torch.is_grad_enabled()
    assert out.grad_fn is not None and all(m.training for m in model.modules())
    with pytest.raises(ValueError, match="cache=False"):
        kd.sample_euler(model, NOISE, SIGMAS, disable=True, grad_steps=1)
    with pytest.raises(ValueError, match="positive"):
        kd.sample_euler(model, NOISE, SIGMAS, disable=True, cache=False, grad_steps=0)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        kd.sample_euler(model, NOISE, SIGMAS, disable=True, cache=False)
    with pytest.raises(TypeError):
        kd.sample_euler(model, NOISE, SIGMAS, disable=True, cache=False, bogus=1)
    with pytest.raises(TypeError, match="True or False"):
        kd.sample_euler(model, NOISE, SIGMAS, disable=True, cache="False")
    with pytest.raises(TypeError, match="grad_steps"):
        kd.sample_euler(model, NOISE, SIGMAS, disable=True, cache=False, grad_steps=True)
    assert sampling.active_options() is None


def test_a_sampler_inside_a_denoiser_follows_the_outer_call():
    """A patched sampler called without ``cache=`` inside another's ``cache=False`` call builds a graph;
    called from the outer denoiser, its evaluations belong to the outer step (no_grad or checkpointed
    with it). Gradients equal the same composition of undecorated bodies."""
    model = make().eval()

    def nested(sample_heun):
        def denoiser(x, sigma):  # refines with a Heun run of its own
            return sample_heun(model, x, SIGMAS[-3:], disable=True) * sigma.reshape(-1, 1, 1).tanh()
        return denoiser

    with torch.enable_grad():
        want = grads(model, "sample_euler", fn=inspect.unwrap(kd.sample_euler),
                     denoiser=nested(inspect.unwrap(kd.sample_heun)))
    for options in ({}, {"checkpoint_steps": True}):
        got = grads(model, "sample_euler", denoiser=nested(kd.sample_heun), cache=False, **options)
        assert_grads_equal(got, want)
    got = grads(model, "sample_euler", denoiser=nested(kd.sample_heun), cache=False, grad_steps=1)
    assert not any(torch.allclose(g, w) for g, w in zip(got[:-1], want[:-1]))


@torch.no_grad()
def evaluates_before_its_loop(model, x, sigmas):
    x = model(x, sigmas[0] * x.new_ones([x.shape[0]]))
    for i in trange(len(sigmas) - 1, disable=True):
        x = model(x, sigmas[i] * x.new_ones([x.shape[0]]))
    return x


@torch.no_grad()
def two_loops(model, x, sigmas):
    for _ in range(2):
        for i in trange(len(sigmas) - 1, disable=True):
            x = model(x, sigmas[i] * x.new_ones([x.shape[0]]))
    return x


def test_grad_steps_refuses_to_guess_the_step():
    """Engine checks on stand-in samplers: an evaluation outside the loop, or a second loop, raises."""
    model = make()
    for body in (evaluates_before_its_loop, two_loops):
        fixed = function_sampler.fixed_step_sampler(body)
        with pytest.raises(RuntimeError, match="grad_steps"):
            fixed(model, NOISE, SIGMAS, cache=False, grad_steps=1)
        assert fixed(model, NOISE, SIGMAS, cache=False, checkpoint_steps=True).grad_fn is not None
    assert trange.__module__.startswith("tqdm") and sampling.active_options() is None


def test_changed_code_is_unknown_and_a_cache_flag_is_fixed_upstream():
    import inspect as inspect_module

    from gradpatch.patching.fingerprint import fingerprint_source

    recognise = known_patches()["k_diffusion.sample_euler"].recognise
    source = inspect_module.getsource(kd).replace("x = x + d * dt", "x = x + d * dt * 1.0", 1)
    assert fingerprint_source(source, ["sample_euler"]) not in recognise.known

    def sample_euler(model, x, sigmas, extra_args=None, *, cache=True):
        """Stands in for a release that takes ``cache`` itself."""

    assert recognise.identify(kd, "sample_euler", sample_euler).verdict == "fixed"


def test_a_concurrent_cache_true_call_is_unaffected():
    """Thread A (``grad_steps``: the loop globals shadowed) pauses inside its loop while thread B samples
    the same model with ``cache=True``: B gets upstream's output bit for bit, A the reference gradients."""
    model = make().eval()
    torch.manual_seed(5)
    want_b = upstream("sample_dpmpp_2m")(model, NOISE, SIGMAS, disable=True)
    per_step = calls_per_step("sample_dpmpp_2m")
    want_a, _ = reference(model, "sample_dpmpp_2m", no_grad_calls=sum(per_step[:-1]))
    order, got = Interleaved(), {}

    def pausing(*args, **kwargs):
        order.pause()
        return model(*args, **kwargs)

    def run_a():
        got["a"] = grads(model, "sample_dpmpp_2m", denoiser=pausing, cache=False, grad_steps=1)

    def run_b():
        assert kd.trange is not upstream_trange  # A's shadow is in place
        torch.manual_seed(5)
        got["b"] = kd.sample_dpmpp_2m(model, NOISE, SIGMAS, disable=True)

    upstream_trange = kd.trange
    order.run(run_a, run_b)
    assert torch.equal(got["b"], want_b)
    assert got["a"][-1] is None  # grad_steps=1: the latent entering the last step is detached
    assert_grads_equal(got["a"][:-1], want_a[:-1])
    assert kd.trange is upstream_trange


@pytest.mark.slow
def test_gradpatch_1_alone_patches_k_diffusion_on_import():
    """A fresh interpreter with ``GRADPATCH=1`` and no call to gradpatch: the samplers are patched as
    k-diffusion is imported, with no gradpatch warning."""
    result = run_python("""
        import json, warnings
        warnings.simplefilter("ignore", UserWarning)  # pkg_resources, from clip-anytorch
        import torch
        import k_diffusion
        from k_diffusion.sampling import sample_dpm_2, get_sigmas_karras
        import gradpatch
        torch.manual_seed(0)
        model = k_diffusion.layers.Denoiser(torch.nn.Conv1d(2, 2, 3, padding=1))
        model.inner_model.forward = lambda x, sigma: torch.nn.Conv1d.forward(model.inner_model, x)
        out = sample_dpm_2(model, torch.randn(1, 2, 8), get_sigmas_karras(3, 0.1, 5.0), disable=True,
                           cache=False, grad_steps=1)
        out.sum().backward()
        print(json.dumps([model.inner_model.weight.grad is not None,
                          sorted({str(r.status) for r in gradpatch.report() if r.upstream == "k_diffusion"})]))
    """, env={"GRADPATCH": "1"})
    assert last_json(result) == [True, ["applied"]]
    assert "gradpatch" not in result.stderr, result.stderr


# --- older releases ------------------------------------------------------------------------------------

PUBLISHED = ["0.0.3", "0.0.4", "0.0.5", "0.0.6", "0.0.7", "0.0.8", "0.0.9", "0.0.10", "0.0.11", "0.0.12",
             "0.0.13", "0.0.14", "0.0.15", "0.0.16", "0.1.0", "0.1.1", "0.1.1.post1"]
OLDER = ["0.0.5", "0.0.7", "0.0.10", "0.0.15"]  # together they carry every fingerprint 0.0.16+ does not


@pytest.mark.slow
def test_every_published_release_is_catalogued():
    """Every ``sample_*`` of every PyPI release hashes to a known fingerprint whose label spans it."""
    import ast
    import zipfile

    from gradpatch.patching.fingerprint import fingerprint_source
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    wheels = pypi_wheels("k-diffusion", PUBLISHED)
    if isinstance(wheels, str):
        pytest.skip(wheels)
    assert sorted(w.name.split("-")[1] for w in wheels) == sorted(PUBLISHED)
    patches = known_patches()
    for wheel in wheels:
        version = Version(wheel.name.split("-")[1])
        source = zipfile.ZipFile(wheel).read("k_diffusion/sampling.py").decode()
        names = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name.startswith("sample_")]
        assert names and set(names) <= set(ALL)
        for name in names:
            patch = patches[f"k_diffusion.{name}"]
            label = patch.recognise.known[fingerprint_source(source, [name])]
            low, _, high = label.split(" ")[1].partition("–")
            assert Version(low) <= version <= Version(high or low), (version, name, label)
            assert SpecifierSet(patch.requires.partition("k-diffusion")[2]).contains(version)  # in range


CHECK = r"""
import inspect, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
from release_check import main, switch_to

TWO_CALLS = %(two_calls)r
STEPS = 4
NOISE = torch.randn(2, 2, 12, generator=torch.Generator().manual_seed(1))


class Denoiser(torch.nn.Module):  # Karras preconditioning around two convolutions
    def __init__(self):
        super().__init__()
        self.inp, self.emb = torch.nn.Conv1d(2, 16, 3, padding=1), torch.nn.Linear(1, 16)
        self.out = torch.nn.Conv1d(16, 2, 3, padding=1)

    def forward(self, x, sigma):
        s = sigma.reshape(-1, 1, 1)
        h = self.inp(x / (s ** 2 + 0.25).sqrt()) + self.emb(sigma.reshape(-1, 1).log())[..., None]
        return x * 0.25 / (s ** 2 + 0.25) + self.out(torch.tanh(h)) * s * 0.5 / (s ** 2 + 0.25).sqrt()


def load(root):
    switch_to(root, "k_diffusion")
    from k_diffusion import sampling
    return sampling


def run(kd):
    torch.manual_seed(0)
    model = Denoiser()
    sigmas = kd.get_sigmas_karras(STEPS, 0.05, 5.0)
    def call(fn, denoiser, x, name, **options):
        if name == "sample_dpm_fast":
            return fn(denoiser, x, 0.05, 5.0, 5, disable=True, **options)
        if name == "sample_dpm_adaptive":
            return fn(denoiser, x, 0.05, 5.0, rtol=0.1, atol=0.1, disable=True, **options)
        return fn(denoiser, x, sigmas, disable=True, **options)
    def grads(fn, name, denoiser=None, **options):
        x = (NOISE * 5).requires_grad_(True)
        torch.manual_seed(3)
        out = call(fn, denoiser or model, x, name, **options)
        if out.grad_fn is None:
            return None
        model.zero_grad()
        (out * torch.linspace(-1, 2, out.shape[-1])).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()] + [None if x.grad is None else x.grad.clone()]
    def close(a, b):
        return a is not None and b is not None and all(
            bool(torch.isfinite(u).all()) and torch.allclose(u, v, rtol=1e-5, atol=1e-8) for u, v in zip(a, b))
    results = {}
    for name in [n for n in vars(kd) if n.startswith("sample_")]:
        fn = getattr(kd, name)
        if "gradpatch" not in fn.__code__.co_filename:
            results[name] = {"patched": False}
            continue
        raw, calls = inspect.unwrap(fn), [0]
        def counted_by(no_grad_calls):
            calls[0] = 0
            def counted(*args, **kwargs):
                calls[0] += 1
                with torch.set_grad_enabled(calls[0] > no_grad_calls):
                    return model(*args, **kwargs)
            return counted
        result = {"patched": True}
        torch.manual_seed(5)
        want = call(fn.__wrapped__, model, NOISE * 5, name)
        torch.manual_seed(5)
        result["cache_true_equal"] = bool(torch.equal(call(fn, model, NOISE * 5, name), want)) and want.grad_fn is None
        with torch.enable_grad():
            reference = grads(raw, name, counted_by(0))
        result["grads"] = close(grads(fn, name, cache=False), reference)
        result["checkpoint"] = close(grads(fn, name, cache=False, checkpoint_steps=True), reference)
        if name in ("sample_dpm_fast", "sample_dpm_adaptive"):
            try:
                call(fn, model, NOISE, name, cache=False, grad_steps=1)
                result["refuses_grad_steps"] = False
            except ValueError:
                result["refuses_grad_steps"] = True
        else:
            per_step = [2] * (STEPS - 1) + [1] if name in TWO_CALLS else [1] * STEPS
            with torch.enable_grad():
                truncated = grads(raw, name, counted_by(sum(per_step[:-1])))
            result["calls_per_step"] = calls[0] == sum(per_step)
            got = grads(fn, name, cache=False, grad_steps=1)  # the latent entering the last step detached
            result["grad_steps"] = got is not None and got[-1] is None and close(got[:-1], truncated[:-1])
        results[name] = result
    return results

main("k_diffusion", load, run)
""" % {"two_calls": sorted(TWO_CALLS)}


@pytest.fixture(scope="module", autouse=True)
def older(request):  # autouse: the interpreter starts with the module and overlaps the fast tests
    yield from BackgroundCheck.fixture(request, CHECK, {
        version: (lambda v=version: pypi_release(f"k-diffusion=={v}", "resize-right==0.0.2")) for version in OLDER})


@pytest.mark.slow
@pytest.mark.parametrize("version", OLDER)
def test_older_release(version, older):
    path, results = older.result(version)
    for name, result in results.items():
        assert result.pop("patched"), name
        assert [key for key, ok in result.items() if not ok] == [], (version, name)
    assert "sample_euler" in results and len(results) >= 8
