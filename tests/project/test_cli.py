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
    narrow = gradpatch(command, "--all")
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
    lines = text.splitlines()
    # Counts first, then by codebase; a report this short shows every record.
    assert widest(text) <= WIDTH and lines[0] == "gradpatch: 3 patches: 1 applied, 2 deferred"
    assert lines[1] == "audioldm: 1 applied" and lines[2].split() == ["patch", "status", "reason"]
    assert "nosuchpkg" not in text and "torch.checkpoint" in text  # installed but not imported: shown
    assert lines[-1] == ("(and 1 deferred for packages not installed here "
                         "(report().table(all=True) lists them))")
    everything = report.table(all=True)
    assert "nosuchpkg.CheckpointFunction" in everything and widest(everything) <= WIDTH
    wide = report.table(all=True, wide=True).splitlines()
    assert wide[2].split() == ["patch", "status", "target", "reason"]
    assert len([line for line in wide if line.startswith("  ")]) == 4 and any(long.strip() in line for line in wide)
    only_missing = Report([report[1]])
    assert str(only_missing).startswith("gradpatch: 1 deferred for packages not installed here")


def _records(codebases: dict[str, list[str]]) -> list:
    from gradpatch.patching.patch import Record, Status

    return [Record(f"{name}.p{i}", name, f"json.{name}:p{i}", Status(status),  # json: installed
                   "unknown code (fingerprint 0123456789abcdef)" if status == "skipped" else
                   "waiting for os.path to be imported" if status == "deferred" else "fixed it")
            for name, statuses in codebases.items() for i, status in enumerate(statuses)]


def test_a_long_report_leads_with_counts_one_line_per_codebase_and_filters_by_codebase():
    from gradpatch.patching.patch import Report

    report = Report(_records({"alpha": ["applied"] * 30, "beta": ["applied"] * 5 + ["skipped"],
                              "gamma": ["deferred"] * 12, "delta-x": ["deferred"] * 3}))
    lines = str(report).splitlines()
    assert lines[0] == "gradpatch: 51 patches: 35 applied, 15 deferred, 1 skipped"
    assert lines[1] == "alpha: 30 applied" and lines[2] == "beta: 5 applied, 1 skipped"
    assert lines[3].split() == ["patch", "status", "reason"]  # only what asks for attention is listed
    assert lines[4].split()[:2] == ["beta.p5", "skipped"] and "alpha.p0" not in str(report)
    assert lines[5] == "waiting for their module to be imported: gamma (12), delta-x (3)"
    assert lines[6] == 'every record of one codebase: report().table("NAME"); of all: report().table(all=True)'
    assert len(lines) == 7 and widest(str(report)) <= WIDTH
    alpha = report.table("alpha").splitlines()
    assert alpha[0] == "gradpatch: 30 patches: 30 applied" and len(alpha) == 33
    assert all("alpha.p" in line for line in alpha[3:]) and report.table("Delta_X").count("delta-x.p") == 3
    assert report.table("nope").startswith("gradpatch: no record of codebase 'nope' here (codebases: alpha, beta")
    assert len(report.table(all=True).splitlines()) == 1 + 4 + 1 + 51


def test_the_whole_catalogue_fits_100_columns_in_the_report_and_the_list():
    from support import run_python

    result = run_python("""
import warnings, gradpatch
warnings.simplefilter("ignore")
report = gradpatch.apply()
print(str(report)); print("=" * 10); print(report.table(all=True))
""")
    assert result.returncode == 0, result.stderr
    summary, everything = result.stdout.split("=" * 10 + "\n")
    assert widest(summary) <= WIDTH and widest(everything) <= WIDTH
    assert summary.startswith("gradpatch: ") and len(summary.splitlines()) <= 10, summary
    from gradpatch.patching.activation import known_patches

    assert all(name in everything for name in known_patches())
    listing = gradpatch("list")
    lines = listing.stdout.splitlines()
    codebases = {patch.upstream for patch in known_patches().values()}
    assert lines[0] == (f"gradpatch: {len(known_patches())} patches for {len(codebases)} codebases "
                        "(one codebase: gradpatch list NAME; every patch: --all)")
    assert len(lines) == len(codebases) + 2 and widest(listing.stdout) <= WIDTH
    assert next(line for line in lines if line.startswith("f5_tts ")).split() == ["f5_tts", "1", "CFM.sample"]
    one = gradpatch("list", "audioldm").stdout
    assert one.startswith("gradpatch: 22 patches for audioldm\n") and widest(one) <= WIDTH
    assert all(name in one for name in known_patches() if name.startswith("audioldm."))
    assert "audioldm2." not in one and "f5_tts" not in one
    every = gradpatch("list", "--all").stdout
    assert widest(every) <= WIDTH and all(name in every for name in known_patches())
    wrong = gradpatch("list", "f5")
    assert wrong.returncode == 2 and "no codebase 'f5'; did you mean 'f5_tts'?" in wrong.stderr


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
