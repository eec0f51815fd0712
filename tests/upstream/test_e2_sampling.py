"""Differentiable E2-TTS sampling against the real upstream (e2-tts-pytorch 2.2.2 in this environment).

Tiny random models, ``use_vocos=False`` (no downloads). Weights upstream initialises to zero are
re-initialised. E2 has no text cache; its solver is torchdiffeq ``midpoint`` (two evaluations per step)
on ``linspace(0, 1, steps)``, i.e. ``steps - 1`` solver steps.

Reference semantics: ``cache=False`` gradients equal those of the undecorated body (``inspect.unwrap``)
run with grad on; ``grad_steps=K`` equals that reference in which the ODE function evaluations
(``transformer_with_pred_head`` calls: two per evaluation with CFG, two evaluations per midpoint step)
of the first ``steps - 1 - K`` solver steps run under ``no_grad``; ``checkpoint_steps`` equals plain.

Slow: both ends of every catalogued release range (wheels from PyPI) hash to their catalogue entry,
and releases 2.1.1 and 0.9.7 are checked in one background interpreter (installed ``--no-deps`` into
``GRADPATCH_TEST_CACHE``; skipped with the reason when pip cannot reach the index).
"""
from __future__ import annotations

import contextlib
import copy
import inspect

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("e2_tts_pytorch")

import gradpatch  # noqa: E402
from support import BackgroundCheck, assert_grads_equal, pypi_release, pypi_wheels, upstream_method  # noqa: E402
from gradpatch.patching.activation import known_patches  # noqa: E402
from gradpatch.patching.fingerprint import fingerprint_module, fingerprint_source  # noqa: E402
from gradpatch.sampling import run as sampling  # noqa: E402

from e2_tts_pytorch import e2_tts as e2_module  # noqa: E402
from e2_tts_pytorch.e2_tts import E2TTS  # noqa: E402

RAW = inspect.unwrap(E2TTS.sample)
CURRENT = "397b47e8304dbfa8"  # E2TTS.sample of e2-tts-pytorch 2.2.0-2.2.2
KNOWN = known_patches()["e2_tts.sample"].recognise.known


pytestmark = pytest.mark.usefixtures("single_thread")


def upstream_sample():
    return upstream_method(E2TTS, "sample")


def make(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    model = E2TTS(transformer=dict(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, num_registers=4,
                                   kernel_size=3, max_seq_len=64, dropout=dropout,
                                   num_residual_streams=1),
                  use_vocos=False, mel_spec_kwargs=dict(n_mel_channels=16))
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(std=0.05)
    return model


COND = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(1))
TEXT = ["hi there"]


@contextlib.contextmanager
def first_calls_without_grad(model, n):
    """The first ``n`` ``transformer_with_pred_head`` calls under no_grad (an instance attribute)."""
    inner, calls = model.transformer_with_pred_head, [0]

    def head(*args, **kwargs):
        calls[0] += 1
        with torch.set_grad_enabled(calls[0] > n):
            return inner(*args, **kwargs)

    model.transformer_with_pred_head = head
    try:
        yield calls
    finally:
        del model.transformer_with_pred_head


def grads_of(model, out, cond):
    model.zero_grad()
    cond.grad = None
    (out * torch.linspace(-1, 1, out.shape[-1])).square().mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None] + [cond.grad.clone()]


def reference_grads(model, no_grad_calls=0, seed=0, **kw):
    cond = COND.clone().requires_grad_(True)
    torch.manual_seed(seed)
    with first_calls_without_grad(model, no_grad_calls), torch.enable_grad():
        out = RAW(model, cond, text=TEXT, **kw)
    return grads_of(model, out, cond)


def patched_grads(model, seed=0, **kw):
    cond = COND.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = model.sample(cond, text=TEXT, cache=False, **kw)
    assert out.grad_fn is not None
    return grads_of(model, out, cond)


def test_report_signature_and_revert():
    original_sample, original_odeint = E2TTS.__dict__["sample"], e2_module.odeint
    assert fingerprint_module(e2_module, ["E2TTS.sample"]) == CURRENT
    with gradpatch.applied("e2_tts") as report:
        records = {r.patch: r for r in report}
        assert (records["e2_tts.sample"].status, records["e2_tts.sample"].variant) == ("applied", KNOWN[CURRENT])
        assert records["e2_tts.sample"].version == "2.2.2" and "2.2.0–2.2.2" in KNOWN[CURRENT]
        params = inspect.signature(E2TTS.sample).parameters
        assert [params[n].default for n in ("cache", "grad_steps", "checkpoint_steps")] == [True, None, False]
        assert inspect.unwrap(E2TTS.sample) is RAW
    assert E2TTS.__dict__["sample"] is original_sample and e2_module.odeint is original_odeint


