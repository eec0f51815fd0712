"""gradpatch next to other import hooks, and every way a module body runs (fresh interpreters).

The copies are of the real CompVis checkpoint: ``util.py`` is the installed stable-diffusion-sdkit file
``ldm/modules/diffusionmodules/util.py`` (V2), byte for byte, made at test time under other names and
loaded every way Python loads code: from source, from a zip file, from a ``.pyc`` without source, by a
loader of a finder inserted ahead of everything, lazily (``importlib.util.LazyLoader``,
``lazy_loader``), while another thread is importing it, again after ``importlib.reload`` or removal
from ``sys.modules``, and built in memory with ``types.ModuleType`` and ``exec``. Next to them run
the real typeguard, jaxtyping and beartype import hooks. A block that checkpoints its body through
the copy, with a frozen parameter, shows whether it was patched: its gradients equal those of the
body run without checkpointing, where upstream's copy raises "does not require grad".
"""
from __future__ import annotations

import importlib.util
import py_compile
import zipfile
from pathlib import Path

import pytest

from support import BLOCK_STEP, CHECKPOINTED_BLOCK as BLOCK, last_json, run_python

pytestmark = pytest.mark.slow

PRELUDE = '''
import importlib, json, sys, warnings
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
import gradpatch
UPSTREAM = "does not require grad"

''' + BLOCK_STEP + '''
def found(prefix):
    return sorted([r.patch, r.status.value, r.reason] for r in gradpatch.report() if r.target.startswith(prefix))

def statuses(prefix):
    return [r[:2] for r in found(prefix)]

def warned(caught):
    return [f"{type(w.message).__name__}: {w.message}" for w in caught if "gradpatch" in str(w.message)]
'''

UPSTREAM = "does not require grad"
PAIR = [["CheckpointFunction", "applied"], ["checkpoint", "applied"]]


