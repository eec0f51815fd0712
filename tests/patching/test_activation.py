"""Activation without code changes: GRADPATCH in fresh interpreters, `gradpatch run`, bad values."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, last_json, run_python

PROBE = """
import json, sys, warnings
import fakeup, fakeother
import gradpatch
print(json.dumps([fakeup.checkpoint(1), fakeother.checkpoint(1), 'torch' in sys.modules,
                  [(r.patch, r.status.value) for r in gradpatch.report()]]))
"""


@pytest.mark.parametrize("value", [None, "", "0", " 0 "])
def test_off_values_do_nothing(fake_upstream, value):
    env = {} if value is None else {"GRADPATCH": value}
    result = run_python(PROBE, env=env, pythonpath=[fake_upstream])
    value_up, _, torch_loaded, report = last_json(result)
    assert value_up == 2 and report == [] and not torch_loaded
    assert result.stderr == ""


@pytest.mark.parametrize("value", ["1", "all", "ALL", "true"])
def test_all_values_apply_every_patch(fake_upstream, value):
    value_up, value_other, torch_loaded, report = last_json(
        run_python(PROBE, env={"GRADPATCH": value}, pythonpath=[fake_upstream]))
    assert value_up == 102 and value_other == 3  # fakeother's code is unknown: left alone
    assert ("fakeup.checkpoint", "applied") in [tuple(r) for r in report]
    assert not torch_loaded, "activation must not import torch when no target needs it"


def test_a_list_of_names_and_exclude(fake_upstream):
    _, _, _, report = last_json(run_python(PROBE, env={"GRADPATCH": "fakeup, fakeother",
                                                       "GRADPATCH_EXCLUDE": "fakeother"},
                                           pythonpath=[fake_upstream]))
    assert dict(map(tuple, report)) == {"fakeup.checkpoint": "applied", "fakeother.checkpoint": "skipped"}


def test_explicit_arguments_beat_the_environment(fake_upstream):
    out = last_json(run_python("""
import json, gradpatch
gradpatch.apply("fakeup", checkpoint="always", exclude=[])
from gradpatch import settings
print(json.dumps([settings.checkpoint_policy, [r.patch for r in gradpatch.report()]]))
""", env={"GRADPATCH_CHECKPOINT": "never", "GRADPATCH_EXCLUDE": "fakeup"}, pythonpath=[fake_upstream]))
    assert out == ["always", ["fakeup.checkpoint"]]


@pytest.mark.parametrize("variable, value, expected", [
    ("GRADPATCH", "fakeupp", "unknown patch 'fakeupp' in GRADPATCH; did you mean 'fakeup'?"),
    ("GRADPATCH_STRICT", "maybe", "GRADPATCH_STRICT='maybe' is not a boolean"),
    ("GRADPATCH_CHECKPOINT", "sometimes", "GRADPATCH_CHECKPOINT='sometimes' is not one of respect, always, never"),
    ("GRADPATCH_LOG", "loud", "GRADPATCH_LOG='loud' is not a logging level"),
    ("GRADPATCH_EXCLUDE", "nothing", "unknown patch 'nothing' in GRADPATCH_EXCLUDE"),
])
def test_bad_environment_values_warn_once_and_the_program_runs(fake_upstream, variable, value, expected):
    env = {"GRADPATCH": "1", variable: value}
    result = run_python(PROBE, env=env, pythonpath=[fake_upstream])
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "ConfigWarning" in line]
    assert len(warnings) == 1 and expected in warnings[0], result.stderr


def test_strict_environment_turns_bad_values_into_errors(fake_upstream):
    result = run_python("print('ran')", env={"GRADPATCH": "nosuchpatch", "GRADPATCH_STRICT": "1"},
                        pythonpath=[fake_upstream])
    assert result.returncode == 1 and result.stdout == ""
    assert "gradpatch (GRADPATCH_STRICT=1): gradpatch: unknown patch 'nosuchpatch'" in result.stderr


def test_log_level_shows_what_was_applied(fake_upstream):
    result = run_python("import fakeup", env={"GRADPATCH": "fakeup", "GRADPATCH_LOG": "info"},
                        pythonpath=[fake_upstream])
    assert "gradpatch: applied fakeup.checkpoint to fakeup.util:checkpoint (fake V1)" in result.stderr


def test_child_processes_inherit_activation(fake_upstream, tmp_path):
    """subprocess children and multiprocessing spawn workers (as DataLoader workers use) are patched."""
    script = tmp_path / "parent.py"
    script.write_text("""
