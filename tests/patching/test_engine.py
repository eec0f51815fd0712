"""The engine on fake targets, each scenario in a fresh interpreter (import order matters)."""
from __future__ import annotations

import json

from support import FAKE_UTIL, last_json, run_python

REPORT = "[r.as_dict() for r in gradpatch.report()]"


def _run(fake, code, **env):
    return last_json(run_python("import json, warnings\nimport gradpatch\n" + code, env=env,
                                pythonpath=[fake]))


def test_apply_before_import_patches_every_binding(fake_upstream):
    out = _run(fake_upstream, f"""
report = gradpatch.apply("fakeup")
deferred = [r.status.value for r in report]
import fakeup, fakeup.user, fakeup.util
print(json.dumps([deferred, fakeup.util.checkpoint(1), fakeup.checkpoint(1), fakeup.user.checkpoint(1),
                  {REPORT}]))
""")
    deferred, util, package, user, report = out
    assert deferred == ["deferred"]
    assert util == package == user == 102
    assert report[0]["status"] == "applied" and report[0]["variant"] == "fake V1"
    assert report[0]["version"] == "1.0" and report[0]["rebound"] == []


def test_apply_after_import_rebinds_and_reports(fake_upstream):
    out = _run(fake_upstream, f"""
import fakeup, fakeup.user
from fakeup.util import checkpoint as mine
gradpatch.apply("fakeup")
print(json.dumps([fakeup.util.checkpoint(1), fakeup.user.checkpoint(1), mine(1), {REPORT}]))
""")
    util, user, mine, report = out
    assert util == user == mine == 102, "globals of every loaded module, __main__ too, are rebound"
    assert set(report[0]["rebound"]) == {"fakeup.checkpoint", "fakeup.user.checkpoint", "__main__.mine"}


def test_revert_restores_identity_everywhere(fake_upstream):
    out = _run(fake_upstream, """
gradpatch.apply("fakeup")
import fakeup, fakeup.user, fakeup.util
held = [fakeup.util.checkpoint]  # not a module global: stays the fix
gradpatch.revert()
print(json.dumps([fakeup.util.checkpoint(1), fakeup.checkpoint is fakeup.util.checkpoint,
                  fakeup.user.checkpoint is fakeup.util.checkpoint, held[0] is not fakeup.util.checkpoint,
                  fakeup.util.checkpoint.__module__, [r.status.value for r in gradpatch.report()]]))
""")
    assert out == [2, True, True, True, "fakeup.util", ["reverted"]]


def test_apply_revert_cycles_never_double_wrap(fake_upstream):
    out = _run(fake_upstream, """
import fakeup.util
original = fakeup.util.checkpoint
values = []
for _ in range(20):
    gradpatch.apply("fakeup"); gradpatch.apply("fakeup")  # idempotent
    values.append(fakeup.util.checkpoint(1))
    gradpatch.revert()
    values.append(fakeup.util.checkpoint(1))
print(json.dumps([sorted(set(values)), fakeup.util.checkpoint is original]))
""")
    assert out == [[2, 102], True]


def test_revert_after_reimport_leaves_wanted_off(fake_upstream):
    out = _run(fake_upstream, """
gradpatch.apply("fakeup")
gradpatch.revert("fakeup")
import fakeup  # imported after revert: the hook fires but the patch is no longer wanted
print(json.dumps([fakeup.checkpoint(1)]))
""")
    assert out == [2]


def test_scoped_applied(fake_upstream):
    out = _run(fake_upstream, """
import fakeup.util
with gradpatch.applied("fakeup", checkpoint="never") as report:
    inside = [fakeup.util.checkpoint(1), gradpatch.settings.checkpoint_policy]
print(json.dumps([inside, fakeup.util.checkpoint(1), gradpatch.settings.checkpoint_policy]))
""".replace("gradpatch.settings", "__import__('gradpatch.settings').settings"))
    assert out == [[102, "never"], 2, "respect"]


def test_concurrent_apply_and_import(fake_upstream):
    out = _run(fake_upstream, """
import threading
barrier = threading.Barrier(8)
def work(i):
    barrier.wait()
    if i % 2:
        gradpatch.apply("fakeup")
    else:
        import fakeup.user
threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
import fakeup, fakeup.user, fakeup.util
print(json.dumps([fakeup.util.checkpoint(1), fakeup.user.checkpoint(1), fakeup.checkpoint(1)]))
""")
    assert out == [102, 102, 102]


