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
    # The parameters the upstream backward raised on are labelled frozen; every line fits 100 columns.
    assert finding.frozen and " (frozen)\n" in text and max(map(len, text.splitlines())) <= 100, text


def test_doctor_says_in_one_line_that_a_working_patched_step_is_healthy():
    model = audioldm_unet()
    gradpatch.trainable(model, include=["*attn2*"])
    trained = sum(p.requires_grad for p in model.parameters())
    with gradpatch.applied("audioldm"):
        stream = io.StringIO()
        with gradpatch.grad_doctor(model, file=stream) as diagnosis:
            _step(model)
    assert not diagnosis and trained > 0
    assert stream.getvalue() == f"gradpatch doctor: every trainable parameter got a gradient ({trained} tensors)\n"


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
    assert fixed.stderr.count("gradpatch doctor") == 1, fixed.stderr  # one line: healthy
    assert "gradpatch doctor: every trainable parameter got a gradient (" in fixed.stderr


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


def test_findings_wrap_at_100_columns_and_keep_paths_whole():
    from gradpatch.doctor.diagnosis import Diagnosis, Finding, healthy_line

    path = "/a/very/long/path/to/the/project/that/someone/keeps/their/training/code/in/train_with_lora.py:11;"
    finding = Finding("model.blocks.3 (Block)", tuple(f"model.blocks.3.layer{i}.weight" for i in range(9)),
                      "Block runs torch's reentrant checkpoint (use_reentrant=True or unspecified), called at "
                      + path + " no input of that call required grad, so the parameters inside get no gradient",
                      "pass use_reentrant=False there, or bind gradpatch.checkpointing.checkpoint.non_reentrant("
                      "torch.utils.checkpoint.checkpoint) in its place", frozen=True)
    text = str(Diagnosis([finding]))
    lines = text.splitlines()
    assert lines[0] == "gradpatch doctor:" and max(len(line) for line in lines if path not in line) <= 100, text
    assert lines[1].startswith("- model.blocks.3 (Block): model.blocks.3.layer0.weight, ")
    assert text.count(" and 5 more (frozen)") == 1 and path in text  # a path is never cut
    assert lines[3].startswith("    cause: Block runs") and any(line.startswith("    fix:   pass") for line in lines)
    assert healthy_line(1) == "gradpatch doctor: every trainable parameter got a gradient (1 tensor)"
    assert healthy_line(7, 2) == "gradpatch doctor: every trainable parameter got a gradient (7 tensors in 2 models)"
    assert str(Diagnosis(trainable=0)) == "gradpatch doctor: no parameter requires grad"
