"""Build the wheel and sdist, install the wheel into a fresh venv, activate by GRADPATCH, uninstall."""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from support import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--sdist", "--outdir", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True)
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


def test_wheel_ships_the_catalogue_and_the_startup_files(built):
    names = set(zipfile.ZipFile(built["wheel"]).namelist())
    assert {"gradpatch.pth", "gradpatch.start", "gradpatch/__init__.py", "gradpatch/checkpointing/checkpoint.py",
            "gradpatch/patches/__init__.py", "gradpatch/patches/audioldm.py"} <= names
    assert not any(name.startswith(("tests/", "patches/", "startup/")) for name in names)
    sdist = {Path(n).relative_to(Path(n).parts[0]).as_posix() for n in tarfile.open(built["sdist"]).getnames()[1:]}
    assert {"patches/audioldm.py", "startup/gradpatch.pth", "tests/patching/test_engine.py", "pyproject.toml"} <= sdist


def test_wheel_installs_activates_and_uninstalls_cleanly(built, tmp_path, fake_upstream):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # Reuse torch and packaging from the test environment (sorted before gradpatch.pth).
    (site / "aa_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(built["wheel"])],
                   check=True)
    assert (site / "gradpatch.pth").is_file() and (site / "gradpatch.start").is_file()

    probe = ("import json, fakeup, gradpatch; print(json.dumps([fakeup.checkpoint(1), gradpatch.__file__, "
             "[r.status.value for r in gradpatch.report()]]))")
    env = {"PYTHONPATH": str(fake_upstream), "GRADPATCH": "1", "PATH": ""}
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    value, location, statuses = json.loads(result.stdout.strip().splitlines()[-1])
    assert value == 102 and location.startswith(str(site)) and "applied" in statuses, result.stderr
    listing = subprocess.run([str(venv / "bin" / "gradpatch"), "list", "--all"], capture_output=True, text=True)
    assert "ldm.checkpoint" in listing.stdout and "guided_diffusion.checkpoint" in listing.stdout

    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", "gradpatch"], check=True)
    assert not (site / "gradpatch.pth").exists() and not (site / "gradpatch.start").exists()
    assert not (site / "gradpatch").exists()
    after = subprocess.run([str(python), "-c", "print('still runs')"], capture_output=True, text=True, env=env)
    assert after.stdout.strip() == "still runs" and after.stderr == ""
