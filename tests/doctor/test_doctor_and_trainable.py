"""trainable() and the grad-flow doctor on the real AudioLDM UNet."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

import gradpatch
from gradpatch.testing import audioldm_batch, audioldm_unet

UPSTREAM_ERROR = "does not require grad"


def _step(model):
    batch = audioldm_batch()
    out = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
    torch.nn.functional.mse_loss(out, batch["target"]).backward()


def test_trainable_sets_the_mask_and_summarises():
    model = audioldm_unet()
    summary = gradpatch.trainable(model, include=["*attn2*"], exclude=["*attn2.to_out*"])
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all("attn2" in n and "to_out" not in n for n in names)
    assert summary.trained_tensors == len(names)
    assert summary.trained_elements == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert summary.total_elements == sum(p.numel() for p in model.parameters())
    assert sum(t for t, _, _ in summary.by_module.values()) == len(names)
    assert "trainable:" in str(summary) and "input_blocks" in str(summary)


def test_trainable_exclude_only_and_unmatched_patterns_warn():
    model = audioldm_unet()
    with pytest.warns(gradpatch.ConfigWarning, match=r"'\*atn2\*' matched no parameter"):
        summary = gradpatch.trainable(model, exclude=["*norm*", "*atn2*"])
    assert summary.unmatched == ("*atn2*",)
    assert all(p.requires_grad == ("norm" not in n) for n, p in model.named_parameters())


def test_doctor_names_the_broken_checkpoint_and_the_frozen_parameters():
    model = audioldm_unet()
    gradpatch.trainable(model, include=["*attn2*"])
    stream = io.StringIO()
    with pytest.raises(RuntimeError, match=UPSTREAM_ERROR) as raised:
        with gradpatch.grad_doctor(model, file=stream) as diagnosis:
            _step(model)
    text = stream.getvalue()
    assert "transformer_blocks.0 (BasicTransformerBlock)" in text
    assert "audioldm.latent_diffusion.util.checkpoint" in text and "GRADPATCH=1" in text
    (finding,) = diagnosis.findings  # the block whose backward raised, named exactly
    assert finding.module.endswith("transformer_blocks.0 (BasicTransformerBlock)")
    assert any(name.endswith("transformer_blocks.0.norm1.weight") for name in finding.parameters)
    assert not any("attn2" in name for name in finding.parameters)
    assert "gradpatch doctor" in "".join(getattr(raised.value, "__notes__", []))


def test_doctor_is_silent_on_a_working_patched_step():
    model = audioldm_unet()
    gradpatch.trainable(model, include=["*attn2*"])
    with gradpatch.applied("audioldm"):
        stream = io.StringIO()
        with gradpatch.grad_doctor(model, file=stream) as diagnosis:
            _step(model)
    assert not diagnosis and stream.getvalue() == ""


def test_doctor_reports_parameters_the_loss_never_reached():
    model = audioldm_unet()
    gradpatch.trainable(model, include=["*attn2*", "out.*"])
    with gradpatch.applied("audioldm"):
        batch = audioldm_batch()
        with torch.no_grad():  # a typical bug: the trunk under no_grad
            hidden = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
        loss = model.out(torch.randn(2, 32, 16, 16)).pow(2).mean() + hidden.pow(2).mean()
        loss.backward()
        diagnosis = gradpatch.explain_grads(model)
    assert len(diagnosis.findings) == 1
    finding = diagnosis.findings[0]
    assert "the loss does not depend on them" in finding.cause
    assert all("attn2" in name for name in finding.parameters)


def test_doctor_cli_runs_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("""
import torch, gradpatch
from gradpatch.testing import audioldm_batch, audioldm_unet
model = audioldm_unet()
gradpatch.trainable(model, include=["*attn2*"])
batch = audioldm_batch()
out = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
out.pow(2).mean().backward()
""")
    result = subprocess.run([sys.executable, "-m", "gradpatch", "doctor", str(script)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and UPSTREAM_ERROR in result.stderr
    assert "gradpatch doctor:" in result.stderr and "BasicTransformerBlock" in result.stderr
    fixed = subprocess.run([sys.executable, "-m", "gradpatch", "doctor", str(script)], capture_output=True,
                           text=True, env={**__import__("os").environ, "GRADPATCH": "audioldm"})
    assert fixed.returncode == 0, fixed.stderr
    assert "gradpatch doctor" not in fixed.stderr


REENTRANT_SCRIPT = """
import torch
from torch.utils.checkpoint import checkpoint
from helper import WIDTH  # a sibling module: the script's folder must be first on sys.path

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return checkpoint(self.lin, x, use_reentrant=True)

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.block(x))

model = Model()
model(torch.randn(2, WIDTH)).sum().backward()
"""


@pytest.mark.parametrize("gradpatch_env", ["", "1"])
def test_doctor_cli_imports_siblings_and_advises_non_reentrant_for_user_code(tmp_path, gradpatch_env):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "helper.py").write_text("WIDTH = 4\n")
    (tmp_path / "project" / "train.py").write_text(REENTRANT_SCRIPT)
    env = {**__import__("os").environ, "GRADPATCH": gradpatch_env}
    result = subprocess.run([sys.executable, "-W", "ignore", "-m", "gradpatch", "doctor", "project/train.py"],
                            capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "block (Block): block.lin.weight, block.lin.bias" in result.stderr
    assert "use_reentrant=False" in result.stderr and "non_reentrant" in result.stderr
    assert "GRADPATCH=1" not in result.stderr  # it cannot help: gradpatch does not patch user code


def test_doctor_cli_reports_a_missing_script(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gradpatch", "doctor", "no_such_script.py"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cannot run 'no_such_script.py': no such file" in result.stderr