def test_cache_true_is_upstream_bit_for_bit():
    model = make().train()
    torch.manual_seed(4)
    want = upstream_sample()(model, COND, text=TEXT, duration=16, steps=3, cfg_strength=1.0)
    model.train()
    with gradpatch.applied("e2_tts"):
        torch.manual_seed(4)
        got = model.sample(COND, text=TEXT, duration=16, steps=3, cfg_strength=1.0)
    assert torch.equal(got, want) and got.grad_fn is None and not model.training


@pytest.mark.parametrize("cfg", [0.0, 1.0, 2.0])
def test_gradients_equal_the_unwrapped_body(cfg):
    model = make().eval()
    kw = dict(duration=16, steps=3, cfg_strength=cfg)
    want = reference_grads(model, **kw)
    with gradpatch.applied("e2_tts"):
        got = patched_grads(model, **kw)
    assert_grads_equal(got, want)
    used = [p for n, p in model.named_parameters() if not n.startswith("mel_spec")]
    assert sum(p.grad is not None for p in used) >= 0.9 * len(used)


def test_caller_mode_is_kept_and_restored_after_errors():
    model = make(dropout=0.1).train()
    with gradpatch.applied("e2_tts"):
        out = model.sample(COND, text=TEXT, duration=16, steps=3, cache=False)
        assert out.grad_fn is not None and all(m.training for m in model.modules())
        handle = model.transformer.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="boom"):
                model.sample(COND, text=TEXT, duration=16, steps=3, cache=False, checkpoint_steps=True)
            assert not torch.is_grad_enabled()
        handle.remove()
        assert model.training and "eval" not in vars(model) and sampling.active_options() is None
        model.eval()
        model.sample(COND, text=TEXT, duration=16, steps=3, cache=False)
        assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("k", [1, 2])
def test_grad_steps_equals_truncated_reference(k):
    model = make().eval()
    steps, per_step = 4, 2 * 2  # midpoint: 2 evaluations per step; CFG: 2 head calls per evaluation
    kw = dict(duration=16, steps=steps, cfg_strength=1.0)
    want = reference_grads(model, no_grad_calls=(steps - 1 - k) * per_step, **kw)
    with gradpatch.applied("e2_tts"):
        got = patched_grads(model, grad_steps=k, **kw)
        both = patched_grads(model, grad_steps=k, checkpoint_steps=True, **kw)
    assert_grads_equal(got, want)
    assert_grads_equal(both, want)


def test_checkpoint_steps_equal_plain_in_train_mode():
    model = make(dropout=0.2).train()
    kw = dict(duration=16, steps=4, cfg_strength=1.0)
    with gradpatch.applied("e2_tts"):
        plain = patched_grads(model, seed=3, **kw)
        checkpointed = patched_grads(model, seed=3, **kw, checkpoint_steps=True)
    assert model.training
    assert_grads_equal(checkpointed, plain)


def test_bad_options_are_refused():
    model = make()
    with gradpatch.applied("e2_tts"):
        with pytest.raises(ValueError, match="cache=False"):
            model.sample(COND, text=TEXT, duration=16, steps=3, checkpoint_steps=True)
        model.odeint_kwargs = dict(method="dopri5")
        with pytest.raises(ValueError, match="fixed-grid"):
            model.sample(COND, text=TEXT, duration=16, steps=3, cache=False, grad_steps=1)
        with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
            model.sample(COND, text=TEXT, duration=16, steps=3, cache=False)


def test_distilling_a_student_lowers_its_loss():
    teacher, student = make(seed=1), make(seed=2).train()
    kw = dict(duration=12, steps=3, cfg_strength=1.0)
    with gradpatch.applied("e2_tts"):
        torch.manual_seed(0)
        target = teacher.sample(COND, text=TEXT, **kw)
        optimiser = torch.optim.Adam(student.parameters(), lr=3e-3)
        losses = []
        for _ in range(8):
            torch.manual_seed(0)
            out = student.sample(COND, text=TEXT, cache=False, **kw)
            loss = torch.nn.functional.mse_loss(out, target)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        copy.deepcopy(student)
    assert student.training and losses[-1] < 0.7 * losses[0], losses


# --- the catalogue against published releases, and two older releases in their own interpreters -----

OLDER = {"2.1.1": "9dfd3abc5c22c8b3", "0.9.7": "d31061755a0e353e"}


def in_label(version: str, label: str) -> bool:
    """Whether ``version`` is among the ``PyPI e2-tts-pytorch A–B`` releases a catalogue label names."""
    from packaging.version import Version

    listed = label.split("PyPI e2-tts-pytorch ", 1)[1].split(" (", 1)[0]
    low, _, high = listed.partition("–")
    return Version(low) <= Version(version) <= Version(high or low)


