"""No silently unpatched target, no leaked setting: races, reloads, strict mode, forks, arguments.

Each scenario runs in a fresh interpreter on the fake targets of ``conftest.fake_upstream``.
"""
from __future__ import annotations

import os

import pytest

from support import last_json, run_python

REPORT = "[(r.patch, r.status.value, r.reason) for r in gradpatch.report()]"


def _run(fake, code, **env):
    return last_json(run_python("import json, warnings\nimport gradpatch\n" + code, env=env,
                                pythonpath=[fake], timeout=120))


@pytest.mark.parametrize("defined", ["before", "after"])
def test_apply_while_another_thread_runs_the_target_body(fake_upstream, defined):
    """apply() lands while another thread is inside fakeup.util's body (which waits on a gate
    either before or after defining ``checkpoint``): the patch goes in when that body finishes,
    before ``fakeup/__init__`` binds the name, and the report says applied."""
    (fake_upstream / "gate.py").write_text("import threading\nentered, release = threading.Event(), threading.Event()\n")
    util = (fake_upstream / "fakeup" / "util.py").read_text()
    wait = "import gate\ngate.entered.set()\ngate.release.wait(30)\n"
    (fake_upstream / "fakeup" / "util.py").write_text(wait + util if defined == "before" else util + wait)
    out = _run(fake_upstream, f"""
import threading, gate
importer = threading.Thread(target=__import__, args=("fakeup",))
importer.start()
assert gate.entered.wait(30)
during = [r.status.value for r in gradpatch.apply("fakeup")]
gate.release.set()
importer.join(30)
import fakeup, fakeup.util, fakeup.user
print(json.dumps([during, fakeup.util.checkpoint(1), fakeup.checkpoint(1), fakeup.user.checkpoint(1), {REPORT}]))
""")
    during, util, package, user, report = out
    assert during == ["deferred"]
    assert [util, package, user] == [102, 102, 102]
    assert report == [["fakeup.checkpoint", "applied", "adds 100"]]


def test_apply_from_inside_the_target_body(fake_upstream):
    """The same thread: a module imported by the target's own body calls apply()."""
    (fake_upstream / "fakeup" / "util.py").write_text(
        "import gradpatch\ngradpatch.apply('fakeup')\n" + (fake_upstream / "fakeup" / "util.py").read_text())
    out = _run(fake_upstream, f"import fakeup\nprint(json.dumps([fakeup.checkpoint(1), {REPORT}]))")
    assert out == [102, [["fakeup.checkpoint", "applied", "adds 100"]]]


@pytest.mark.parametrize("order", ["apply first", "import first"])
def test_reload_is_patched_again_and_revert_restores_everything(fake_upstream, order):
    first, second = ("gradpatch.apply('fakeup')", "import fakeup, fakeup.util, fakeup.user")
    if order == "import first":
        first, second = second, first
    out = _run(fake_upstream, f"""
import importlib
{first}
{second}
fix = fakeup.util.checkpoint
importlib.reload(fakeup.util)
reloaded = [fakeup.util.checkpoint is not fix, fakeup.util.checkpoint(1), {REPORT}]
gradpatch.revert()
print(json.dumps([reloaded, fakeup.util.checkpoint(1), fakeup.util.checkpoint.__module__,
                  fakeup.user.checkpoint(1), fakeup.checkpoint(1)]))
""")
    reloaded, after_util, module, after_user, after_package = out
    assert reloaded == [True, 102, [["fakeup.checkpoint", "applied", "adds 100"]]]
    assert [after_util, module, after_user, after_package] == [2, "fakeup.util", 2, 2]


def test_reimport_after_removal_from_sys_modules_is_patched(fake_upstream):
    out = _run(fake_upstream, """
import sys
gradpatch.apply("fakeup")
import fakeup.util
first = fakeup.util.checkpoint(1)
for name in [n for n in sys.modules if n.startswith("fakeup")]:
    del sys.modules[name]
import fakeup.util
print(json.dumps([first, fakeup.util.checkpoint(1)]))
""")
    assert out == [102, 102]


def test_strict_rejection_persists_and_is_recorded_as_skipped(fake_upstream):
    out = _run(fake_upstream, f"""
gradpatch.apply("fakeother", strict=True)
errors = []
for attempt in range(2):
    try:
        import fakeother
        errors.append(fakeother.checkpoint(1))
    except gradpatch.GradpatchError as exc:
        errors.append(str(exc))
print(json.dumps([errors, {REPORT}]))
""")
    errors, report = out
    assert all(isinstance(e, str) and "does not match any known version" in e for e in errors), errors
    assert "failed" not in errors[0] and "GradpatchError" not in errors[0]  # the reason, not nested
    assert report[0][:2] == ["fakeother.checkpoint", "skipped"] and report[0][2].startswith("unknown code")


@pytest.mark.parametrize("variable, value", [("GRADPATCH_CHECKPOINT", "sometimes"), ("GRADPATCH_LOG", "loud"),
                                             ("GRADPATCH_EXCLUDE", "nothing")])
