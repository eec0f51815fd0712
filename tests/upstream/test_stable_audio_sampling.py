"""Differentiable stable-audio-tools samplers against the real releases 0.0.19 and 0.0.20.

Both pin old torch (0.0.20 also Python < 3.11), so each is installed from PyPI ``--no-deps`` into the
test cache (``GRADPATCH_TEST_CACHE``) and checked in one background interpreter (they import and run on
this environment; 0.0.19 imports the installed k-diffusion). The denoiser is a tiny random network
called as stable-audio-tools calls its backbone, ``model(x, t, cfg_scale=..., batch_cfg=..., ...)``.

* 0.0.19: its own ``@torch.no_grad()`` samplers ``sample_discrete_euler``, ``sample_rk4``,
  ``sample_flow_dpmpp``, ``sample_flow_pingpong`` and ``sample`` (v-diffusion).
* 0.0.20: ``sample_diffusion`` for every sampler type: the rectified-flow samplers (euler, rk4, dpmpp,
  pingpong) and v-ddim in its own module, and the 9 k-diffusion types, which run the vendored
  ``stable_audio_tools.inference.k_diffusion.sampling`` (patched too) inside ``sample_diffusion``'s call.

For each: ``cache=True`` equals the original bit for bit and upstream gives no graph (0.0.20's
``sample_diffusion`` also passes an unknown ``cache=False`` on to the model silently); ``cache=False``
gradients (every parameter and the input noise) equal the undecorated bodies run with grad on (for
0.0.20, ``sample_diffusion`` and the vendored samplers it calls all unwrapped by hand), to 1e-5;
``checkpoint_steps`` gives equal gradients in train mode with dropout and saves fewer bytes;
``grad_steps=1`` gives the parameters that reference's gradients with the model calls of the first N-1
steps under ``no_grad``, and the noise none (the latent entering the last step is detached),
the calls per step taken from the algorithms (RK4 four; Heun, DPM-2, DPM++ 2S two except the last) and
their total checked. The adaptive k-diffusion types refuse ``grad_steps``.
"""
from __future__ import annotations

import pytest

from support import BackgroundCheck, pypi_release

pytestmark = pytest.mark.slow

