"""The README's demo runs end to end (a few steps, so the suite stays fast)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from support import ROOT

pytestmark = pytest.mark.slow


def test_demo_shows_the_upstream_error_then_trains():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_audioldm.py"), "--steps", "5"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "backward() raised: One of the differentiated Tensors does not require grad" in out
    assert "audioldm.checkpoint" in out and "applied" in out
    difference = float(out.split("max relative difference ")[1].split()[0])
    assert difference <= 1e-5 and "(same set: True)" in out
    assert "loss " in out and " -> " in out
