"""DDP across two CPU processes (gloo, loopback), activated only by GRADPATCH=1 in the environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradpatch
from gradpatch.testing import audioldm_batch, audioldm_unet

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = Path(__file__).parents[1] / "scripts" / "ddp_audioldm.py"


def test_ddp_gradients_equal_a_single_process_run_on_the_whole_batch(tmp_path):
    out = tmp_path / "grads.pt"
    env = {**os.environ, "GRADPATCH": "1", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(Path(f"{out}.json").read_text())["audioldm.checkpoint"] == "applied"
    distributed = torch.load(out)

    model = audioldm_unet()
    gradpatch.trainable(model, include=["*attn2*"])
    batch = audioldm_batch(batch=4)
    with gradpatch.applied("audioldm"):
        prediction = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
        torch.nn.functional.mse_loss(prediction, batch["target"]).backward()
    single = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert distributed.keys() == single.keys() and len(single) == 20
    for name in single:  # mean of the two ranks' mean losses = mean over the whole batch
        torch.testing.assert_close(distributed[name], single[name], rtol=1e-5, atol=1e-7, msg=name)