CHECK = r"""
import contextlib, inspect, json, sys, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
import gradpatch
from release_check import main, switch_to
from saved_memory import saved_bytes_at_backward

STEPS = 4
NOISE = torch.randn(2, 2, 12, generator=torch.Generator().manual_seed(1))
seen_keywords = set()


class Tiny(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.inp = torch.nn.Conv1d(2, 16, 3, padding=1)
        self.emb = torch.nn.Linear(1, 16)
        self.drop = torch.nn.Dropout(dropout)
        self.out = torch.nn.Conv1d(16, 2, 3, padding=1)

    def forward(self, x, t, cfg_scale=1.0, batch_cfg=False, rescale_cfg=False, padding_mask=None,
                apg_scale=1.0, **rest):  # the backbone swallows unknown keywords, as DiT wrappers do
        seen_keywords.update(rest)
        h = self.inp(x) + self.emb(t.reshape(-1, 1).to(x.dtype))[..., None]
        return self.out(self.drop(torch.tanh(h)))


def make(dropout=0.0):
    torch.manual_seed(0)
    return Tiny(dropout)


def grads(model, fn, denoiser=None, **options):
    x = NOISE.to(torch.get_default_dtype(), copy=True).requires_grad_(True)
    torch.manual_seed(3)
    out = fn(denoiser or model, x, **options)
    if out.grad_fn is None:
        return None
    model.zero_grad()
    (out * torch.linspace(-1, 2, out.shape[-1])).square().mean().backward()
    if any(p.grad is None for p in model.parameters()):
        return None
    return [p.grad.clone() for p in model.parameters()] + [None if x.grad is None else x.grad.clone()]


def close(a, b):
    return a is not None and b is not None and len(a) == len(b) and all(
        bool(torch.isfinite(x).all()) and torch.allclose(x, y, rtol=1e-5, atol=1e-8) for x, y in zip(a, b))


def check(patched, original, unwrapped, per_step, adaptive=False):
    # patched/original: (model, x, **options) -> output, with the patched and the original sampler;
    # unwrapped: (model, x, wrap) -> output, the by-hand undecorated sampler with wrap() applied to the
    # denoiser its step loop evaluates; per_step: calls of that denoiser in each step, from the algorithm
    # (dpm_fast: n evaluations in all).
    result = {}
    model = make().eval()
    torch.manual_seed(5)
    want = original(model, NOISE)
    torch.manual_seed(5)
    got = patched(model, NOISE)
    result["cache_true_equal"] = bool(torch.equal(got, want)) and got.grad_fn is None
    result["upstream_no_graph"] = grads(model, original) is None
    calls = [0]
    def counted_by(no_grad_calls):  # wraps a denoiser: its first no_grad_calls calls under no_grad
        calls[0] = 0
        def wrap(denoiser):
            def counted(*args, **kwargs):
                calls[0] += 1
                with torch.set_grad_enabled(calls[0] > no_grad_calls):
                    return denoiser(*args, **kwargs)
            return counted
        return wrap
    def reference(no_grad_calls):
        with torch.enable_grad():
            return grads(model, lambda m, x: unwrapped(m, x, counted_by(no_grad_calls)))
    reference_grads = reference(0)
    result["calls_per_step"] = per_step is None or calls[0] == sum(per_step)
    seen_keywords.clear()
    result["grads"] = close(grads(model, patched, cache=False), reference_grads)
    result["no_keyword_reaches_the_model"] = not seen_keywords & {"cache", "grad_steps", "checkpoint_steps"}
    if adaptive:
        try:
            patched(model, NOISE, cache=False, grad_steps=1)
            result["refuses_grad_steps"] = False
        except ValueError as error:
            result["refuses_grad_steps"] = "chooses its steps" in str(error)
    else:
        truncated = reference(sum(per_step[:-1]))
        # A graph only through the last step: the latent entering it is detached, so the noise gets no
        # gradient (the reference's early no_grad calls still leave it the state's identity path) and the
        # parameters get those of the last step's calls.
        def last_step_only(got):
            return got is not None and got[-1] is None and close(got[:-1], truncated[:-1])
        got = grads(model, patched, cache=False, grad_steps=1)
        result["grad_steps"] = last_step_only(got)
        result["grad_steps_truncated"] = got is not None and not close(got[:-1], reference_grads[:-1])
        result["grad_steps_and_checkpoint"] = last_step_only(
            grads(model, patched, cache=False, grad_steps=1, checkpoint_steps=True))
    # In float64: a recomputed evaluation's gradients are summed in another order than one graph sums
    # them, and through a sampler's steps fp32 rounding alone reaches 1e-5 of the largest gradient.
    torch.set_default_dtype(torch.float64)
    try:
        model = make(dropout=0.2).train()
        plain, plain_bytes = saved_bytes_at_backward(model, lambda: grads(model, patched, cache=False))
        ckpt, ckpt_bytes = saved_bytes_at_backward(model, lambda: grads(model, patched, cache=False, checkpoint_steps=True))
    finally:
        torch.set_default_dtype(torch.float32)
    result["checkpoint"] = close(ckpt, plain)
    result["fewer_saved_bytes"] = [ckpt_bytes, plain_bytes]
    result["train_kept"] = model.training
    return result


def load(root):
    switch_to(root, "stable_audio_tools")
    from stable_audio_tools.inference import sampling
    return sampling


def upstream_of(fn):
    return fn.__wrapped__ if "gradpatch" in fn.__code__.co_filename else fn


def run_019(sampling):
    results = {}
    rf = dict(steps=STEPS, sigma_max=0.9)
    for name, per_call in [("sample_discrete_euler", 1), ("sample_rk4", 4), ("sample_flow_dpmpp", 1),
                           ("sample_flow_pingpong", 1), ("sample", 1)]:
        kw = dict(steps=STEPS, eta=0.0) if name == "sample" else rf
        fn = getattr(sampling, name)
        results[name] = check(lambda m, x, **o: fn(m, x, **kw, **o),
                              lambda m, x: upstream_of(fn)(m, x, **kw),
                              lambda m, x, wrap: inspect.unwrap(fn)(wrap(m), x, **kw), [per_call] * STEPS)
    return results


TWO_CALLS = {"k-heun", "k-dpm-2", "k-dpmpp-2s-ancestral"}
ROUTES = {  # sampler_type -> diffusion objective
    "euler": "rectified_flow", "rk4": "rectified_flow", "dpmpp": "rectified_flow", "pingpong": "rectified_flow",
    "v-ddim": "v", "k-heun": "v", "k-lms": "v", "k-dpmpp-2s-ancestral": "v", "k-dpm-2": "v", "k-dpm-fast": "v",
    "k-dpm-adaptive": "v", "dpmpp-2m": "v", "dpmpp-2m-sde": "v", "dpmpp-3m-sde": "v",
}


@contextlib.contextmanager
def vendored_unwrapped(wrap):
    # The vendored k-diffusion samplers undecorated by hand; their denoiser (VDenoiser(model), which
    # the step loop evaluates) wrapped.
    from stable_audio_tools.inference.k_diffusion import sampling as vendored
    names = [n for n in vars(vendored) if n.startswith("sample_")]
    saved = {n: getattr(vendored, n) for n in names}
    for n in names:
        setattr(vendored, n, lambda model, *a, raw=inspect.unwrap(saved[n]), **k: raw(wrap(model), *a, **k))
    try:
        yield
    finally:
        for n in names:
            setattr(vendored, n, saved[n])


def run_020(sampling):
    results = {}
    fn = sampling.sample_diffusion
    for sampler_type, objective in ROUTES.items():
        kw = dict(cond_inputs={}, diffusion_objective=objective, steps=STEPS, sampler_type=sampler_type,
                  disable_tqdm=True)
        def unwrapped(m, x, wrap, kw=kw, k_type=objective == "v" and sampler_type != "v-ddim"):
            with vendored_unwrapped(wrap if k_type else (lambda denoiser: denoiser)):
                return inspect.unwrap(fn)(m if k_type else wrap(m), x, **kw)
        per_step = [2] * (STEPS - 1) + [1] if sampler_type in TWO_CALLS else [4 if sampler_type == "rk4" else 1] * STEPS
        if sampler_type == "k-dpm-adaptive":
            per_step = None  # as many as its error control takes
        results[sampler_type] = check(lambda m, x, kw=kw, **o: fn(m, x, **kw, **o),
                                      lambda m, x, kw=kw: upstream_of(fn)(m, x, **kw), unwrapped, per_step,
                                      adaptive=sampler_type in ("k-dpm-fast", "k-dpm-adaptive"))
    model = make()
    seen_keywords.clear()
    out = upstream_of(fn)(model, NOISE, cond_inputs={}, diffusion_objective="rectified_flow", steps=2,
                          disable_tqdm=True, cache=False)
    results["upstream_passes_cache_to_the_model"] = out.grad_fn is None and "cache" in seen_keywords
    return results


def run(sampling):
    version = "0.0.20" if hasattr(sampling, "sample_diffusion") else "0.0.19"
    records = {r.patch: [str(r.status), r.variant, r.version] for r in gradpatch.report()
               if r.upstream == "stable_audio_tools"}
    checks = run_020(sampling) if version == "0.0.20" else run_019(sampling)
    from stable_audio_tools.inference import generation  # binds the sampler by name at import
    name = "sample_diffusion" if version == "0.0.20" else "sample"
    checks["generation_calls_the_fix"] = getattr(generation, name) is getattr(sampling, name) and (
        "gradpatch" in getattr(generation, name).__code__.co_filename)
    return dict(file=sampling.__file__, records=records, checks=checks)


main("stable_audio_tools", load, run)
"""

