"""Copies of the checkpoint family found at paths no patch names, and objects that are not what their
module's source defines (fresh interpreters; the copies are made at test time).

``myfork/util.py`` is a byte-identical copy of the installed stable-diffusion-sdkit file
``ldm/modules/diffusionmodules/util.py`` (V2; it imports only torch, numpy, einops and ``ldm.util``),
and ``myfork/block.py`` a small block that checkpoints its body through it, as upstream blocks do.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from support import BLOCK_STEP, CHECKPOINTED_BLOCK as BLOCK, last_json, run_python

pytestmark = pytest.mark.slow

# One statement of CheckpointFunction.forward changed: not a version gradpatch knows.
CHANGED = ("ctx.input_params = list(args[length:])",
           "ctx.input_params = [p for p in args[length:] if p.requires_grad]")
# The module rebinds its name later in its body, in a way a search of the file's top-level
# definitions and assignments does not see.
REBOUND = '''
try:
    from {package}.fast import checkpoint
except ImportError:
    pass
'''
FAST = "def checkpoint(func, inputs, params, flag):\n    return func(*inputs)\n"
# Unrelated code that uses the family's names: never a copy, never a warning.
UNRELATED = '''
from torch.utils.checkpoint import checkpoint as torch_checkpoint, CheckpointFunction
def checkpoint(path, every=100):
    return path, every
class MixedCheckpointFunction:
    pass
'''

STEP = '''
import json, sys, warnings, torch
torch.set_num_threads(1)
torch.manual_seed(0)
import gradpatch

''' + BLOCK_STEP + '''
def caught_importing(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = __import__(name, fromlist=["*"])
    return module, [f"{type(w.message).__name__}: {w.message}" for w in caught if "gradpatch" in str(w.message)]

def found(prefix):
    return sorted((r.patch, r.status.value, r.reason.split(" (")[0]) for r in gradpatch.report()
                  if r.target.startswith(prefix))
'''


@pytest.fixture(scope="module")
def forks(tmp_path_factory) -> Path:
    """``myfork`` (the copy), ``changedfork`` (one statement changed), ``reboundfork`` (the name
    rebound later in the module body) and ``unrelated``, side by side."""
    root = tmp_path_factory.mktemp("forks")
    ldm = importlib.util.find_spec("ldm")  # the top-level package only: nothing is imported
    source = (Path(ldm.submodule_search_locations[0]) / "modules" / "diffusionmodules" / "util.py").read_bytes()
    assert CHANGED[0].encode() in source
    variants = {"myfork": source, "changedfork": source.replace(CHANGED[0].encode(), CHANGED[1].encode()),
                "reboundfork": source + REBOUND.format(package="reboundfork").encode()}
    for package, util in variants.items():
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
        (root / package / "util.py").write_bytes(util)
        (root / package / "block.py").write_text(BLOCK.format(module=f"{package}.util"))
    (root / "reboundfork" / "fast.py").write_text(FAST)
    (root / "unrelated.py").write_text(UNRELATED)
    return root


def test_copy_under_a_new_name_is_fixed_under_gradpatch_1(forks):
    out = last_json(run_python(STEP + '''
import myfork.block
import ldm.modules.diffusionmodules.util  # a declared path: its own patches, never the scan's
patched = step(myfork.block)
report = found("myfork.")
declared = found("ldm.modules.diffusionmodules.util:")
same = myfork.block.checkpoint is myfork.util.checkpoint
gradpatch.revert()
print(json.dumps([patched, report, declared, same, myfork.util.checkpoint.__module__, step(myfork.block)]))
''', env={"GRADPATCH": "1"}, pythonpath=[forks]))
    patched, report, declared, same, reverted_module, upstream = out
    assert [r[:2] for r in declared] == [["ldm.CheckpointFunction", "applied"], ["ldm.checkpoint", "applied"]]
    assert patched is True, "gradients through the found copy equal the block's body without checkpointing"
    assert [r[:2] for r in report] == [["myfork.util.CheckpointFunction", "applied"], ["myfork.util.checkpoint", "applied"]]
    assert all(r[2].startswith("copy found by scan") for r in report)
    assert same, "the block bound the fixed checkpoint"
    assert reverted_module == "myfork.util"
    assert "does not require grad" in upstream, "upstream's copy fails on the same step"


def test_changed_copies_are_left_alone_and_unrelated_code_is_not_a_copy(forks):
    out = last_json(run_python(STEP + '''
import torch.utils.checkpoint
results = {}
for package in ("changedfork", "reboundfork"):
    block, warned = caught_importing(package + ".block")
    util = sys.modules[package + ".util"]
    results[package] = [warned, found(package + "."), util.checkpoint.__module__,
                        util.CheckpointFunction.__module__]
unrelated, warned = caught_importing("unrelated")
results["unrelated"] = [warned, found("unrelated"), unrelated.checkpoint.__module__]
print(json.dumps(results))
''', env={"GRADPATCH": "1"}, pythonpath=[forks]))
    changed = out["changedfork"]
    # One warning for the module, however many of its definitions the family patches.
    assert len(changed[0]) == 1 and changed[0][0].startswith("UnknownCodeWarning: gradpatch: changedfork.util ")
    assert [r[1:] for r in changed[1]] == [["skipped", "unknown code"]] * 2
    assert changed[2:] == ["changedfork.util", "changedfork.util"], "left alone"
    rebound = out["reboundfork"]
    assert rebound[0] and all(w.startswith("UnknownCodeWarning") for w in rebound[0])
    assert any("not the module's own definition of 'checkpoint'" in w for w in rebound[0])
    assert rebound[2:] == ["reboundfork.fast", "reboundfork.util"], "left alone"
    # reboundfork.fast's lone checkpoint(func, inputs, params, flag) is no copy: no warning for it.
    assert not any("reboundfork.fast:" in w for w in rebound[0])
    assert out["unrelated"] == [[], [], "unrelated"]


def test_apply_after_import_finds_copies_and_wrappers_on_known_targets_stay(forks):
    out = last_json(run_python(STEP + '''
import functools
import myfork.block
import ldm.modules.diffusionmodules.util as known
upstream = known.checkpoint
@functools.wraps(upstream)
def wrapper(func, inputs, params, flag):  # a user's own wrapper on a known target
    return upstream(func, inputs, params, flag)
known.checkpoint = wrapper
gradpatch.apply("f5_tts")  # selects no checkpoint patch: no scan for its family
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gradpatch.apply("ldm", scan=False)
    before = found("myfork.")
    report = gradpatch.apply("ldm")
after = [(r.patch, r.status.value, list(r.rebound)) for r in report if r.patch.startswith("myfork.")]
known_report = [(r.patch, r.status.value) for r in report if r.patch.startswith("ldm.")]
print(json.dumps([before, after, step(myfork.block), known.checkpoint is wrapper, known_report,
                  [str(w.message) for w in caught]]))
''', pythonpath=[forks]))
    before, after, patched, wrapper_kept, known_report, warned = out
    assert before == []
    assert sorted(after) == [["myfork.util.CheckpointFunction", "applied", []],
                             ["myfork.util.checkpoint", "applied", ["myfork.block.checkpoint"]]]
    assert patched is True
    assert wrapper_kept and ["ldm.checkpoint", "skipped"] in known_report
    assert any("ldm.modules.diffusionmodules.util.checkpoint is not the module's own definition" in w
               for w in warned)


def test_scan_switched_off_by_environment(forks):
    code = STEP + '''
import myfork.block
print(json.dumps([found("myfork."), myfork.util.checkpoint.__module__]))
'''
    env = {"GRADPATCH": "1", "GRADPATCH_SCAN": "0"}
    assert last_json(run_python(code, env=env, pythonpath=[forks])) == [[], "myfork.util"]


def test_every_declared_checkpoint_fingerprint_belongs_to_the_family():
    from gradpatch.patching.activation import known_patches
    from gradpatch.patching.catalogue import builtin_package

    family = importlib.import_module(f"{builtin_package().__name__}._families").CHECKPOINT
    declared = [p for p in known_patches().values() if p.fix in family.fixes()]
    assert declared
    for patch in declared:
        assert set(patch.recognise.known) <= set(family.known(patch.recognise.over)), patch.name


def test_shapes_tell_members_from_torch_code():
    import torch.utils.checkpoint as torch_checkpoint

    from gradpatch.patching.catalogue import builtin_package
    from gradpatch.checkpointing import checkpoint as fix

    family = importlib.import_module(f"{builtin_package().__name__}._families").CHECKPOINT
    shapes = {m.name: m.shape for m in family.members}
    assert not shapes["checkpoint"].matches(torch_checkpoint.checkpoint)
    assert not shapes["CheckpointFunction"].matches(torch_checkpoint.CheckpointFunction)
    assert shapes["checkpoint"].matches(fix.checkpoint)  # gradpatch's own modules are never scanned
    assert not shapes["CheckpointFunction"].matches(fix.CheckpointFunction)
