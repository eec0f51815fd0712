"""Shared test helpers. Import-order tests run in fresh interpreters (``run_python``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None,
               pythonpath: list[Path] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment (so gradpatch.pth is active)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([str(p) for p in pythonpath] + [full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def last_json(result: subprocess.CompletedProcess) -> object:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


FAKE_UTIL = '''
def checkpoint(x):
    """A stand-in for a known-broken function."""
    return x + 1
'''

FAKE_PLUGIN = '''
from gradpatch.fingerprint import Fingerprints
from gradpatch.registry import Patch

def fix(original):
    def checkpoint(x):
        return original(x) + 100
    return checkpoint

def broken_fix(original):
    raise RuntimeError("this fix is broken")

PATCHES = [
    Patch("fakeup.checkpoint", "fakeup.util:checkpoint", "fakeplugin:fix",
          Fingerprints({"%(known)s": "fake V1"}), "fakeup", "adds 100", "fakeup>=1,<2"),
    Patch("fakebroken.checkpoint", "fakebroken.util:checkpoint", "fakeplugin:broken_fix",
          Fingerprints({"%(known)s": "fake V1"}), "fakebroken", "raises"),
    Patch("fakeother.checkpoint", "fakeother.util:checkpoint", "fakeplugin:fix",
          Fingerprints({"%(known)s": "fake V1"}), "fakeother", "adds 100"),
]
'''


@pytest.fixture
def fake_upstream(tmp_path: Path) -> Path:
    """A directory to put on PYTHONPATH holding fake targets and a plug-in declaring their patches.

    ``fakeup`` has known code and an installed distribution (1.0); ``fakeother`` has code whose
    fingerprint is unknown; ``fakebroken`` has known code but a fix that raises; ``fakeraise``
    raises on import. Each package's ``__init__`` and a ``user`` module rebind ``checkpoint``.
    """
    from gradpatch.fingerprint import fingerprint_source

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
