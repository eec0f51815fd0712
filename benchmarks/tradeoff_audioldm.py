"""The trade-off curve of the tiny AudioLDM UNet (every block checkpointed), as docs/how-to/memory.md shows it.

Run:  PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/tradeoff_audioldm.py [PNG]
or:   gradpatch tradeoff benchmarks.tradeoff_audioldm:make_step --plot docs/tradeoff_audioldm_tiny.png

One CPU thread; ``make_step`` is the factory ``gradpatch tradeoff`` takes: it builds the model with
gradpatch's fix applied and returns one training step (forward, loss, backward; no optimiser).
"""
from __future__ import annotations

import sys

import torch


def make_step():
    import gradpatch
    from gradpatch.testing import audioldm_batch, audioldm_unet

    torch.set_num_threads(1)
    gradpatch.apply("audioldm")
    model = audioldm_unet(use_checkpoint=True, dropout=0.1)
    model.train()
    batch = audioldm_batch(batch=4)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
        (out - batch["target"]).square().mean().backward()

    return step


if __name__ == "__main__":
    from gradpatch.checkpointing.tradeoff import tradeoff

    result = tradeoff(make_step(), fractions=(0.25, 0.5, 0.75), repeats=15)
    print(result)
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/tradeoff_audioldm_tiny.png"
    result.plot(path, title="tiny AudioLDM UNet, CPU, 1 thread")
    print(f"plot: {path}")
