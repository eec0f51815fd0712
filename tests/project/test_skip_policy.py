"""No silent skips (``skip_policy``): a tiny suite run by pytest in a fresh interpreter, as each
environment of ``make test`` runs it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/, holding skip_policy

CONFTEST = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from skip_policy import (pytest_collectreport, pytest_make_collect_report, pytest_runtest_logreport,  # noqa: F401
                         pytest_runtest_makereport, pytest_sessionfinish, pytest_terminal_summary)
"""

SUITE = {
    "test_module_level.py": "import pytest\npytest.importorskip('no_such_module_x')\n\ndef test_x():\n    pass\n",
    "test_inside.py": """
import pytest

def test_with_reason():
    pytest.importorskip("no_such_module_y", reason="upstream is not here")

@pytest.fixture
def numpy_or_skip():
    pytest.importorskip("numpy_not_installed_here")

def test_in_fixture(numpy_or_skip):
    pass

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_cuda():
    pass

def test_other_skip():
    pytest.skip("needs fork")

def test_passes():
    pass
""",
}


def _run(tmp_path: Path, environment: str, ci: bool) -> subprocess.CompletedProcess:
    for name, text in {"conftest.py": CONFTEST, **SUITE}.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in {"CI", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"}}
    env.update(GRADPATCH_TEST_ENV=environment, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **({"CI": "true"} if ci else {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra",
                           "--continue-on-collection-errors", "-o", "addopts=", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("ci", [False, True], ids=["local", "CI"])
def test_main_environment_fails_missing_modules_and_under_ci_any_skip_but_cuda(tmp_path, ci):
    done = _run(tmp_path, "main", ci)
    out = done.stdout
    for missing in ("no_such_module_x", "no_such_module_y", "numpy_not_installed_here"):
        assert f"{missing} cannot be imported, but the main test environment" in out, out
    assert "upstream is not here (could not import 'no_such_module_y')" in out, out
    assert "1 failed, 1 passed, 2 skipped, 2 errors" in out, out
    assert ("skips that are not CUDA ones" in out) is ci, out
    if ci:
        section = out.split("skips that are not CUDA ones")[-1].split("short test summary")[0]
        assert "test_inside.py::test_other_skip: Skipped: needs fork" in section and "test_cuda" not in section, out
    assert done.returncode == 1


def test_an_environment_of_its_own_skips_what_its_requirements_leave_out(tmp_path):
    """torch-lower declares numpy, not the upstream packages: their tests skip, with the reason, CI or not."""
    (tmp_path / "test_declared.py").write_text("import pytest\n\ndef test_numpy():\n"
                                               "    pytest.importorskip('numpy.no_such_submodule')\n")
    done = _run(tmp_path, "torch-lower", ci=True)
    out = done.stdout
    assert "no_such_module_x" in out and "upstream is not here (could not import 'no_such_module_y')" in out, out
    assert "numpy.no_such_submodule cannot be imported, but the torch-lower test environment" in out, out
    assert "1 failed, 1 passed, 5 skipped" in out and done.returncode == 1, out
