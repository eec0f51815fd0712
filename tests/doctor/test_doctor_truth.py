"""The grad-flow doctor on real runs: silent on healthy ones, right (cause and fix) on broken ones.

Healthy: PEFT LoRA on the AudioLDM UNet with its checkpointed blocks (``lora_A`` gets an exactly zero
first gradient, since PEFT starts ``lora_B`` at zero), F5-TTS sampled with ``cache=False`` inside
the loss. Broken: F5's sampler called with its default ``cache=True`` inside the loss, torch's
reentrant checkpoint called by any name, upstream AudioLDM without gradpatch.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

import gradpatch
from gradpatch.testing import audioldm_batch, audioldm_unet

LORA_STEP = """
import torch
from peft import LoraConfig, get_peft_model
from gradpatch.testing import audioldm_batch, audioldm_unet

unet = audioldm_unet(use_checkpoint=True)
model = get_peft_model(unet, LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
batch = audioldm_batch()
for _ in range(2):
    out = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
    torch.nn.functional.mse_loss(out, batch["target"]).backward()
    first = model.base_model.model.input_blocks[3][1].transformer_blocks[0].attn1.to_q.lora_A.default.weight.grad
    print("lora_A grad all zero:", bool((first == 0).all()))
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # grads stay as zero tensors: reached is not "non-zero"
"""

F5_STEP = """
import torch
from gradpatch.testing import f5_cfm, f5_inputs

model = f5_cfm()
cond, text = f5_inputs()
out, _ = model.sample(cond, text, duration=12, steps=2, cfg_strength=2.0{options})
out.square().mean().backward()
print("grads:", sum(p.grad is not None for p in model.parameters()))
"""

REENTRANT = """
import torch
{imports}

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))

    def forward(self, x):
        return {call}

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = torch.nn.Embedding(8, 4), Block(), torch.nn.Linear(4, 1)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))

