"""FSDP2 units that a checkpointed call reaches other than as its module's children, and the
``budget:<size>`` plan's report under FSDP2 inner units, for ``tests/checkpointing/test_sharded_reach.py``.

Run as ``python -m torch.distributed.run --standalone --nproc_per_node=2 sharded_reach.py OUT.json``
(gloo over loopback, CPU, float64). Each case builds the same tiny model from one seed, puts
``fully_shard`` on two inner ``Linear`` units and on the root, trains two plain-SGD steps (lr 0.1) on
its rank's half of the batch through gradpatch's fixed checkpoint, and gathers each step's full
gradients; rank 0 compares them with one process on the whole batch without checkpointing. The units
reach the checkpointed call through a ``functools.partial``'s list argument, a closure over a plain
list, a module-level global list, a module-level global module, or a plain list attribute of the
block (not a registered submodule).
"""
from __future__ import annotations

import functools
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from gradpatch import settings
from gradpatch.checkpointing.checkpoint import checkpoint

WIDTH, BATCH, STEPS, LR = 8, 4, 2, 0.1
GLOBAL_UNITS: list[nn.Module] = []  # filled per case: what ``through_global_list`` reads
GLOBAL_ENCODER: nn.Module | None = None  # what ``through_global_module`` reads


def chain(units, x):
    for unit in units:
        x = torch.tanh(unit(x))
    return x


def through_global_list(x):
    return chain(GLOBAL_UNITS, x)


def through_global_module(x):
    return torch.tanh(GLOBAL_ENCODER(x))


class Net(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.case = case
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.units = [self.a, self.b]  # a plain list attribute as well as registered children
        self.double()

    def forward(self, x):
        global GLOBAL_UNITS, GLOBAL_ENCODER
        units = [self.a, self.b]
        if self.case == "partial_list":
            func = functools.partial(chain, units)
        elif self.case == "closure_list":
            def func(x):
                return chain(units, x)
        elif self.case == "global_list":
            GLOBAL_UNITS = units
            func = through_global_list
        elif self.case == "global_module":
            GLOBAL_ENCODER = self.a
            func = through_global_module
        else:  # "holder": an object (not a module) holding the list
            holder = type("Holder", (), {})()
            holder.units = units
            func = functools.partial(lambda h, x: chain(h.units, x), holder)
        return self.head(checkpoint(func, (x,), (), True)).sum()


class Block(nn.Module):
    """A block checkpointing its own method, with FSDP2 units inside (the plan's report case)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return checkpoint(self._forward, (x,), self.parameters(), True)

    def _forward(self, x):
        return torch.tanh(self.inner(x))


def batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def reference(case: str) -> list[dict[str, torch.Tensor]]:
    model = Net(case)
    grads = []
    for step in range(STEPS):
        model.zero_grad()
        with settings.checkpoint_policy_scope("never"):
            model(batch(step)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return grads


def sharded(case: str, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Net(case)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    per = BATCH // world
    grads = []
    for step in range(STEPS):
        optimizer.zero_grad()
        # the sum over the full batch: each rank's half, FSDP2 averages over ranks
        (model(batch(step)[rank * per:(rank + 1) * per]) * world).backward()
        grads.append(_full(model))
        optimizer.step()
    return grads


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    params = list(model.named_parameters())
    flags = torch.tensor([p.grad is not None for _, p in params], dtype=torch.int64)
    dist.all_reduce(flags)
    out = {}
    for (name, p), n in zip(params, flags.tolist()):
        if n == dist.get_world_size():
            out[name] = p.grad.full_tensor().detach().clone()
        elif n:
            out[name] = torch.full(p.shape, float("nan"), dtype=torch.float64)
    return out


def compare(got: list[dict], want: list[dict]) -> dict:
    one_side = sum(len(set(g) ^ set(w)) for g, w in zip(got, want))
    rel = [max(((g[n] - w[n]).abs().max() / w[n].abs().max().clamp_min(1e-300)).item()
               for n in set(g) & set(w)) for g, w in zip(got, want)]
    tensors = sum(len(w) for w in want)
    return {"one_side": one_side, "tensors": tensors, "rel": rel}


def plan_report(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradpatch.checkpointing import budget

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)]).double()
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    budget.reset()
    with settings.checkpoint_policy_scope("budget:1GiB"):
        for step in range(budget.TIMING_CALLS + 1):
            model(batch(step)).sum().backward()
        return budget.checkpoint_plan(model).summary()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    records = {}
    for case in ("partial_list", "closure_list", "global_list", "global_module", "holder"):
        try:
            got = sharded(case, rank, world)
            records[case] = compare(got, reference(case)) if rank == 0 else None
        except Exception as error:  # noqa: BLE001 - recorded for the test to judge
            records[case] = {"error": f"{type(error).__name__}: {error}"}
    records["plan"] = plan_report(rank, world)
    if rank == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump(records, handle)
        print(json.dumps(records), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo worker threads outlive the group (as in sharded_train.py)


if __name__ == "__main__":
    main()
