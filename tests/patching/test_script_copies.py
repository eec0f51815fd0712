"""A copy of the OpenAI/CompVis checkpoint written into the training script itself, under the three
ways a script runs without an import (fresh interpreters): ``GRADPATCH=1 python train.py``, ``python -m
pkg.train`` and ``runpy.run_path``.

No import ends a script's body, so gradpatch examines the script when ``apply()`` runs and when the
script's own code imports a module after defining the copy: then the copy is patched, and a block
with a frozen parameter gets the gradients of its body run without checkpointing (float64). A copy
defined after both gets a ``skipped`` row in ``report()`` and one warning, and runs upstream's code.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, assert_grads_close

pytestmark = pytest.mark.slow

HEAD = '''
import json, sys, torch
from torch import nn
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)

'''

BODY = '''

class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm, self.proj, self.out = nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return checkpoint(self._forward, (x,), self.parameters(), True)

    def _forward(self, x):
        return x + self.out(torch.relu(self.proj(self.norm(x))))

{after}
block = Block()
block.norm.requires_grad_(False)  # frozen: upstream's backward raises
trainable = [p for p in block.parameters() if p.requires_grad]
x = torch.randn(3, 8)
def grads(run):
    return [g.tolist() for g in torch.autograd.grad(run(x).square().mean(), trainable)]
try:
    got = grads(block)
except RuntimeError as exc:
    got = str(exc)
want = grads(block._forward)  # the hand-written reference: the body without checkpointing
import gradpatch
rows = sorted((r.patch, r.status.value, r.reason) for r in gradpatch.report() if r.patch.startswith(("__main__", "<run_path>")))
print(json.dumps([got, want, rows]))
'''

AFTER = {
    "apply": "import gradpatch\ngradpatch.apply()",  # apply() after the definition
    "import": "{import_helper}",  # the script imports a module of its own after the definition
    "nothing": "",  # GRADPATCH=1 applied before the script's first line; nothing after the definition
}
UPSTREAM_ERROR = "One of the differentiated Tensors does not require grad"


@pytest.fixture(scope="module")
def copy_source() -> str:
    """``checkpoint`` and ``CheckpointFunction`` as the installed stable-diffusion-sdkit defines them
    (V2), copied into the script."""
    ldm = importlib.util.find_spec("ldm")  # the top-level package only: nothing is imported
    source = (Path(ldm.submodule_search_locations[0]) / "modules" / "diffusionmodules" / "util.py").read_text()
    lines = source.splitlines()
    return "\n\n\n".join("\n".join(lines[node.lineno - 1:node.end_lineno]) for node in ast.parse(source).body
                         if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                         and node.name in ("checkpoint", "CheckpointFunction"))


def _launch(tmp_path: Path, form: str, source: str, after: str) -> subprocess.CompletedProcess:
    """Write the script for ``form`` under ``tmp_path`` and run it with ``GRADPATCH=1``."""
    if form == "module":
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "__init__.py").write_text("")
        (tmp_path / "pkg" / "helper.py").write_text("VALUE = 1\n")
        script, argv = tmp_path / "pkg" / "train.py", ["-m", "pkg.train"]
        after = after.format(import_helper="from pkg import helper")
    else:
        (tmp_path / "helper.py").write_text("VALUE = 1\n")
        script = tmp_path / "train.py"
        argv = ["train.py"] if form == "script" else ["-c", "import runpy; runpy.run_path('train.py')"]
        after = after.format(import_helper="import helper")
    script.write_text(HEAD + source + BODY.format(after=after))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    env.update(GRADPATCH="1", PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def _result(done: subprocess.CompletedProcess) -> tuple[object, object, list]:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("form", ["script", "module", "run_path"])
@pytest.mark.parametrize("after", ["apply", "import"])
def test_a_copy_defined_before_gradpatch_examines_the_script_is_patched(tmp_path, copy_source, form, after):
    import torch

    got, want, rows = _result(_launch(tmp_path, form, copy_source, AFTER[after]))
    assert not isinstance(got, str), f"not patched: {got}"
    assert_grads_close([torch.tensor(g) for g in got], [torch.tensor(w) for w in want], rtol=1e-10)
    name = "__main__" if form != "run_path" else "<run_path>"
    assert [tuple(row[:2]) for row in rows] == [(f"{name}.CheckpointFunction", "applied"), (f"{name}.checkpoint", "applied")]


@pytest.mark.parametrize("form", ["script", "module", "run_path"])
def test_a_copy_defined_after_gradpatch_last_examined_the_script_is_reported_and_warned_about(
        tmp_path, copy_source, form):
    done = _launch(tmp_path, form, copy_source, AFTER["nothing"])
    got, _, rows = _result(done)
    assert UPSTREAM_ERROR in got  # upstream's code ran: gradpatch says so, it does not hide it
    name = "__main__" if form != "run_path" else "<run_path>"
    assert [tuple(row[:2]) for row in rows] == [(f"{name}.CheckpointFunction", "skipped"), (f"{name}.checkpoint", "skipped")]
    assert all("call gradpatch.apply() after defining it" in row[2] for row in rows)
    warned = [line for line in done.stderr.splitlines() if "PatchFailedWarning" in line]
    assert len(warned) == 1, done.stderr  # report() and the exit check say it once
    assert f"the running script ({name}, " in warned[0] and "defines checkpoint, CheckpointFunction" in warned[0]
    assert "Call gradpatch.apply() after defining checkpoint, CheckpointFunction" in warned[0]


def test_without_report_the_warning_comes_at_exit(tmp_path, copy_source):
    source = copy_source + "\n\nprint('defined')\n"
    (tmp_path / "train.py").write_text(HEAD + source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    env.update(GRADPATCH="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "defined", done.stderr
    warned = [line for line in done.stderr.splitlines() if "PatchFailedWarning" in line]
    assert len(warned) == 1 and "the running script (__main__, train.py) defines checkpoint" in warned[0], done.stderr