model = Model()
model.embed.requires_grad_(False)  # a frozen embedding: no input of the block requires grad
model(torch.tensor([1, 2, 3])).sum().backward()
"""

CALLS = {  # (imports, call, the module the finding names)
    "attribute path": ("import torch.utils.checkpoint", "torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)",
                       "block.inner (Sequential)"),
    "alias": ("import torch.utils.checkpoint as cp", "cp.checkpoint(self.inner, x)", "block.inner (Sequential)"),
    "renamed": ("from torch.utils.checkpoint import checkpoint as ckpt",
                "ckpt(lambda v: self.inner(v), x, use_reentrant=True)", "block (Block)"),
    "checkpoint_sequential": ("from torch.utils.checkpoint import checkpoint_sequential",
                              "checkpoint_sequential(self.inner, 2, x, use_reentrant=True)", "block (Block)"),
}


def healthy_only(stderr: str) -> bool:
    """The doctor said one thing: that every trainable parameter got a gradient."""
    said = [line for line in stderr.splitlines() if "gradpatch doctor" in line]
    return len(said) == 1 and said[0].startswith("gradpatch doctor: every trainable parameter got a gradient (")


def doctor(script: str, tmp_path, gradpatch_env: str = "") -> subprocess.CompletedProcess:
    path = tmp_path / "train.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    env.update(GRADPATCH=gradpatch_env, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "gradpatch", "doctor", str(path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


def test_healthy_peft_lora_run_on_audioldm_says_so_in_one_line(tmp_path):
    result = doctor(LORA_STEP, tmp_path, "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("lora_A grad all zero: True") == 1, result.stdout  # the first step's
    assert healthy_only(result.stderr), result.stderr


def test_upstream_audioldm_with_peft_lora_is_named_with_real_paths(tmp_path):
    result = doctor(LORA_STEP, tmp_path, "")
    assert result.returncode != 0 and "does not require grad" in result.stderr
    # The first block whose upstream checkpoint raised, by its path in the PEFT model.
    assert "- base_model.model.output_blocks.3.0 (ResBlock): base_model.model.output_blocks.3.0.in_layers" \
        in " ".join(result.stderr.split()), result.stderr  # wrapped at 100 columns
    assert "GRADPATCH=1" in result.stderr and "<root>" not in result.stderr


def test_f5_sampled_with_cache_false_is_silent(tmp_path):
    result = doctor(F5_STEP.format(options=", cache=False"), tmp_path, "1")
    assert result.returncode == 0, result.stderr
    assert "gradpatch doctor" not in result.stderr  # no model called before the backward: nothing to vouch for


def test_f5_sampled_with_the_default_cache_in_a_loss_is_named_with_the_fix(tmp_path):
    result = doctor(F5_STEP.format(options=""), tmp_path, "1")
    assert result.returncode != 0 and "does not require grad and does not have a grad_fn" in result.stderr
    assert "- CFM.sample: " not in result.stderr  # no parameter list: the loss had no graph at all
    assert "CFM.sample ran with cache=True (its default) while grad was on" in result.stderr, result.stderr
    assert "fix:   call it with cache=False" in result.stderr


@pytest.mark.parametrize("style", CALLS)
def test_any_reentrant_torch_checkpoint_is_recognised(tmp_path, style):
    imports, call, named = CALLS[style]
    result = doctor(REENTRANT.format(imports=imports, call=call), tmp_path)
    assert result.returncode == 0, result.stderr
    # checkpoint_sequential runs its last segment without checkpoint: only the first one's are missing.
    names = "block.inner.0.weight, block.inner.0.bias" + (", block.inner.2.weight, block.inner.2.bias"
                                                          if style != "checkpoint_sequential" else "")
    assert f"- {named}: {names} cause: " in " ".join(result.stderr.split()), result.stderr  # wrapped at 100
    assert max(len(line) for line in result.stderr.splitlines() if "train.py" not in line) <= 100
    assert "reentrant checkpoint" in result.stderr and "use_reentrant=False" in result.stderr
    assert "train.py:11;" in result.stderr  # where it is called
    assert result.stderr.count("\n- ") == 1  # one finding: the frozen embedding is not one
    fixed = doctor(REENTRANT.format(imports=imports, call=call.replace("use_reentrant=True", "use_reentrant=False")
                                    .replace("(self.inner, x)", "(self.inner, x, use_reentrant=False)")), tmp_path)
    assert "reentrant" not in fixed.stderr, fixed.stderr


def test_grad_doctor_counts_a_zero_gradient_as_reached_and_none_as_missing():
    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q", "to_v"]), audioldm_unet(use_checkpoint=True))
    gradpatch.trainable(model, include=["*lora_*"])
    batch = audioldm_batch()
    with gradpatch.applied("audioldm"):
        stream = io.StringIO()
        with gradpatch.grad_doctor(model, file=stream) as diagnosis:
            out = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
            torch.nn.functional.mse_loss(out, batch["target"]).backward()
        lora_a = [p for n, p in model.named_parameters() if "lora_A" in n]
        assert lora_a and all(not p.grad.any() for p in lora_a)  # zero by design: lora_B starts at zero
        assert not diagnosis and stream.getvalue().startswith("gradpatch doctor: every trainable parameter got a")
        stream.truncate(0)
        stream.seek(0)
        model.zero_grad(set_to_none=False)  # zero tensors, as optimizers left them before torch 2.0
        kept = next(n for n, p in model.named_parameters() if "lora_A" in n)
        with gradpatch.grad_doctor(model, file=stream) as diagnosis:  # the output detached by mistake
            out = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
            loss = torch.nn.functional.mse_loss(out.detach(), batch["target"])
            (loss + 0 * model.get_parameter(kept).sum()).backward()  # one reached, with a zero gradient
    (finding,) = diagnosis.findings
    assert "the loss does not depend on them" in finding.cause
    assert {n for n, p in model.named_parameters() if p.requires_grad} - {kept} == set(finding.parameters)


def test_a_model_wholly_inside_a_reentrant_checkpoint_is_named_when_backward_raises(tmp_path):
    script = REENTRANT.format(imports="import torch.utils.checkpoint", call="x").replace(
        "return self.head(self.block(self.embed(tokens)))",
        "return torch.utils.checkpoint.checkpoint(lambda t: self.head(self.block(t)), self.embed(tokens),"
        " use_reentrant=True)")
    result = doctor(script, tmp_path)
    assert result.returncode != 0 and "element 0 of tensors does not require grad" in result.stderr
    assert "- <root> (Model): block.inner.0.weight" in result.stderr, result.stderr
    assert "use_reentrant=False" in result.stderr