def test_strict_applies_to_environment_values(fake_upstream, variable, value):
    out = _run(fake_upstream, """
from gradpatch import settings
try:
    gradpatch.apply("fakeup", strict=True)
    outcome = "applied"
except gradpatch.GradpatchError as exc:
    outcome = str(exc)
print(json.dumps([outcome, settings.strict]))
""", **{variable: value})
    outcome, strict_after = out
    assert f"{variable}=" in outcome or "'nothing' in GRADPATCH_EXCLUDE" in outcome
    assert strict_after is False, "a raising apply(strict=True) must not leave strict mode on"


def test_strict_environment_refuses_a_bad_log_level_at_start_up(fake_upstream):
    result = run_python("print('ran')", env={"GRADPATCH": "1", "GRADPATCH_STRICT": "1", "GRADPATCH_LOG": "loud"},
                        pythonpath=[fake_upstream])
    assert result.returncode == 1 and result.stdout == ""
    assert "GRADPATCH_LOG='loud' is not a logging level" in result.stderr


def test_a_raising_strict_apply_leaves_later_hooks_lenient(fake_upstream):
    out = _run(fake_upstream, """
from gradpatch import settings
gradpatch.apply("fakebroken")
try:
    gradpatch.apply("nosuchpatch", strict=True)
except gradpatch.GradpatchError:
    pass
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import fakebroken  # its fix raises: a warning, not an error, once strictness is back off
print(json.dumps([settings.strict, fakebroken.checkpoint(1), [type(w.message).__name__ for w in caught]]))
""")
    assert out == [False, 2, ["PatchFailedWarning"]]


def test_names_and_exclude_take_strings_or_iterables(fake_upstream):
    out = _run(fake_upstream, """
import fakeup, fakeother
by_string = sorted((r.patch, r.status.value) for r in gradpatch.apply("fakeup", "fakeother", exclude="fakeother"))
gradpatch.revert()
by_list = sorted((r.patch, r.status.value) for r in gradpatch.apply(["fakeup"], exclude=("fakeother",)))
errors = []
for args, kwargs in [((5,), {}), ((["fakeup", None],), {}), ((), {"exclude": 3}), ((b"fakeup",), {})]:
    try:
        gradpatch.apply(*args, **kwargs)
    except TypeError as exc:
        errors.append(str(exc))
print(json.dumps([by_string, by_list, errors]))
""")
    by_string, by_list, errors = out
    assert by_string == [["fakeother.checkpoint", "skipped"], ["fakeup.checkpoint", "applied"]]
    assert by_list == [["fakeup.checkpoint", "applied"]]
    assert len(errors) == 4 and all("a string or an iterable of strings" in e for e in errors), errors


def test_concurrent_scoped_blocks_keep_their_own_settings(fake_upstream):
    """Eight threads enter and leave applied(checkpoint=...) / checkpoint_policy_scope blocks in
    interleaved order: each sees its own policy inside, and the process-wide one is intact after."""
    out = _run(fake_upstream, """
import threading
from gradpatch import settings
policies = ["never", "always"] * 4
barrier = threading.Barrier(8)
seen, errors = [], []
def work(i):
    try:
        for round in range(30):
            policy = policies[(i + round) % 8]
            scope = gradpatch.applied("fakeup", checkpoint=policy) if i % 2 else settings.checkpoint_policy_scope(policy)
            barrier.wait()
            with scope:
                barrier.wait()
                seen.append(settings.checkpoint_policy == policy)
            barrier.wait()
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps([errors, all(seen), len(seen), settings.checkpoint_policy, settings.strict,
                  "checkpoint_policy" in vars(settings)]))
""")
    assert out == [[], True, 240, "respect", False, True]


def test_applied_strict_is_local_to_its_context(fake_upstream):
    out = _run(fake_upstream, """
import threading
from gradpatch import settings
inside, other = [], []
with gradpatch.applied("fakeup", strict=True):
    inside.append(settings.strict)
    t = threading.Thread(target=lambda: other.append(settings.strict)); t.start(); t.join()
print(json.dumps([inside, other, settings.strict]))
""")
    assert out == [[True], [False], False]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_another_thread_holds_the_locks(fake_upstream):
    out = _run(fake_upstream, """
import contextlib, os, threading, time
from gradpatch.patching import activation, ledger
from gradpatch import settings
import gradpatch.sampling.run as sampling
import gradpatch.sampling.shadows as shadows
held, done = threading.Event(), threading.Event()
def hold():
    with contextlib.ExitStack() as stack:
        for module in (activation, ledger, settings, sampling, shadows):
            if hasattr(module, "_lock"):
                stack.enter_context(module._lock)
        stack.enter_context(ledger.LEDGER.locked())
        held.set()
        done.wait(30)
holder = threading.Thread(target=hold); holder.start(); assert held.wait(30)
pid = os.fork()
if pid == 0:  # the child: every gradpatch entry point that takes a lock must work
    import fakeup
    gradpatch.apply("fakeup")
    with settings.checkpoint_policy_scope("never"):
        pass
    with sampling.shadow(fakeup, "checkpoint", lambda original: original):
        pass
    os._exit(0 if fakeup.checkpoint(1) == 102 and gradpatch.report() else 3)
deadline, status = time.time() + 60, None
while time.time() < deadline:
    finished, code = os.waitpid(pid, os.WNOHANG)
    if finished:
        status = os.waitstatus_to_exitcode(code)
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9); os.waitpid(pid, 0)
done.set(); holder.join()
print(json.dumps([status]))
""")
    assert out == [0], "the child deadlocked (None) or failed"
