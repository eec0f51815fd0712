"""Recognition is of the object found at a target, not of the module's file (engine unit tests on
small modules written at test time; no torch)."""
from __future__ import annotations

import functools
import importlib
import sys
import textwrap

import pytest

from gradpatch.patching.definitions import definition_of
from gradpatch.patching.fingerprint import Fingerprints, fingerprint_source

SOURCE = '''
import functools as ft


def traced(function):
    @ft.wraps(function)
    def wrapper(*args):
        return function(*args)
    return wrapper


def checkpoint(x):
    """Known code."""
    return Helper.apply(x) + 1


class Helper:
    @staticmethod
    @traced
    def apply(x):
        return x * 2


class Model:
    @traced
    def sample(self, x):
        return x - 1
'''
KNOWN = {fingerprint_source(SOURCE, ["checkpoint", "Helper"]): "known pair"}
SAMPLE = {fingerprint_source(SOURCE, ["Model.sample"]): "known sample"}


@pytest.fixture
def load(tmp_path, monkeypatch):
    """Write ``source`` as a fresh module and import it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    count = iter(range(100))

    def write(source: str):
        name = f"defs_{next(count)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        module = importlib.import_module(name)
        return module

    yield write
    for name in [n for n in sys.modules if n.startswith("defs_")]:
        del sys.modules[name]


def identify(module, qualname, over=("checkpoint", "Helper"), known=KNOWN):
    original = vars(module)[qualname] if "." not in qualname else vars(module.Model)["sample"]
    return Fingerprints(known, over=over).identify(module, qualname, original)


def test_the_definitions_themselves_are_known(load):
    module = load(SOURCE)
    assert identify(module, "checkpoint").verdict == "known"
    assert identify(module, "Helper").verdict == "known"
    # A method whose decorator wrapped it (as @torch.no_grad() does): one layer per decorator.
    assert identify(module, "Model.sample", over=(), known=SAMPLE).verdict == "known"


def test_a_wrapper_installed_on_the_target_is_unknown(load):
    module = load(SOURCE)
    original = module.checkpoint

    @functools.wraps(original)
    def wrapper(x):
        return original(x)

    module.checkpoint = wrapper
    identity = identify(module, "checkpoint")
    assert identity.verdict == "unknown" and "not the module's own definition" in identity.label
    # The companion it is hashed with is no longer what the fingerprint describes either.
    assert identify(module, "Helper").verdict == "unknown"
    # A second wrapper layer on a decorated method is more than its one decorator explains.
    sample = vars(module.Model)["sample"]
    module.Model.sample = functools.wraps(sample)(lambda self, x: sample(self, x))
    assert identify(module, "Model.sample", over=(), known=SAMPLE).verdict == "unknown"


def test_a_decorator_closing_over_one_function_is_seen_through(load):
    """imagen-pytorch's ``eval_decorator`` is not ``functools.wraps``-based: its ``inner`` holds the
    function in its closure. One layer per decorator still: a later wrapper of the same kind is unknown."""
    source = textwrap.dedent('''
        def keep_mode(fn):
            def inner(model, *args):
                return fn(model, *args)
            return inner


        class Model:
            @keep_mode
            def sample(self, x):
                return x - 1
    ''')
    module = load(source)
    known = {fingerprint_source(source, ["Model.sample"]): "known sample"}
    assert identify(module, "Model.sample", over=(), known=known).verdict == "known"
    sample = vars(module.Model)["sample"]
    module.Model.sample = module.keep_mode(sample)
    assert identify(module, "Model.sample", over=(), known=known).verdict == "unknown"


@pytest.mark.parametrize("rebinding, file_looks_known", [
    ("if True:\n    checkpoint = traced(checkpoint)\n", True),
    ("try:\n    from functools import reduce as checkpoint\nexcept ImportError:\n    pass\n", True),
    ("globals()['checkpoint'] = lambda x: x\n", True),
    ("class Helper(Helper):\n    pass\n", False),
])
def test_a_later_rebinding_in_the_module_body_is_unknown(load, rebinding, file_looks_known):
    module = load(SOURCE + rebinding)
    assert identify(module, "checkpoint").verdict == "unknown"
    # Hashing the file's definitions by name, as recognition did before, took most for known code.
    assert (fingerprint_source(SOURCE + rebinding, ["checkpoint", "Helper"]) in KNOWN) is file_looks_known


def test_a_file_changed_after_import_is_unknown(load, tmp_path):
    module = load(SOURCE)
    source = (tmp_path / f"{module.__name__}.py").read_text().replace("x * 2", "x * 3")
    (tmp_path / f"{module.__name__}.py").write_text(source)
    import linecache

    linecache.checkcache()
    fresh = dict(vars(module))  # new file, same objects: the running code is the old one
    with pytest.raises(LookupError):
        definition_of(module, "Helper", fresh["Helper"])
