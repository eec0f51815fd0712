"""No silent skips (hooks loaded by ``conftest.py``).

A test skipped because a module cannot be imported (``pytest.importorskip`` at module level, in a fixture
or in a test) fails instead where the running environment declares that module:

- the main environment (``.venv``, which ``make test`` builds from ``requirements/test.txt``,
  ``upstream.txt`` and ``upstream-build.txt``; or any environment under ``CI=true``) declares every
  package the tests import: there, every such skip fails;
- the lowest- and newest-torch environments (``.venv-torch-lower``, ``.venv-torch-newest``) declare what
  their ``requirements/torch-*.txt`` lists: a test of a package listed there fails, one of an upstream
  package the file leaves out skips with its reason;
- the lerobot environment (``.venv-lerobot``) declares ``requirements/lerobot.txt``; a package tested
  only there (``ELSEWHERE``) skips in every other environment, with a reason naming its environment;
- elsewhere (an environment of one's own) the skip stays a skip.

The environment is the one ``GRADPATCH_TEST_ENV`` names (``main``, ``torch-lower``, ``torch-newest``, ``lerobot``: the
Makefile sets it), else the one the virtual environment's folder name says.

Under ``CI=true`` in the main environment, the session fails too when any test skipped for a reason that
does not name CUDA (CUDA-only tests may skip on a machine without a GPU), and those skips are listed at the
end of the report.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements"
#: The Makefile's virtual environments, by the name of their requirements file ("main": all of test.txt,
#: upstream.txt, upstream-build.txt); the Makefile also says it in GRADPATCH_TEST_ENV.
VENVS = {".venv": "main", ".venv-torch-lower": "torch-lower", ".venv-torch-newest": "torch-newest",
         ".venv-lerobot": "lerobot"}
#: Upstream packages whose tests run only in an environment of their own (``lerobot`` needs Python >= 3.12):
#: elsewhere, the main environment included, their import skip stays a skip, and it is not one of the
#: non-CUDA skips that fail a CI run (its reason names the environment, ``make test`` runs it there).
ELSEWHERE = {"lerobot": "lerobot"}
_ELSEWHERE_REASON = re.compile(r"runs in the ([\w-]+) test environment")
_COULD_NOT_IMPORT = re.compile(r"could not import '([\w.]+)'(?:: No module named '([\w.]+)')?")


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9][\w.-]*)", line.split("#", 1)[0])
        if match:
            names.add(_canonical(match.group(1)))
    return names


def _environment_name() -> str | None:
    name = os.environ.get("GRADPATCH_TEST_ENV") or VENVS.get(Path(sys.prefix).name)
    return name or ("main" if _ci() else None)


def _environment() -> tuple[str, set[str] | None] | None:
    """(its name, the declared distributions, None meaning all) where missing modules fail; else None."""
    name = _environment_name()
    if name is None:
        return None
    if name == "main":
        return "the main test environment", None
    return f"the {name} test environment", _declared(REQUIREMENTS / f"{name}.txt")


ENVIRONMENT = _environment()


_importorskip = pytest.importorskip


def importorskip(modname: str, minversion: str | None = None, reason: str | None = None, **kwargs):
    """``pytest.importorskip``, whose skip reason names the module even where ``reason`` is given."""
    __tracebackhide__ = True
    try:
        return _importorskip(modname, minversion, reason, **kwargs)
    except pytest.skip.Exception:
        if reason is None or modname in sys.modules:  # named already, or too old (not missing)
            raise
        raise pytest.skip.Exception(f"{reason} (could not import {modname!r})", allow_module_level=True) from None


pytest.importorskip = importorskip  # every test module reads it at call time


def _failure(text: str) -> str | None:
    """Why a skip with this reason must fail here, or None."""
    match = _COULD_NOT_IMPORT.search(text)
    if ENVIRONMENT is None or match is None:
        return None
    module = match.group(2) or match.group(1)
    where, declared = ENVIRONMENT
    if ELSEWHERE.get(_canonical(module.split(".")[0]), _environment_name()) != _environment_name():
        return None
    if declared is not None and _canonical(module.split(".")[0]) not in declared:
        return None
    return (f"{module} cannot be imported, but {where} ({sys.prefix}) declares it (requirements/): a missing "
            f"package of the test environment fails rather than skip its tests. Skip reason: {text}")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.skipped:
        why = _failure(str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr))
        if why:
            report.outcome, report.longrepr, report.result = "failed", why, []
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple):
        why = _failure(str(report.longrepr[-1]))
        if why:
            report.outcome, report.longrepr = "failed", why
    return report


_non_cuda_skips: list[str] = []


def _note(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[-1])
        if "cuda" not in reason.lower() and not _ELSEWHERE_REASON.search(reason):
            _non_cuda_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _note(report)


def pytest_collectreport(report):
    _note(report)


def _strict(config) -> bool:
    """CI in the main environment, in the process that reports (not an xdist worker)."""
    return _ci() and _environment_name() == "main" and not hasattr(config, "workerinput")


def pytest_sessionfinish(session, exitstatus):
    if _strict(session.config) and _non_cuda_skips and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _strict(config) and _non_cuda_skips:
        terminalreporter.section("skips that are not CUDA ones (CI=true: the run fails)", red=True)
        for line in _non_cuda_skips:
            terminalreporter.line(line)