def label_versions(label: str) -> list[str]:
    """The first and last release a catalogue label names."""
    low, _, high = label.split("PyPI e2-tts-pytorch ", 1)[1].split(" (", 1)[0].partition("–")
    return [low] + ([high] if high else [])


@pytest.mark.slow
def test_every_catalogued_fingerprint_is_a_published_release():
    """Both ends of every catalogued version range, downloaded from PyPI, hash to that entry."""
    import zipfile

    wheels = pypi_wheels("e2-tts-pytorch", sorted({v for label in KNOWN.values() for v in label_versions(label)}))
    if isinstance(wheels, str):
        pytest.skip(wheels)
    assert len(wheels) == len({v for label in KNOWN.values() for v in label_versions(label)})
    for wheel in wheels:
        version = wheel.name.split("-")[1]
        with zipfile.ZipFile(wheel) as archive:
            source = archive.read("e2_tts_pytorch/e2_tts.py").decode()
        digest = fingerprint_source(source, ["E2TTS.sample"])
        assert digest in KNOWN and in_label(version, KNOWN[digest]), (version, digest)


# Both releases are checked in turn in one background interpreter (torch and the dependencies imported
# once; e2_tts_pytorch purged and imported again from the next directory).
CHECK = r"""
import inspect, torch
torch.set_num_threads(1)
import gradpatch
from release_check import main, switch_to

def load(root):
    switch_to(root, "e2_tts_pytorch")
    from e2_tts_pytorch import e2_tts
    return e2_tts

def run(module):
    torch.manual_seed(0)
    extra = {"use_vocos": False} if "use_vocos" in inspect.signature(module.E2TTS).parameters else {}
    model = module.E2TTS(transformer=dict(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, num_registers=4,
                                          max_seq_len=64, dropout=0.0),
                         mel_spec_kwargs=dict(n_mel_channels=16), **extra)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(std=0.05)
    cond, text, kw = torch.randn(1, 8, 16), ["hi there"], dict(duration=16, steps=3, cfg_strength=1.0)

    def grads(call, no_grad_calls=0, **options):
        c = cond.clone().requires_grad_(True)
        torch.manual_seed(1)
        inner, calls = model.transformer_with_pred_head, [0]
        def head(*args, **kwargs):  # the reference's truncation: first head calls under no_grad
            calls[0] += 1
            with torch.set_grad_enabled(calls[0] > no_grad_calls):
                return inner(*args, **kwargs)
        if no_grad_calls:
            model.transformer_with_pred_head = head
        try:
            with torch.enable_grad():
                out = call(model, c, text=text, **options, **kw)
        finally:
            model.__dict__.pop("transformer_with_pred_head", None)
        model.zero_grad()
        out.square().mean().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None] + [c.grad.clone()]

    def close(a, b):
        return len(a) == len(b) and all(torch.allclose(x, y, rtol=1e-5, atol=1e-8) for x, y in zip(a, b))

    model.eval()
    want = grads(inspect.unwrap(module.E2TTS.sample))
    result = dict(file=module.__file__,
                  records={r.patch: [str(r.status), r.variant, r.version] for r in gradpatch.report()},
                  grads=close(grads(module.E2TTS.sample, cache=False), want),
                  checkpoint=close(grads(module.E2TTS.sample, cache=False, checkpoint_steps=True), want),
                  # midpoint over linspace(0, 1, 3): 2 steps of 2 evaluations of 2 head calls (CFG)
                  grad_steps=close(grads(module.E2TTS.sample, cache=False, grad_steps=1),
                                   grads(inspect.unwrap(module.E2TTS.sample), no_grad_calls=4)))
    model.train()
    model.sample(cond, text=text, cache=False, **kw)
    result["train_kept"] = model.training
    torch.manual_seed(2)
    a = model.sample(cond, text=text, **kw)
    model.train()
    torch.manual_seed(2)
    b = module.E2TTS.sample.__wrapped__(model, cond, text=text, **kw)
    result["cache_true_equal"] = bool(torch.equal(a, b))
    return result

main("e2_tts", load, run)
"""


@pytest.fixture(scope="module", autouse=True)
def older_runs(request):
    yield from BackgroundCheck.fixture(request, CHECK, {
        version: (lambda v=version: pypi_release(f"e2-tts-pytorch=={v}")) for version in OLDER})


@pytest.mark.slow
@pytest.mark.parametrize("version", list(OLDER))
def test_older_release(version, older_runs):
    path, result = older_runs.result(version)
    source = (path / "e2_tts_pytorch" / "e2_tts.py").read_text(encoding="utf-8")
    assert fingerprint_source(source, ["E2TTS.sample"]) == OLDER[version]
    assert result["file"].startswith(str(path))
    assert result["records"]["e2_tts.sample"] == ["applied", KNOWN[OLDER[version]], version]
    for key in ("grads", "checkpoint", "grad_steps", "train_kept", "cache_true_equal"):
        assert result[key], key