import json, subprocess, sys, multiprocessing as mp

def work(_):
    import fakeup
    return fakeup.checkpoint(1)

if __name__ == "__main__":
    child = subprocess.run([sys.executable, "-c", "import fakeup; print(fakeup.checkpoint(1))"],
                           capture_output=True, text=True).stdout.strip()
    with mp.get_context("spawn").Pool(1) as pool:
        spawned = pool.map(work, [0])[0]
    print(json.dumps([int(child), spawned]))
""")
    out = last_json(run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
                               env={"GRADPATCH": "1"}, pythonpath=[fake_upstream, tmp_path], timeout=120))
    assert out == [102, 102]


def test_gradpatch_run_execs_with_the_environment(fake_upstream):
    gradpatch_cli = Path(sys.executable).with_name("gradpatch")
    result = subprocess.run([str(gradpatch_cli), "run", "--patches", "fakeup", "--checkpoint", "never", "--",
                             sys.executable, "-c",
                             "import fakeup, os; print(fakeup.checkpoint(1), os.environ['GRADPATCH_CHECKPOINT'])"],
                            capture_output=True, text=True, env={"PYTHONPATH": str(fake_upstream), "PATH": ""})
    assert result.stdout.split() == ["102", "never"], result.stderr


def test_gradpatch_run_activates_over_an_off_value(fake_upstream):
    result = subprocess.run([sys.executable, "-m", "gradpatch", "run", "--", sys.executable, "-c",
                             "import fakeup; print(fakeup.checkpoint(1))"], capture_output=True, text=True,
                            env={"PYTHONPATH": f"{fake_upstream}:{ROOT}", "GRADPATCH": "off", "PATH": ""})
    assert result.stdout.split() == ["102"], result.stderr


def test_gradpatch_run_keeps_the_commands_own_double_dashes():
    result = subprocess.run([sys.executable, "-m", "gradpatch", "run", "--", sys.executable, "-c",
                             "import json, sys; print(json.dumps(sys.argv[1:]))", "--", "a", "--"],
                            capture_output=True, text=True)
    assert last_json(result) == ["--", "a", "--"]


def test_gradpatch_run_reports_a_missing_command():
    result = subprocess.run([sys.executable, "-m", "gradpatch", "run", "--", "no-such-command-xyz"],
                            capture_output=True, text=True)
    assert result.returncode == 127 and "cannot run 'no-such-command-xyz'" in result.stderr


def test_import_gradpatch_imports_neither_torch_nor_targets():
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", "import gradpatch"],
                            capture_output=True, text=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert "gradpatch" in imported
    assert not imported & {"torch", "wrapt", "audioldm", "diffusers", "f5_tts", "logging", "inspect"}


def test_startup_line_is_cheap_when_unset():
    """The .pth line when GRADPATCH is unset: measured, not asserted against a time (see benchmarks/)."""
    pth = Path(sys.executable).parent.parent / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "gradpatch.pth"
    assert pth.is_file(), "gradpatch.pth is installed next to the package"
    line = pth.read_text().strip()
    result = run_python(f"""