def test_unknown_code_is_skipped_with_a_warning(fake_upstream):
    out = _run(fake_upstream, f"""
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    gradpatch.apply("fakeother")
    import fakeother
print(json.dumps([fakeother.checkpoint(1), [type(w.message).__name__ for w in caught],
                  [str(w.message) for w in caught], {REPORT}]))
""")
    value, categories, messages, report = out
    assert value == 3 and categories == ["UnknownCodeWarning"]
    assert "does not match any known version" in messages[0]
    assert report[0]["status"] == "skipped" and report[0]["reason"].startswith("unknown code")


def test_failing_fix_never_breaks_the_import(fake_upstream):
    out = _run(fake_upstream, f"""
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    gradpatch.apply("fakebroken")
    import fakebroken
print(json.dumps([fakebroken.checkpoint(1), [type(w.message).__name__ for w in caught], {REPORT}]))
""")
    value, categories, report = out
    assert value == 2 and categories == ["PatchFailedWarning"]
    assert report[0]["status"] == "failed" and "this fix is broken" in report[0]["reason"]


def test_strict_mode_raises_into_the_import(fake_upstream):
    result = run_python("""
import gradpatch
gradpatch.apply("fakebroken", strict=True)
import fakebroken
""", pythonpath=[fake_upstream])
    assert result.returncode != 0 and "GradpatchError" in result.stderr
    assert "this fix is broken" in result.stderr


def test_version_outside_range_is_skipped(fake_upstream):
    (fake_upstream / "fakeup-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakeup\nVersion: 2.5\n")
    out = _run(fake_upstream, f"""
gradpatch.apply("fakeup")
import fakeup
print(json.dumps([fakeup.checkpoint(1), {REPORT}]))
""")
    assert out[0] == 2
    assert out[1][0]["status"] == "skipped" and "outside the supported range" in out[1][0]["reason"]


def test_exclude_and_unknown_names(fake_upstream):
    out = _run(fake_upstream, f"""
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    gradpatch.apply("fakeup", "fakeother", "fakeupp", exclude=["fakeother"])
print(json.dumps([[str(w.message) for w in caught], {REPORT}]))
""")
    messages, report = out
    assert len(messages) == 1 and "unknown patch 'fakeupp'" in messages[0] and "did you mean 'fakeup'" in messages[0]
    assert {r["patch"]: r["status"] for r in report} == {"fakeup.checkpoint": "deferred",
                                                        "fakeother.checkpoint": "skipped"}


def test_a_target_that_raises_on_import_is_left_to_raise(fake_upstream):
    out = _run(fake_upstream, """
gradpatch.apply()
try:
    import fakeraise
except ImportError as exc:
    error = str(exc)
import fakeup
print(json.dumps([error, fakeup.checkpoint(1)]))
""")
    assert out == ["fakeraise is broken", 102]


def test_report_prints_a_table(fake_upstream):
    result = run_python("""
import gradpatch
gradpatch.apply("fakeup")
import fakeup
print(gradpatch.report())
print(gradpatch.report().table(wide=True))
""", pythonpath=[fake_upstream])
    lines = result.stdout.strip().splitlines()
    assert lines[:2] == ["gradpatch: 1 patch: 1 applied", "fakeup: 1 applied"]
    assert lines[2].split() == ["patch", "status", "reason"]
    assert lines[3].split()[:2] == ["fakeup.checkpoint", "applied"]
    assert lines[6].split() == ["patch", "status", "target", "reason"]
    assert lines[7].split()[:3] == ["fakeup.checkpoint", "applied", "fakeup.util:checkpoint"]


def test_records_are_json_serialisable(fake_upstream):
    out = _run(fake_upstream, f"gradpatch.apply('fakeup')\nprint(json.dumps({REPORT}))")
    assert json.loads(json.dumps(out))[0]["target"] == "fakeup.util:checkpoint"


