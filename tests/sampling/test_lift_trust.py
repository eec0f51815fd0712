"""Regression tests: the lifter and the sampler keywords as a new user meets them (issue 21, part 2).
Each test fails on the code before its fix."""
from __future__ import annotations

import functools
import importlib
import io
import pickle
import sys
import types

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from gradpatch.errors import NotDifferentiableError  # noqa: E402
from gradpatch.sampling.lifting.lift import Liftable, LiftError, function_fingerprint, lift_no_grad  # noqa: E402

SOURCE = '''
import torch


class FirstStage:
    def decode_first_stage(self, z):
        with torch.no_grad():
            if z.sum() > 0:
                z = z + 1
            z = z * 2
        return z


def outer(x):
    def helper(y):
        with torch.no_grad():
            return y * 2
    with torch.no_grad():
        z = x * 3
    return z + helper(x) + (lambda: x.detach())()
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    path = tmp_path / "lifttrust.py"
    path.write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("lifttrust", None)
    yield importlib.import_module("lifttrust"), path
    sys.modules.pop("lifttrust", None)


def test_a_users_wraps_wrapper_is_not_looked_through(module):
    mod, _ = module
    original = mod.FirstStage.decode_first_stage
    recognise = Liftable({function_fingerprint(original): "known"})
    assert recognise.identify(mod, "FirstStage.decode_first_stage", original).verdict == "known"
    calls = []

    @functools.wraps(original)
    def logged(self, z):  # a user's wrapper, installed before apply()
        calls.append(z)
        return original(self, z)

    identity = recognise.identify(mod, "FirstStage.decode_first_stage", logged)
    assert identity.verdict == "unknown"  # was "known": cache=False then ran the lifted body, dropping it
    with pytest.raises(LiftError):
        lift_no_grad(logged)
    decorated = torch.no_grad()(original)  # torch's own grad-mode decorators are looked through
    assert recognise.identify(mod, "FirstStage.decode_first_stage", decorated).verdict == "known"


def test_an_indentation_only_edit_after_import_is_refused(module):
    mod, path = module
    path.write_text(SOURCE.replace("            z = z * 2", "                z = z * 2"))  # into the if
    with pytest.raises(LiftError, match="not the code that was loaded"):
        lift_no_grad(mod.FirstStage.decode_first_stage)


def test_no_grad_in_nested_definitions_stays(module):
    mod, _ = module
    x = torch.ones(2, requires_grad=True)
    out = lift_no_grad(mod.outer)(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.tolist() == [3.0, 3.0]  # the helper's no_grad and the lambda's detach hold (was 5)


def test_generate_sample_validates_cache_like_every_sampler():
    from gradpatch.sampling.families.ldm_guards import refuse_cache_false

    method = refuse_cache_false(lambda self, *args, **kwargs: "upstream")
    for value in (True, np.True_):
        assert method(object(), cache=value) == "upstream"
    for value in (False, np.False_):
        with pytest.raises(NotDifferentiableError, match="sample_log"):
            method(object(), cache=value)
    for value in ("False", 0, None):
        with pytest.raises(TypeError, match="cache must be True or False"):
            method(object(), cache=value)
    with pytest.raises(TypeError, match="grad_steps"):
        method(object(), grad_steps="2")


def test_patched_checkpoint_objects_pickle_by_reference_at_every_protocol(monkeypatch):
    from gradpatch.checkpointing.checkpoint import replace_checkpoint, replace_checkpoint_function

    upstream = types.ModuleType("fake_ldm_util")

    def checkpoint(func, inputs, params, flag):
        return func(*inputs)

    class CheckpointFunction(torch.autograd.Function):
        pass

    for obj in (checkpoint, CheckpointFunction):
        obj.__module__, obj.__qualname__ = upstream.__name__, obj.__name__
    monkeypatch.setitem(sys.modules, upstream.__name__, upstream)
    upstream.checkpoint = replace_checkpoint(checkpoint)
    upstream.CheckpointFunction = replace_checkpoint_function(CheckpointFunction)
    held = {"checkpoint": upstream.checkpoint, "cls": upstream.CheckpointFunction,
            "partial": functools.partial(upstream.checkpoint, flag=True)}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # 2 failed: "cannot pickle 'module' object"
        buffer = io.BytesIO()
        torch.save(held, buffer, pickle_protocol=protocol)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert loaded["checkpoint"] is upstream.checkpoint and loaded["cls"] is upstream.CheckpointFunction
        assert loaded["partial"].func is upstream.checkpoint
