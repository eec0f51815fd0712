"""The training-stack recipes (docs/how-to/training-stack.md), run as written and compared with a reference.

Each recipe runs in a fresh interpreter with ``GRADPATCH=1`` (the accelerate one also through
``accelerate launch``). A prologue records, at every optimizer step (a global step post-hook, so it
sees the steps accelerate and Lightning take), the gradient of every parameter the optimizer holds.
The reference is the same script without any checkpointing: the fixed checkpoint under the ``never``
policy (``func(*inputs)``, which is upstream's block with its blockers removed), torch's checkpoint
replaced by a direct call and ``torch.compile`` by the identity. Gradients must agree at every step,
``None`` where the reference has ``None``, within 1e-5 of the step's largest reference gradient
(under bf16 autocast: 2**-7, bf16's rounding, measured 5e-3 to 7e-3, and only at the first step,
since AdamW turns such differences into different weights for the next).
A new release of PEFT, diffusers, accelerate, Lightning or torch that breaks a combination fails here.

The compile recipe runs with ``backend="aot_eager"``: dynamo and AOTAutograd trace and partition the
same graphs as with the default inductor backend, without inductor's C++ code generation, which took
5 minutes on 2 CPU cores (``RECIPES_INDUCTOR=1`` runs it as written; it passed so).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from support import ROOT

SECTION = (ROOT / "docs" / "how-to" / "training-stack.md").read_text(encoding="utf-8")
RECIPES = dict(re.findall(r"<!-- not run: tests/project/test_recipes.py runs it \(recipe ([a-z0-9-]+)\)[^>]*-->\n"
                          r"```python\n(.*?)```", SECTION, re.S))

RECORD = '''
import atexit, os, torch, torch.optim.optimizer as _optimizer
_steps = []

def _record(optimizer, args, kwargs):
    _steps.append([None if p.grad is None else p.grad.detach().double().clone()
                   for group in optimizer.param_groups for p in group["params"]])

_optimizer.register_optimizer_step_post_hook(_record)
from gradpatch.checkpointing import recompute  # count the fixed checkpoint's recomputes in backward
_recomputes, _backward = [], recompute.Recompute.backward
recompute.Recompute.backward = staticmethod(lambda ctx, *grads: (_recomputes.append(1), _backward(ctx, *grads))[1])
atexit.register(lambda: torch.save({"steps": _steps, "recomputes": len(_recomputes)},
                                  os.environ["RECIPE_OUT"] + os.environ.get("RANK", "")))
torch.manual_seed(0)
'''

WITHOUT_CHECKPOINTING = '''
import torch.utils.checkpoint as _checkpoint
_OPTIONS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")

def _direct(function, *args, **kwargs):
    for option in _OPTIONS:
        kwargs.pop(option, None)
    return function(*args, **kwargs)

_checkpoint.checkpoint = _direct
torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda m: m)
'''


def run(name: str, tmp_path: Path, reference: bool, launcher: list[str] = ()) -> list:
    script = tmp_path / f"{name}-{'reference' if reference else 'recipe'}.py"
    code = RECIPES[name.replace("lightning-1.9", "lightning")]
    if name == "lightning-1.9":  # the page: "pytorch_lightning 1.9 the same way"
        code = code.replace("import lightning as L", "import pytorch_lightning as L").replace('"bf16-mixed"', '"bf16"')
    if name == "compile" and not os.environ.get("RECIPES_INDUCTOR"):
        assert "torch.compile(model)" in code
        code = code.replace("torch.compile(model)", 'torch.compile(model, backend="aot_eager")')
    script.write_text(RECORD + (WITHOUT_CHECKPOINTING if reference else "") + code)
    out = script.with_suffix(".pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    env.update(GRADPATCH="1", RECIPE_OUT=str(out), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    if reference:
        env["GRADPATCH_CHECKPOINT"] = "never"
    command = [*launcher, str(script)] if launcher else [sys.executable, str(script)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    saved = torch.load(f"{out}0" if "torch.distributed.run" in launcher else out)
    if reference:
        assert saved["recomputes"] == 0
    elif name in RECOMPUTED:  # the recipe exercises the fixed checkpoint's recompute, not only its forward
        assert saved["recomputes"] > 0
    return saved["steps"]


def assert_same_steps(got: list, want: list, steps: int, rtol: float = 1e-5) -> None:
    assert len(got) == len(want) == steps
    if rtol > 1e-5:  # bf16: the first step's rounding moves the weights, later gradients follow them
        got, want = got[:1], want[:1]
    for step, (g, w) in enumerate(zip(got, want)):
        assert [x is None for x in g] == [x is None for x in w], f"step {step}: other parameters got gradients"
        present = [(a, b) for a, b in zip(g, w) if b is not None]
        assert present, f"step {step}: no gradient at all"
        scale = max(b.abs().max().item() for _, b in present)
        assert scale > 0, f"step {step}: every gradient is zero"
        error = max((a - b).abs().max().item() for a, b in present)
        assert error <= rtol * scale, f"step {step}: gradients differ by {error:.3g} (largest {scale:.3g})"


def test_the_section_holds_every_recipe_and_the_launchers():
    assert list(RECIPES) == ["peft-audioldm", "peft-f5", "diffusers", "accelerate", "lightning", "compile"]
    assert "GRADPATCH=1 accelerate launch train.py" in SECTION
    assert "GRADPATCH=1 torchrun --nproc_per_node=2 train.py" in SECTION


STEPS = {"peft-audioldm": 2, "peft-f5": 2, "diffusers": 2, "accelerate": 2, "lightning": 2, "lightning-1.9": 2,
         "compile": 2}
RECOMPUTED = {"peft-audioldm", "accelerate", "lightning", "lightning-1.9"}  # AudioLDM's blocks through the fast path
BF16 = 2 ** -7  # the recipes under bf16 autocast: one rounding of bf16 (8-bit significand)
RTOL = {"accelerate": BF16, "lightning": BF16, "lightning-1.9": BF16}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STEPS))
def test_recipe_gives_the_gradients_of_the_run_without_checkpointing(name, tmp_path):
    assert_same_steps(run(name, tmp_path, reference=False), run(name, tmp_path, reference=True), STEPS[name],
                      RTOL.get(name, 1e-5))


@pytest.mark.slow
def test_accelerate_recipe_under_accelerate_launch(tmp_path):
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    assert launcher, "accelerate's launcher is installed with it"
    launched = run("accelerate", tmp_path, reference=False, launcher=[launcher, "launch", "--num_processes=1",
                                                                      "--num_machines=1", "--cpu",
                                                                      "--mixed_precision=no", "--dynamo_backend=no"])
    assert_same_steps(launched, run("accelerate", tmp_path, reference=True), STEPS["accelerate"], BF16)


def test_lightning_2_and_pytorch_lightning_1_coexist():
    code = textwrap.dedent("""
        import lightning, pytorch_lightning
        print(lightning.__version__, pytorch_lightning.__version__)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    modern, legacy = result.stdout.split()
    assert modern.startswith("2.") and legacy.startswith("1.9.")


@pytest.mark.slow
def test_accelerate_recipe_under_torchrun_two_ranks(tmp_path):
    """The launchers pointer: ``GRADPATCH=1 torchrun --nproc_per_node=2 train.py``, here the accelerate
    recipe as DDP over gloo, against the same two-rank run without checkpointing (rank 0's gradients,
    all-reduced)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert_same_steps(run("accelerate", tmp_path, reference=False, launcher=torchrun),
                      run("accelerate", tmp_path, reference=True, launcher=torchrun), STEPS["accelerate"], BF16)
    assert len(list(tmp_path.glob("*.pt1"))) == 2  # rank 1 trained too, in both runs