RELEASES = ["0.0.19", "0.0.20"]


@pytest.fixture(scope="module")
def releases(request):
    # 0.0.20 declares Requires-Python < 3.11: its modules import on 3.11, so pip is told to ignore that.
    yield from BackgroundCheck.fixture(request, CHECK, {
        version: (lambda v=version: pypi_release(f"stable-audio-tools=={v}", "--ignore-requires-python"))
        for version in RELEASES})


OWN_019 = ["sample_discrete_euler", "sample_rk4", "sample_flow_dpmpp", "sample_flow_pingpong", "sample"]
VENDORED = ["sample_heun", "sample_dpm_2", "sample_lms", "sample_dpm_fast", "sample_dpm_adaptive",
            "sample_dpmpp_2s_ancestral", "sample_dpmpp_2m", "sample_dpmpp_2m_sde", "sample_dpmpp_3m_sde"]
FIXED_CHECKS = ("cache_true_equal", "upstream_no_graph", "calls_per_step", "grads", "no_keyword_reaches_the_model",
                "grad_steps", "grad_steps_truncated", "grad_steps_and_checkpoint", "checkpoint", "train_kept")


def assert_checks(result, adaptive=False):
    wanted = [k for k in FIXED_CHECKS if not k.startswith("grad_steps")] + (
        ["refuses_grad_steps"] if adaptive else ["grad_steps", "grad_steps_truncated", "grad_steps_and_checkpoint"])
    assert [key for key in wanted if not result[key]] == []
    checkpointed, plain = result["fewer_saved_bytes"]
    assert checkpointed < plain


