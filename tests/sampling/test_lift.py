"""Lifting an in-body ``with torch.no_grad():`` (gradpatch.sampling.lifting.lift) on small functions and on a real
upstream method (audioldm2's ``decode_first_stage``, when audioldm2 imports)."""
from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")

import gradpatch  # noqa: E402
from gradpatch.errors import UnknownCodeWarning  # noqa: E402
from gradpatch.patching.fingerprint import fingerprint_module  # noqa: E402
from gradpatch.sampling.lifting.lift import Liftable, LiftError, function_fingerprint, lift_no_grad  # noqa: E402
from gradpatch.patching.patch import Patch  # noqa: E402

SOURCE = '''
import torch as th
from torch import inference_mode
import contextlib

OFFSET = 1.0


def make(k):
    class Model:
        @th.no_grad()
        def forward(self, x, *, scale=3.0):
            """Doubles, in three grad-free blocks."""
            with th.no_grad():
                y = x * k * scale
            with contextlib.nullcontext(), th.no_grad():
                y = y + OFFSET
            if True:
                with inference_mode():
                    y = y * 1.0
            with th.enable_grad():
                y = y + super().__hash__() * 0
            return y

        def untouched(self, x):
            return x + 1

    return Model


def top(x):
    with th.no_grad():
        return x * 2


class FirstStage(th.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = th.nn.Linear(3, 3)

    def decode_first_stage(self, z):
        with th.no_grad():
            return self.decoder(z) * 2
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "liftee.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("liftee", None)
    yield importlib.import_module("liftee")
    sys.modules.pop("liftee", None)


def test_lifted_copy_keeps_closure_defaults_and_metadata(module):
    Model = module.make(torch.tensor(2.0))
    lifted = lift_no_grad(Model.forward)
    x = torch.ones(3, requires_grad=True)
    assert Model().forward(x).grad_fn is None  # upstream: decorated and in-body no_grad
    out = lifted(Model(), x)
    out.sum().backward()
    assert torch.equal(out.detach(), Model().forward(x)) and torch.equal(x.grad, torch.full((3,), 6.0))
    raw = inspect.unwrap(Model.forward)
    assert lifted is not raw and lifted.__kwdefaults__ == {"scale": 3.0}
    assert (lifted.__qualname__, lifted.__module__, lifted.__doc__) == (raw.__qualname__, "liftee", raw.__doc__)
    assert lifted.__globals__ is module.__dict__
    assert lifted.__code__.co_filename == raw.__code__.co_filename
    assert lift_no_grad(Model.forward) is lifted  # cached per function
    Five = module.make(torch.tensor(5.0))
    other = lift_no_grad(Five.forward)  # another closure of the same code
    assert other is not lifted and other.__code__ is lifted.__code__  # compiled once
    assert other(Five(), torch.ones(3)).tolist() == [16.0] * 3  # its own cells (k=5), not the first's
    module.OFFSET = 10.0  # the same globals: later rebinding is seen
    assert lifted(Model(), torch.zeros(1)).item() == 10.0


def test_fingerprint_is_the_catalogue_hash_of_the_definition(module):
    assert function_fingerprint(module.top) == fingerprint_module(module, ["top"])
    assert function_fingerprint(module.make(1).untouched) != function_fingerprint(module.top)
    with pytest.raises(LiftError, match="nothing|no `with"):
        lift_no_grad(module.make(1).untouched)


def test_edited_source_and_missing_source_are_refused(module, tmp_path):
    path = tmp_path / "liftee.py"
    path.write_text(SOURCE.replace("x * 2", "x * 3"))
    import linecache

    linecache.checkcache(str(path))
    with pytest.raises(LiftError, match="not the code"):
        lift_no_grad(module.top)
    namespace: dict = {"torch": torch}
    exec("def f(x):\n    with torch.no_grad():\n        return x\n", namespace)
    with pytest.raises(LiftError, match="no source"):
        lift_no_grad(namespace["f"])


def test_liftable_recogniser(module):
    digest = function_fingerprint(module.top)
    assert Liftable({digest: "v1"}).identify(module, "top", module.top) == ("known", "v1")
    assert Liftable({"0" * 16: "v1"}).identify(module, "top", module.top) == ("unknown", digest)
    untouched = module.make(1).untouched
    verdict, label = Liftable({function_fingerprint(untouched): "v1"}).identify(module, "x", untouched)
    assert verdict == "unknown" and "not liftable" in label


def test_an_unknown_liftable_target_is_skipped_and_recorded(module, monkeypatch):
    from gradpatch.patching import activation

    patch = Patch("liftee.top", "liftee:top", "gradpatch.sampling.families.ldm:lifted_entry",
                  Liftable({"0" * 16: "v1"}), "liftee", "lifted")
    monkeypatch.setitem(activation.known_patches(), "liftee.top", patch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradpatch.applied("liftee") as report:
            record = {r.patch: r for r in report}["liftee.top"]
    assert record.status == "skipped" and "unknown code" in record.reason
    assert any(issubclass(w.category, UnknownCodeWarning) for w in caught)


def test_real_audioldm2_decode_first_stage():
    pytest.importorskip("audioldm2")
    ddpm = importlib.import_module("audioldm2.latent_diffusion.models.ddpm")
    method = ddpm.LatentDiffusion.decode_first_stage
    assert function_fingerprint(method) == fingerprint_module(ddpm, ["LatentDiffusion.decode_first_stage"])
    lifted = lift_no_grad(method)
    decoder = torch.nn.Linear(4, 4)
    holder = type("Holder", (), {"scale_factor": 2.0, "first_stage_model": type("F", (), {"decode": decoder})()})()
    z = torch.randn(2, 4, requires_grad=True)
    assert method(holder, z).grad_fn is None
    out = lifted(holder, z)
    out.sum().backward()
    assert torch.equal(out.detach(), method(holder, z)) and z.grad is not None
    assert "with torch.no_grad" in textwrap.dedent(inspect.getsource(method))  # upstream file untouched


def test_lifted_entry_patch_end_to_end(module, monkeypatch):
    """A ``lifted_entry`` declared with ``Liftable``: applied and reported; cache=True is the original
    (no graph), cache=False the lifted copy (gradients reach the weights); revert restores."""
    from gradpatch.patching import activation

    original = vars(module.FirstStage)["decode_first_stage"]
    known = {function_fingerprint(original): "liftee 1.0"}
    patch = Patch("liftee.decode", "liftee:FirstStage.decode_first_stage", "gradpatch.sampling.families.ldm:lifted_entry",
                  Liftable(known), "liftee", "lifted")
    monkeypatch.setitem(activation.known_patches(), "liftee.decode", patch)
    stage, z = module.FirstStage(), torch.randn(2, 3)
    with gradpatch.applied("liftee") as report:
        record = {r.patch: r for r in report}["liftee.decode"]
        assert (record.status, record.variant) == ("applied", "liftee 1.0")
        plain = stage.decode_first_stage(z)
        with torch.no_grad():
            out = stage.decode_first_stage(z, cache=False)
        assert plain.grad_fn is None and out.grad_fn is not None and torch.equal(out.detach(), plain)
        out.sum().backward()
        assert stage.decoder.weight.grad is not None
    assert vars(module.FirstStage)["decode_first_stage"] is original
