"""Fixtures and hooks of the suite; helpers live in ``support.py`` (``from support import ...``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# No silent skips: a missing package the environment declares fails its tests (see skip_policy).
from skip_policy import (pytest_collectreport, pytest_make_collect_report, pytest_runtest_logreport,  # noqa: F401
                         pytest_runtest_makereport, pytest_sessionfinish, pytest_terminal_summary)
from support import FAKE_PLUGIN, FAKE_UTIL

#: LeRobot 0.6.1 needs Python >= 3.12: its tests run in an environment of their own (``make test-lerobot``,
#: GRADPATCH_TEST_ENV=lerobot, where a missing package fails them) and are not collected in the others.
collect_ignore = ["upstream/test_lerobot.py"] if sys.version_info < (3, 12) or os.environ.get(
    "GRADPATCH_TEST_ENV", "lerobot") != "lerobot" else []


@pytest.fixture
def fake_upstream(tmp_path: Path) -> Path:
    """A directory to put on PYTHONPATH holding fake targets and a plug-in declaring their patches.

    ``fakeup`` has known code and an installed distribution (1.0); ``fakeother`` has code whose
    fingerprint is unknown; ``fakebroken`` has known code but a fix that raises; ``fakeraise``
    raises on import. Each package's ``__init__`` and a ``user`` module rebind ``checkpoint``.
    """
    from gradpatch.patching.fingerprint import fingerprint_source

    known = fingerprint_source(FAKE_UTIL, ["checkpoint"])
    for name, util in [("fakeup", FAKE_UTIL), ("fakebroken", FAKE_UTIL),
                       ("fakeother", FAKE_UTIL.replace("x + 1", "x + 2"))]:
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text(f"from {name}.util import checkpoint\n")
        (package / "util.py").write_text(util)
        (package / "user.py").write_text(f"from {name}.util import checkpoint\n")
    (tmp_path / "fakeraise").mkdir()
    (tmp_path / "fakeraise" / "__init__.py").write_text("raise ImportError('fakeraise is broken')\n")
    (tmp_path / "fakeplugin.py").write_text(FAKE_PLUGIN % {"known": known})
    for dist, version, entry_points in [("fakeplugin", "0.1", "[gradpatch.patches]\nfake = fakeplugin\n"),
                                         ("fakeup", "1.0", "")]:
        info = tmp_path / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(entry_points)
    return tmp_path


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models on 2 shared cores: intra-op threads only add contention (measured ~10x the CPU
    time for the diffusers tests)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