def applied(prefix: str) -> list[list[str]]:
    return [[f"{prefix}.{name}", status] for name, status in PAIR]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Copies of the CompVis checkpoint under new names, each with a block using it; the same in a
    zip file and as bytecode alone; a module whose body waits on a gate; one whose body needs a
    module that is not installed; a block on the declared path itself."""
    root = tmp_path_factory.mktemp("copies")
    ldm = importlib.util.find_spec("ldm")  # the top-level package only: nothing is imported
    source = (Path(ldm.submodule_search_locations[0]) / "modules" / "diffusionmodules" / "util.py").read_bytes()
    wait = b"\nimport gate\ngate.entered.set()\ngate.release.wait(60)\n"
    for package in ["myfork", "lazyfork", "tgfork", "jxfork", "bxfork", "gatefork", "customfork", "pycfork"]:
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
        (root / package / "block.py").write_text(BLOCK.format(module=f"{package}.util"))
        if package not in ("customfork", "pycfork"):  # customfork's util comes from a finder of the test's
            (root / package / "util.py").write_bytes(source + (wait if package == "gatefork" else b""))
    (root / "pycsource.py").write_bytes(source)
    py_compile.compile(str(root / "pycsource.py"), cfile=str(root / "pycfork" / "util.pyc"), doraise=True)
    (root / "pycsource.py").unlink()
    with zipfile.ZipFile(root / "copies.zip", "w") as archive:
        archive.writestr("zipfork/__init__.py", "")
        archive.writestr("zipfork/util.py", source)
        archive.writestr("zipfork/block.py", BLOCK.format(module="zipfork.util"))
    (root / "ldmblock.py").write_text(BLOCK.format(module="ldm.modules.diffusionmodules.util"))
    (root / "gate.py").write_text("import threading\nentered, release = threading.Event(), threading.Event()\n")
    (root / "brokenlazy.py").write_text("import gradpatch_test_missing_dependency\n")
    return root


def _run(root: Path, code: str, **env: str) -> object:
    return last_json(run_python(PRELUDE + code, env=env, pythonpath=[root], timeout=300))


SNAPSHOT = '''
import _frozen_importlib, _frozen_importlib_external
from importlib.machinery import PathFinder

def snapshot():
    return [list(sys.meta_path), list(sys.path_hooks), vars(_frozen_importlib_external._LoaderBasics)["exec_module"],
            vars(_frozen_importlib.ModuleSpec).get("_initializing")]

def same(a, b):
    return len(a[0]) == len(b[0]) and len(a[1]) == len(b[1]) and all(x is y for x, y in zip(a[0] + a[1], b[0] + b[1])) \\
        and a[2] is b[2] and a[3] is b[3]

def gradpatch_objects():
    return [repr(o) for o in sys.meta_path + sys.path_hooks if "gradpatch" in type(o).__module__ + repr(o)]

from typeguard import install_import_hook as typeguard_hook
from jaxtyping import install_import_hook as jaxtyping_hook

def hooks_install():
    errors = []
    for install in (lambda: typeguard_hook("nothing_here"), lambda: jaxtyping_hook("nothing_here", "typeguard.typechecked")):
        try:
            install().uninstall()
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors
'''


@pytest.mark.parametrize("how", ["GRADPATCH=1", "apply()"])
def test_1_typeguard_and_jaxtyping_hooks_install_with_gradpatch_on_and_after_revert(root, how):
    """Both look ``PathFinder`` up in ``sys.meta_path``; gradpatch puts nothing there, and revert()
    leaves ``sys.meta_path``, ``sys.path_hooks``, the loaders and ``ModuleSpec`` exactly as they were."""
    out = _run(root, SNAPSHOT + '''
before = snapshot()
if not gradpatch.report():
    gradpatch.apply()
on = [hooks_install(), any(f is PathFinder for f in sys.meta_path), gradpatch_objects()]
import myfork.block
patched = [step(myfork.block), statuses("myfork.")]
gradpatch.revert()
after = [hooks_install(), gradpatch_objects(), step(myfork.block)]
print(json.dumps([on, patched, after, same(before, snapshot())]))
''', **({"GRADPATCH": "1"} if how == "GRADPATCH=1" else {}))
    on, patched, after, restored = out
    assert on == [[], True, []], "both hooks install while gradpatch is on; PathFinder is where it was"
    assert patched == [True, applied("myfork.util")]
    assert after[:2] == [[], []] and UPSTREAM in after[2], "hooks install after revert; upstream is back"
    if how == "apply()":
        assert restored, "meta_path, path_hooks, the loader base and ModuleSpec are exactly as before apply()"


def test_1_copies_under_typeguard_beartype_and_jaxtyping_import_hooks(root):
    """Import hooks installed after apply() that instrument the packages holding copies: typeguard's
    and beartype's leave the checkpoint as its source defines it, so the copies are patched and
    train; jaxtyping's wraps every function, so that copy is left alone, reported and warned about
    as a wrapper (there is no fingerprint to add)."""
    out = _run(root, '''
from beartype.claw import beartype_package
from jaxtyping import install_import_hook as jaxtyping_hook
from typeguard import install_import_hook as typeguard_hook
gradpatch.apply()
typeguard_hook("tgfork"); jaxtyping_hook("jxfork", "typeguard.typechecked"); beartype_package("bxfork")
results = {}
for package in ("tgfork", "bxfork", "jxfork"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block = importlib.import_module(package + ".block")
    loader = type(sys.modules[package + ".util"].__loader__).__name__
    results[package] = [loader, step(block), found(package + "."), warned(caught)]
print(json.dumps(results))
''')
    for package, loader in [("tgfork", "TypeguardLoader"), ("bxfork", "BeartypeSourceFileLoader")]:
        assert out[package][:2] == [loader, True], package
        assert [r[:2] for r in out[package][2]] == applied(f"{package}.util") and out[package][3] == []
    loader, trained, report, warnings = out["jxfork"]
    assert loader == "_JaxtypingLoader" and UPSTREAM in trained
    assert [r[1] for r in report] == ["skipped", "skipped"]
    assert all("not the module's own definition" in r[2] for r in report)
    assert len(warnings) == 1 and "(jxfork.util.checkpoint, jxfork.util.CheckpointFunction)" in warnings[0]
    assert "remove the wrapper" in warnings[0] and "add this fingerprint" not in warnings[0]


def test_2_lazy_modules_stay_lazy_and_are_patched_when_they_load(root):
    """apply() neither loads a lazily imported module (whose body here needs a module that is not
    installed, as librosa's lazy resampy does) nor misses a lazy copy or a lazy declared target: each
    is patched on its first use."""
    out = _run(root, '''
import importlib.util, lazy_loader

def lazy(name):
    spec = importlib.util.find_spec(name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module

import myfork.block  # imported before apply(): patching it rebinds names across sys.modules
broken = lazy("brokenlazy")
copy = lazy_loader.load("lazyfork.util")
target = lazy("ldm.modules.diffusionmodules.util")
before = [type(broken).__name__, type(copy).__name__]
try:
    report = [[r.patch, r.status.value] for r in gradpatch.apply() if "lazy" in r.patch]
except Exception as exc:
    report = repr(exc)
during = [type(broken).__name__, type(copy).__name__, found("lazyfork."), statuses("myfork.")]
waiting = [type(target).__name__, found("ldm.modules.diffusionmodules.util:")]
import lazyfork.block  # `from lazyfork.util import checkpoint`: its first use
import ldmblock
declared = [step(ldmblock), statuses("ldm.modules.diffusionmodules.util:")]
print(json.dumps([before, report, during, type(broken).__name__, step(lazyfork.block), statuses("lazyfork."),
                  waiting, declared]))
''')
    before, report, during, broken, trained, after, waiting, declared = out
    assert before == ["_LazyModule", "_LazyModule"]
    assert report == [], "nothing raised, nothing examined yet"
    assert during == ["_LazyModule", "_LazyModule", [], applied("myfork.util")], \
        "apply() loaded neither, examining sys.modules and rebinding the copy it patched"
    assert broken == "_LazyModule"
    assert trained is True and after == applied("lazyfork.util")
    assert waiting[0] == "_LazyModule" and [r[1] for r in waiting[1]] == ["deferred", "deferred"]
    assert all("imported lazily, to load on first use" in r[2] for r in waiting[1])
    assert declared == [True, [["ldm.CheckpointFunction", "applied"], ["ldm.checkpoint", "applied"]]]


def test_3_a_found_copy_is_patched_again_after_reload_and_reimport(root):
    out = _run(root, '''
import myfork.block
first = step(myfork.block)
importlib.reload(myfork.util)
importlib.reload(myfork.block)  # binds the reloaded module's checkpoint
reloaded = [myfork.util.checkpoint.__module__, step(myfork.block), statuses("myfork.")]
for name in [n for n in sys.modules if n.startswith("myfork")]:
    del sys.modules[name]
import myfork.block
reimported = [step(myfork.block), statuses("myfork.")]
gradpatch.revert()
print(json.dumps([first, reloaded, reimported, step(myfork.block), myfork.util.checkpoint.__module__]))
''', GRADPATCH="1")
    first, reloaded, reimported, reverted, module = out
    assert first is True
    assert reloaded[0].startswith("gradpatch.") and reloaded[1:] == [True, applied("myfork.util")]
    assert reimported == [True, applied("myfork.util")]
    assert UPSTREAM in reverted and module == "myfork.util"


def test_4_a_found_copy_belongs_to_every_later_selection_of_its_family(root):
    out = _run(root, '''
import myfork.block
steps = []
for _ in range(2):
    with gradpatch.applied("ldm"):
        steps.append([step(myfork.block), statuses("myfork.")])
    steps.append(step(myfork.block))
gradpatch.apply("ldm")
gradpatch.revert()
steps.append(step(myfork.block))
report = [[r.patch, r.status.value] for r in gradpatch.apply("ldm") if r.patch.startswith("myfork.")]
steps.append([step(myfork.block), sorted(report)])
gradpatch.revert("ldm")  # the copies go with their family's last declared patch
steps.append([step(myfork.block), statuses("myfork.")])
print(json.dumps(steps))
''')
    first, after_first, second, after_second, reverted, again, last = out
    assert first == second == [True, applied("myfork.util")]
    assert all(UPSTREAM in s for s in (after_first, after_second, reverted))
    assert again == [True, applied("myfork.util")]
    assert UPSTREAM in last[0] and [r[1] for r in last[1]] == ["reverted", "reverted"]


def test_5_a_copy_in_a_zip_file_imported_after_apply_is_patched(root):
    out = _run(root, f'''
sys.path.insert(0, {str(root / "copies.zip")!r})
gradpatch.apply()
import zipfork.block
print(json.dumps([type(zipfork.util.__loader__).__name__, step(zipfork.block), statuses("zipfork.")]))
''')
    assert out == ["zipimporter", True, applied("zipfork.util")]


def test_5_a_copy_imported_in_another_thread_during_apply_is_patched_when_its_body_ends(root):
    out = _run(root, '''
import threading, gate
importer = threading.Thread(target=importlib.import_module, args=("gatefork.block",))
importer.start()
assert gate.entered.wait(60)
during = found("gatefork.")
gradpatch.apply()
gate.release.set()
importer.join(60)
import gatefork.block
print(json.dumps([during, step(gatefork.block), statuses("gatefork.")]))
''')
    assert out == [[], True, applied("gatefork.util")]


def test_5_7_copies_without_source_are_reported_in_true_words(root):
    """A ``.pyc`` without its ``.py`` (imported after apply()) and a module built in memory
    (``types.ModuleType`` + ``exec``, there before apply()) cannot be fingerprinted: each is left
    alone, recorded, and warned about once, saying why and what to do."""
    source = (root / "myfork" / "util.py").read_text()
    out = _run(root, f'''
import types
memory = types.ModuleType("memfork_util")
exec(compile({source!r}, "<memory>", "exec"), memory.__dict__)
sys.modules["memfork_util"] = memory
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gradpatch.apply()
    import pycfork.block
print(json.dumps([type(pycfork.util.__loader__).__name__, step(pycfork.block), found("pycfork."),
                  found("memfork_util"), warned(caught)]))
''')
    loader, trained, pyc, memory, warnings = out
    assert loader == "SourcelessFileLoader" and UPSTREAM in trained, "left alone, and says so below"
    assert [r[1] for r in pyc + memory] == ["skipped"] * 4
    assert all(r[2].startswith("cannot be recognised: ") for r in pyc + memory)
    assert len(warnings) == 2, warnings
    pyc_warning = next(w for w in warnings if "pycfork" in w)
    memory_warning = next(w for w in warnings if "memfork_util" in w)
    assert "loaded from bytecode" in pyc_warning and "no .py source beside it" in pyc_warning
    assert "put its .py source where it is imported from" in pyc_warning
    assert "no source file and no loader" in memory_warning and "spec_from_file_location" in memory_warning
    for warning in warnings:
        assert warning.startswith("UnknownCodeWarning: gradpatch: cannot recognise ")
        assert "built-in" not in warning and "fingerprint" not in warning


@pytest.mark.parametrize("ahead", ["typeguard", "custom finder"])
def test_6_a_finder_inserted_ahead_later_loads_targets_and_copies_that_are_patched(root, ahead):
    """After apply(), a finder goes to ``sys.meta_path[0]`` and serves both the declared target and a
    copy: typeguard's instrumenting hook, or a bare finder whose copy comes from a loader of its own
    (``exec`` of source it holds, no file behind the module)."""
    util = importlib.util.find_spec("ldm").submodule_search_locations[0] + "/modules/diffusionmodules/util.py"
    install = {
        "typeguard": 'from typeguard import install_import_hook\ninstall_import_hook(["ldm.modules.diffusionmodules", "tgfork"])\n'
                     'copy = "tgfork"',
        "custom finder": f'''
import importlib.util
class ExecLoader:
    def __init__(self, path):
        self.path, self.source = path, open(path).read()
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        exec(compile(self.source, self.path, "exec"), module.__dict__)
    def get_source(self, name):
        return self.source
class Ahead:
    def find_spec(self, name, path=None, target=None):
        if name == "customfork.util":
            return importlib.util.spec_from_loader(name, ExecLoader({str(root / "myfork" / "util.py")!r}))
        if name == "ldm.modules.diffusionmodules.util":
            return importlib.util.spec_from_file_location(name, {util!r})
sys.meta_path.insert(0, Ahead())
copy = "customfork"
'''}[ahead]
    out = _run(root, f'''
gradpatch.apply()
{install}
import ldmblock
block = importlib.import_module(copy + ".block")
print(json.dumps([type(sys.meta_path[0]).__name__, step(ldmblock), statuses("ldm.modules.diffusionmodules.util:"),
                  step(block), statuses(copy + ".")]))
''')
    first, declared_trains, declared, copy_trains, copy = out
    assert first == {"typeguard": "TypeguardFinder", "custom finder": "Ahead"}[ahead]
    assert declared_trains is True and declared == [["ldm.CheckpointFunction", "applied"], ["ldm.checkpoint", "applied"]]
    assert copy_trains is True and copy == applied(f"{'tgfork' if ahead == 'typeguard' else 'customfork'}.util")


def test_6_a_target_run_where_gradpatch_cannot_see_is_reported_and_patched_by_apply_again(root):
    """A loader with only the deprecated ``load_module`` hides the body from every watcher, and so
    does the reload of a module through a loader with an ``exec_module`` of its own: the report says
    the target's body ran unseen (not "waiting to be imported", not "applied"), one warning per patch
    says what to do, and apply() again patches it."""
    util = importlib.util.find_spec("ldm").submodule_search_locations[0] + "/modules/diffusionmodules/util.py"
    out = _run(root, f'''
import importlib.util
class Legacy:  # a loader with load_module only: the import system runs no exec_module of anyone's
    def find_spec(self, name, path=None, target=None):
        if name == "ldm.modules.diffusionmodules.util":
            return importlib.util.spec_from_loader(name, self, origin={util!r})
    def load_module(self, name):
        import types
        module = sys.modules[name] = types.ModuleType(name)
        module.__file__, module.__loader__ = {util!r}, self
        exec(compile(open({util!r}).read(), {util!r}, "exec"), module.__dict__)
        return module
class ExecLoader(Legacy):  # a loader of its own, run by importlib.reload
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        exec(compile(open({util!r}).read(), {util!r}, "exec"), module.__dict__)
def reports(caught):
    return [found("ldm.modules.diffusionmodules.util:"), warned(caught)]
gradpatch.apply("ldm")
sys.meta_path.insert(0, Legacy())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import ldmblock
    imported = reports(caught)
before = step(ldmblock)
again = [r.status.value for r in gradpatch.apply("ldm") if r.target.startswith("ldm.modules.diffusionmodules.util:")]
patched = step(ldmblock)
sys.meta_path[0] = ExecLoader()
util = sys.modules["ldm.modules.diffusionmodules.util"]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    importlib.reload(util)
    reloaded = reports(caught) + [util.checkpoint.__module__]
gradpatch.apply("ldm")
print(json.dumps([imported, before, again, patched, reloaded, util.checkpoint.__module__]))
''')
    imported, before, again, patched, reloaded, module = out
    for (records, warnings), loader in [(imported, "Legacy"), (reloaded[:2], "ExecLoader")]:
        assert [r[1] for r in records] == ["deferred", "deferred"]
        assert all(r[2].startswith(f"ldm.modules.diffusionmodules.util's body ran (loaded by {loader}) without "
                                   "gradpatch seeing it") and "apply() again" in r[2] for r in records)
        assert len(warnings) == 2 and all("is not applied" in w for w in warnings)  # one per patch
    assert UPSTREAM in before and again == ["applied", "applied"] and patched is True
    assert reloaded[2] == "ldm.modules.diffusionmodules.util", "the unseen reload bound upstream's code"
    assert module.startswith("gradpatch."), "apply() again patched it"
