"""Released packages that carry a copy of the OpenAI/CompVis checkpoint under a path no patch names.

Each is installed ``--no-deps`` into a cached folder (``pypi_release``; not into the environment:
audiosr and kagayoi-audiosr both ship the package ``audiosr``) and imports with this environment's
packages. In a fresh interpreter under ``GRADPATCH=1`` alone, a block of the package that uses its
checkpoint takes a training step with some parameters frozen: the scan finds the copy, the report
names its path, and every trainable parameter's gradient equals the block's body run without
checkpointing (``_forward``, rtol 1e-5). ``gradpatch.revert()`` then puts upstream's checkpoint
back, which raises on the same step.
"""
from __future__ import annotations

import pytest

from support import last_json, pypi_release, run_python

pytestmark = pytest.mark.slow

SCRIPT = r"""
import importlib, json, sys, torch
torch.set_num_threads(1)
torch.manual_seed(0)
import gradpatch

key, util, blocks = sys.argv[1:4]
module = importlib.import_module(blocks)
if key in ("improved", "comfylib"):  # AttentionBlock; comfylib's transformer attention needs CUDA
    block, x = module.AttentionBlock(32, num_heads=2, use_checkpoint=True), torch.randn(2, 32, 4, 4)
    frozen = block.norm
else:
    block, x = module.BasicTransformerBlock(16, 2, 8, checkpoint=True), torch.randn(2, 5, 16)
    frozen = block.attn1
with torch.no_grad():
    for p in block.parameters():
        if not p.any():  # zero-initialised output layers
            p.normal_(std=0.1)
frozen.requires_grad_(False)
trainable = [p for p in block.parameters() if p.requires_grad]

def grads(run):
    return torch.autograd.grad(run(x).square().mean(), trainable)

got, want = grads(block), grads(block._forward)
try:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)
    equal = "equal"
except AssertionError as exc:
    equal = str(exc)
report = [(r.patch, r.target, r.status.value) for r in gradpatch.report() if r.target.startswith(util + ":")]
found = sys.modules[util].checkpoint.__module__
gradpatch.revert()
try:
    grads(block)
    upstream = "no error"
except RuntimeError as exc:
    upstream = str(exc)
print(json.dumps([len(trainable) > 0 and len(list(frozen.parameters())) > 0,
                  equal, report, found, upstream]))
"""

RELEASES = {
    "audiosr": ("audiosr==0.0.7", "audiosr.latent_diffusion.modules.diffusionmodules.util",
                "audiosr.latent_diffusion.modules.attention"),
    "kagayoi": ("kagayoi-audiosr==1.0.2", "audiosr.latent_diffusion.modules.diffusionmodules.util",
                "audiosr.latent_diffusion.modules.attention"),
    "improved": ("improved-diffusion-for-smlm==0.4.8", "improved_diffusion_for_SMLM.improved_diffusion.nn",
                 "improved_diffusion_for_SMLM.improved_diffusion.unet"),
    "comfylib": ("comfylib==0.0.5", "comfy.hazard.ldm.modules.diffusionmodules.util",
                 "comfy.hazard.ldm.modules.diffusionmodules.openaimodel"),
}


@pytest.mark.parametrize("key", list(RELEASES))
def test_copy_in_released_package_is_found_and_fixed(key):
    requirement, util, blocks = RELEASES[key]
    root = pypi_release(requirement)
    if isinstance(root, str):
        pytest.skip(root)
    result = run_python(SCRIPT.replace("sys.argv[1:4]", repr([key, util, blocks])),
                        env={"GRADPATCH": "1"}, pythonpath=[root])
    some_frozen, equal, report, found, upstream = last_json(result)
    assert some_frozen
    assert equal == "equal"
    assert sorted(report) == [[f"{util}.{name}", f"{util}:{name}", "applied"]
                              for name in ("CheckpointFunction", "checkpoint")], report
    assert found.startswith("gradpatch."), "the module's checkpoint is gradpatch's fix"
    assert "does not require grad" in upstream, "upstream's copy must fail on the same step"