def test_apply_revert_storm_from_eight_threads(fake_upstream):
    """100 apply/revert cycles in each of 8 threads while other threads call the target."""
    out = _run(fake_upstream, """
import threading
import fakeup.util, fakeup.user
original = fakeup.util.checkpoint
errors, seen = [], set()
def storm():
    try:
        for _ in range(100):
            gradpatch.apply("fakeup")
            seen.add(fakeup.user.checkpoint(1))
            gradpatch.revert("fakeup")
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=storm) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
gradpatch.apply("fakeup")
applied_value = fakeup.util.checkpoint(1)
gradpatch.revert()
print(json.dumps([errors, sorted(seen), applied_value, fakeup.util.checkpoint is original,
                  fakeup.user.checkpoint is original, fakeup.checkpoint is original]))
""")
    errors, seen, applied_value, *identity = out
    assert errors == [] and set(seen) <= {2, 102} and applied_value == 102
    assert identity == [True, True, True]  # never double-wrapped, originals restored everywhere


def test_target_imported_from_many_threads_at_once(fake_upstream):
    out = _run(fake_upstream, """
import threading, importlib
gradpatch.apply()
barrier = threading.Barrier(8)
values = []
def load(name):
    barrier.wait()
    values.append(importlib.import_module(name).checkpoint(1))
# Every thread imports a submodule, so each first imports its package. (Importing a package in one
# thread and, directly, a submodule its __init__ imports in another can raise _DeadlockError in
# CPython itself, python/cpython#83065, with or without gradpatch.)
threads = [threading.Thread(target=load, args=(n,)) for n in ["fakeup.user"] * 6 + ["fakeother.user"] * 2]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps([sorted(values), sorted((r.patch, r.status.value) for r in gradpatch.report())]))
""")
    values, statuses = out
    assert values == [3, 3] + [102] * 6
    assert ["fakeup.checkpoint", "applied"] in statuses and ["fakeother.checkpoint", "skipped"] in statuses


def test_a_package_importing_a_target_from_a_thread_during_its_init(fake_upstream):
    """wrapt's own finder deadlocks here (it imports the parent package under the global import lock
    while the parent's __init__ waits for the thread); gradpatch's finder resolves specs directly."""
    (fake_upstream / "fakeup" / "__init__.py").write_text(
        "import threading, importlib\n"
        "loader = threading.Thread(target=importlib.import_module, args=('fakeup.util',))\n"
        "loader.start(); loader.join(timeout=20)\n"
        "assert not loader.is_alive(), 'import deadlocked'\n"
        "from fakeup.util import checkpoint\n")
    result = run_python("import gradpatch, json\ngradpatch.apply('fakeup')\nimport fakeup\n"
                        "print(json.dumps([fakeup.checkpoint(1)]))", pythonpath=[fake_upstream], timeout=60)
    assert last_json(result) == [102]


def test_late_apply_of_an_imported_name_rebinds_only_inside_its_package(fake_upstream):
    """A patch of a name the target imported (like torch's checkpoint bound into sgm) must not
    rebind the name in its defining module or in unrelated packages."""
    (fake_upstream / "fakeshared.py").write_text(FAKE_UTIL)
    (fake_upstream / "fakeup" / "util.py").write_text("from fakeshared import checkpoint\n")
    (fake_upstream / "fakeup" / "user.py").write_text("from fakeshared import checkpoint\n")
    (fake_upstream / "bystander.py").write_text("from fakeshared import checkpoint\n")
    out = _run(fake_upstream, f"""
from gradpatch.patching.fingerprint import IsObject
from gradpatch.patching.patch import Patch
from gradpatch.patching import activation
activation.known_patches()["fakeup.imported"] = Patch(
    "fakeup.imported", "fakeup.util:checkpoint", "fakeplugin:fix", IsObject("fakeshared:checkpoint", "shared"),
    "fakeup", "adds 100")
import fakeshared, bystander, fakeup.util, fakeup.user
gradpatch.apply("fakeup.imported")
print(json.dumps([fakeup.util.checkpoint(1), fakeup.user.checkpoint(1), fakeshared.checkpoint(1),
                  bystander.checkpoint(1), {REPORT}[0]["rebound"]]))
""")
    assert out == [102, 102, 2, 2, ["fakeup.checkpoint", "fakeup.user.checkpoint"]]
