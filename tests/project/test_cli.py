"""The ``gradpatch`` command as a newcomer meets it: version, help, tables that fit a terminal, status
that tells the truth about what gets imported, and the report() table."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

WIDTH = 100


def gradpatch(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "gradpatch", *args], capture_output=True, text=True, cwd=cwd,
                          env=full_env, timeout=120)


def widest(text: str) -> int:
    return max(map(len, text.splitlines()))


def test_version_says_which_copy_is_imported():
    result = gradpatch("--version")
    assert result.returncode == 0
    assert result.stdout.startswith(f"gradpatch 0.1.0 from {ROOT / 'gradpatch'} (Python ")


def test_bare_command_prints_help():
    result = gradpatch()
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: gradpatch")
    assert all(command in result.stdout for command in ("list", "status", "run", "doctor", "--version"))


def test_doctor_without_a_script_prints_its_usage():
    result = gradpatch("doctor")
    assert result.returncode == 2 and "required" not in result.stderr
    assert result.stdout.startswith("usage: gradpatch doctor") and "the training script" in result.stdout


@pytest.mark.parametrize("command", ["list", "status"])
def test_tables_fit_100_columns_and_wide_and_json_keep_everything(command):
    narrow = gradpatch(command, *(["--all"] if command == "status" else []))
    assert narrow.returncode == 0, narrow.stderr
    assert widest(narrow.stdout) <= WIDTH
    assert "audioldm.checkpoint" in narrow.stdout
    wide = gradpatch(command, "--wide")
    target = "audioldm2.latent_diffusion.modules.diffusionmodules.util:CheckpointFunction"
    line = next(line for line in wide.stdout.splitlines() if line.startswith("audioldm2.CheckpointFunction "))
    assert target in line and widest(wide.stdout) > WIDTH
    rows = {row["patch"]: row for row in json.loads(gradpatch(command, "--json").stdout)}
    assert rows["audioldm2.CheckpointFunction"]["target"] == target


def test_status_says_first_whether_gradpatch_is_active_then_summarises():
    from gradpatch.cli_status import activity_line, startup_file
    from gradpatch.patching.activation import known_patches as gradpatch_catalogue

    off = gradpatch("status")
    lines = off.stdout.splitlines()
    upstreams = {patch.upstream for patch in gradpatch_catalogue().values()}
    # Short: a heading, one line per upstream codebase at most, the pointer to --all.
    assert off.returncode == 0 and widest(off.stdout) <= WIDTH and len(lines) <= len(upstreams) + 3, off.stdout
    assert lines[0].startswith("gradpatch: NOT active (GRADPATCH unset, ")
    assert any(line.startswith("  audioldm 0.1.1: 22 patches (22 code known)") for line in lines), lines
    assert lines[-1] == "every patch: gradpatch status --all (or --wide, --json)"
    on = gradpatch("status", env={"GRADPATCH": "1"}).stdout.splitlines()[0]
    assert startup_file() is not None  # this test environment installs the start-up file
    assert on.startswith("gradpatch: ACTIVE in every Python process here (GRADPATCH=1, start-up file ")
    everything = gradpatch("status", "--all", env={"GRADPATCH": "0"}).stdout.splitlines()
    assert everything[0].startswith("gradpatch: NOT active (GRADPATCH=0, ") and len(everything) > 100
    assert activity_line({"GRADPATCH": "f5-tts"}, None) == (
        "gradpatch: active only where imported (GRADPATCH=f5-tts; no start-up file): import gradpatch.auto")
    assert "no start-up file" in activity_line({}, None) and len(activity_line({"GRADPATCH": "x" * 90}, "/p" * 80)) <= WIDTH


def test_status_reports_the_copy_that_gets_imported(tmp_path):
    installed = json.loads(gradpatch("status", "--json", cwd=tmp_path).stdout)
    row = next(r for r in installed if r["patch"] == "audioldm.checkpoint")
    assert row["version"] == "0.1.1" and row["shadowed"] is None
    # A local copy of the package in the working directory shadows the installed distribution.
    source = Path(row["path"])
    local = tmp_path / "audioldm" / "latent_diffusion"
    local.mkdir(parents=True)
    (tmp_path / "audioldm" / "__init__.py").write_text("")
    (local / "__init__.py").write_text("")
    shutil.copy(source, local / "util.py")
    shadowed = json.loads(gradpatch("status", "--json", cwd=tmp_path).stdout)
    row = next(r for r in shadowed if r["patch"] == "audioldm.checkpoint")
    assert row["version"] is None and row["path"] == str(local / "util.py")
    assert row["shadowed"] == f"a local copy is imported: {local / 'util.py'} (installed: audioldm 0.1.1)"
    assert row["code"].startswith("known: V1")  # recognised from the copy that is imported
    table = gradpatch("status", "--all", cwd=tmp_path).stdout
    assert "local copy" in table and widest(table) <= WIDTH


def test_report_table_fits_and_shows_deferred_rows_of_missing_packages_on_request():
    from gradpatch.patching.patch import Record, Report, Status

    long = "fixed checkpoint: frozen params, None inputs, dropout RNG, autocast, double backward " * 2
    report = Report([
        Record("audioldm.checkpoint", "audioldm", "audioldm.latent_diffusion.util:checkpoint", Status.APPLIED, long),
        Record("nosuchpkg.CheckpointFunction", "nosuchpkg", "nosuchpkg.modules.diffusionmodules.util:CheckpointFunction",
               Status.DEFERRED, "waiting for nosuchpkg.modules.diffusionmodules.util to be imported"),
        Record("torch.checkpoint", "torch", "torch.utils.checkpoint:checkpoint", Status.DEFERRED, "waiting"),
    ])
    text = str(report)
    assert widest(text) <= WIDTH and text.splitlines()[0].split() == ["patch", "status", "target", "reason"]
    assert "nosuchpkg" not in text and "torch.checkpoint" in text  # installed but not imported: shown
    assert text.splitlines()[-1] == ("(and 1 deferred for packages not installed here "
                                     "(report().table(all=True) lists them))")
    everything = report.table(all=True)
    assert "nosuchpkg.CheckpointFunction" in everything and widest(everything) <= WIDTH
    wide = report.table(all=True, wide=True).splitlines()
    assert len(wide) == 4 and long.strip() in wide[1]
    only_missing = Report([report[1]])
    assert str(only_missing).startswith("gradpatch: 1 deferred for packages not installed here")


@pytest.mark.slow
def test_doctor_prints_its_diagnosis_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("""
import gradpatch
from gradpatch.testing import audioldm_batch, audioldm_unet
model = audioldm_unet()
gradpatch.trainable(model, include=["*attn2*"])
batch = audioldm_batch()
model(batch["x"], timesteps=batch["timesteps"], y=batch["y"]).pow(2).mean().backward()
""")
    result = gradpatch("doctor", str(script), env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0 and "does not require grad" in result.stderr
    assert result.stderr.count("gradpatch doctor:") == 1, result.stderr
    assert result.stderr.count("output_blocks.1.1.transformer_blocks.0 (BasicTransformerBlock)") == 1
