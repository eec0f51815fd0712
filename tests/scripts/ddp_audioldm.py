"""One DDP training step per rank on a tiny AudioLDM UNet, cross-attention only trainable.

Run by tests/checkpointing/test_distributed.py under ``GRADPATCH=1 torchrun --standalone --nproc_per_node=2``: the
script itself never calls gradpatch.apply(), so only the environment variable activates the fix.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradpatch
from gradpatch.testing import audioldm_batch, audioldm_unet

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
model = audioldm_unet()
gradpatch.trainable(model, include=["*attn2*"])
ddp = DistributedDataParallel(model)
batch = audioldm_batch(batch=2 * world)
mine = {k: v[2 * rank: 2 * rank + 2] for k, v in batch.items()}
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
for _ in range(2):  # two steps: DDP's reducer must see every gradient exactly once per step
    optimizer.zero_grad(set_to_none=True)
    out = ddp(mine["x"], timesteps=mine["timesteps"], y=mine["y"])
    torch.nn.functional.mse_loss(out, mine["target"]).backward()
    optimizer.step()
if rank == 0:
    torch.save({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, sys.argv[1])
    with open(sys.argv[1] + ".json", "w") as handle:
        json.dump({r.patch: str(r.status) for r in gradpatch.report()}, handle)
dist.barrier()  # no rank tears gloo down while the other still writes: an early exit can abort it
dist.destroy_process_group()
# Skip interpreter finalization: torch's gloo worker threads outlive destroy_process_group, and one
# that frees a backward-time allreduce after finalization has begun aborts the process (its captured
# thread-local state holds the Python context autograd stashes; taking the GIL then ends the thread
# inside a noexcept destructor: "terminate called without an active exception"). Plain torch DDP
# with no gradpatch loaded shows it too; the results above are already written and closed.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