def test_0_0_19_own_samplers(releases):
    path, result = releases.result("0.0.19")
    assert result["file"].startswith(str(path))
    records = result["records"]
    for name in OWN_019:
        status, variant, version = records[f"stable_audio_tools.{name}"]
        assert (status, version) == ("applied", "0.0.19") and variant.startswith("stable-audio-tools 0.0.19")
    assert records["stable_audio_tools.sample_diffusion"][0] == "skipped"  # >= 0.0.20 only
    for name in OWN_019:
        assert_checks(result["checks"][name])
    assert result["checks"]["generation_calls_the_fix"]


@pytest.mark.parametrize("sampler_type", ["euler", "rk4", "dpmpp", "pingpong", "v-ddim", "k-heun", "k-lms",
                                          "k-dpmpp-2s-ancestral", "k-dpm-2", "k-dpm-fast", "k-dpm-adaptive",
                                          "dpmpp-2m", "dpmpp-2m-sde", "dpmpp-3m-sde"])
def test_0_0_20_sample_diffusion(releases, sampler_type):
    path, result = releases.result("0.0.20")
    assert result["file"].startswith(str(path))
    assert_checks(result["checks"][sampler_type], adaptive=sampler_type in ("k-dpm-fast", "k-dpm-adaptive"))


def test_0_0_20_records_and_the_silent_keyword(releases):
    from gradpatch.patching.activation import known_patches
    from gradpatch.patching.fingerprint import fingerprint_source

    path, result = releases.result("0.0.20")
    known = known_patches()["stable_audio_tools.sample_diffusion"].recognise.known
    source = (path / "stable_audio_tools" / "inference" / "sampling.py").read_text(encoding="utf-8")
    assert fingerprint_source(source, ["sample_diffusion"]) in known
    changed = source.replace('"padding_mask": padding_mask,', '"padding_mask": None,', 1)
    assert changed != source and fingerprint_source(changed, ["sample_diffusion"]) not in known  # would warn
    records = result["records"]
    for name in ["sample_diffusion"] + [f"k_diffusion.{n}" for n in VENDORED]:
        status, variant, version = records[f"stable_audio_tools.{name}"]
        assert (status, version) == ("applied", "0.0.20"), (name, status)
    assert records["stable_audio_tools.sample_diffusion"][1].startswith("stable-audio-tools 0.0.20")
    for name in OWN_019:  # undecorated in 0.0.20: out of the declared range, no warning
        assert records[f"stable_audio_tools.{name}"][0] == "skipped"
    assert result["checks"]["upstream_passes_cache_to_the_model"]
    assert result["checks"]["generation_calls_the_fix"]  # generate_diffusion_cond(..., cache=False) reaches it