import json, os, sys
before = set(sys.modules)
exec({line!r})
print(json.dumps(sorted(set(sys.modules) - before)))
""")
    assert last_json(result) == []  # nothing imported: the line only reads one variable


@pytest.mark.parametrize("value, warned", [("1", True), ("audioldm", True), ("off", False), ("FALSE", False),
                                           ("no", False), (" 0 ", False)])
def test_missing_startup_file_warns_under_python_s(tmp_path, value, warned):
    # The package on the path, in an interpreter without site: no startup file can have run.
    shutil.copytree(ROOT / "gradpatch", tmp_path / "gradpatch")
    result = subprocess.run([sys.executable, "-S", "-c", "import gradpatch"], cwd=tmp_path,
                            capture_output=True, text=True, env={"GRADPATCH": value, "PYTHONPATH": str(tmp_path)})
    if warned:
        assert "StartupWarning" in result.stderr and "started with -S" in result.stderr, result.stderr
    else:
        assert result.stderr == "", "off values are off everywhere"


def test_missing_startup_file_warns_for_an_install_outside_site_packages(tmp_path):
    """`pip install --target DIR` + PYTHONPATH=DIR: gradpatch.pth lies in DIR, which Python does not
    read .pth files from, so nothing is patched: the warning must say so."""
    target = tmp_path / "target"
    shutil.copytree(ROOT / "gradpatch", target / "gradpatch")
    shutil.copy(ROOT / "startup" / "gradpatch.pth", target / "gradpatch.pth")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    result = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", "import gradpatch"], cwd=tmp_path,
                            capture_output=True, text=True, env={"GRADPATCH": "1", "PYTHONPATH": str(target)})
    assert "StartupWarning" in result.stderr and "not a site directory" in result.stderr, result.stderr


def test_no_startup_warning_when_the_startup_file_ran(fake_upstream):
    result = run_python("import gradpatch, fakeup; print(fakeup.checkpoint(1))", env={"GRADPATCH": "fakeup"},
                        pythonpath=[fake_upstream])
    assert result.stdout.split() == ["102"] and result.stderr == ""


def test_the_startup_line_and_the_package_agree_on_off():
    import ast

    import gradpatch

    line = (ROOT / "startup" / "gradpatch.pth").read_text()
    off = next(node for node in ast.walk(ast.parse(line)) if isinstance(node, ast.Tuple))
    assert tuple(ast.literal_eval(off)) == gradpatch._OFF
    for value in ["off", " No ", "FALSE"]:
        result = run_python(f"""
import json, os, sys
os.environ["GRADPATCH"] = {value!r}
before = set(sys.modules)
exec({line!r})
print(json.dumps(sorted(set(sys.modules) - before)))
""")
        assert last_json(result) == []


@pytest.mark.parametrize("env", [{"GRADPATCH_LOG": "\u00b2"}, {"GRADPATCH_LOG": "loud", "PYTHONWARNINGS": "error"},
                                 {"GRADPATCH_CHECKPOINT": "sometimes", "PYTHONWARNINGS": "error"},
                                 {"GRADPATCH_STRICT": "maybe", "PYTHONWARNINGS": "error"}])
def test_a_bad_value_never_stops_start_up_activation(fake_upstream, env):
    result = run_python("import fakeup; print(fakeup.checkpoint(1))", env={"GRADPATCH": "fakeup", **env},
                        pythonpath=[fake_upstream])
    assert result.returncode == 0 and result.stdout.split() == ["102"], result.stderr
    assert "ConfigWarning" in result.stderr and "Error processing line" not in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_cli_list_and_status_without_torch():
    listing = subprocess.run([sys.executable, "-m", "gradpatch", "list", "--all"], capture_output=True, text=True)
    assert listing.returncode == 0 and "audioldm.checkpoint" in listing.stdout
    status = subprocess.run([sys.executable, "-X", "importtime", "-m", "gradpatch", "status", "--json"],
                            capture_output=True, text=True)
    rows = {row["patch"]: row for row in json.loads(status.stdout)}
    assert rows["audioldm.checkpoint"]["code"].startswith("known: V1")
    assert rows["audioldm.checkpoint"]["installed"] is True
    assert "| torch\n" not in status.stderr + "\n"
