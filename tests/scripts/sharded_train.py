"""Two SGD steps per configuration ("cell") under a sharding engine; rank 0 compares the full gradients.

Run by tests/checkpointing/test_sharded.py as ``GRADPATCH=1 python -m torch.distributed.run --standalone
--nproc_per_node=2 sharded_train.py CELLS.json OUT.json`` (gloo over loopback, CPU, float64). Every
cell builds its model afresh from the same seed, wraps it, trains two plain-SGD steps (lr 0.1) on its
rank's half of the batch and gathers each step's full gradients; rank 0 compares them with one
process on the whole batch without checkpointing (or, with ``against``, with the same cell run under
another checkpoint variant) and writes one record per cell. A cell that raises is recorded with its
error; the others go on.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from gradpatch import settings

sys.path.insert(0, os.path.dirname(__file__))
import sharded_engines as engines  # noqa: E402
import sharded_models as models  # noqa: E402


PATHS = {"fast": 0, "graph": 0}  # checkpoint calls per path of gradpatch's fix, this cell


def _count_paths() -> None:
    """Count the calls that reach gradpatch's fast path (a node of its own) and its graph path."""
    from gradpatch.checkpointing import paths

    attempt, graph_path = paths.attempt, paths.graph_path

    def counting_attempt(*args, **kwargs):
        out = attempt(*args, **kwargs)
        PATHS["fast"] += out is not paths.ESCAPED
        return out

    def counting_graph_path(*args, **kwargs):
        PATHS["graph"] += 1
        return graph_path(*args, **kwargs)

    paths.attempt, paths.graph_path = counting_attempt, counting_graph_path


def run(cell: dict, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    kind = cell.get("model", "audioldm")
    if kind == "audioldm":
        model = models.audioldm(cell["trainable"], torch.bfloat16 if cell.get("bf16") else torch.float64)
    else:
        model = models.f5(cell["trainable"])
    names = [n for n, p in model.named_parameters()]
    wrapped, engine = engines.wrap(cell, model)
    per_rank = (4 if kind == "audioldm" else 2) // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    grads = []
    for step in range(cell.get("steps", models.STEPS)):
        engine.zero_grad()
        batch = models.audioldm_step_batch(step, lo, hi) if kind == "audioldm" else models.f5_batch(step, lo, hi)
        micro = _micro_batches(batch, kind, 2 if cell.get("accumulate") else 1)
        for i, part in enumerate(micro):
            with engines.sync(cell, wrapped, last=i == len(micro) - 1):
                if kind == "audioldm":
                    loss = models.audioldm_loss(wrapped, part)
                else:
                    loss = models.f5_loss(wrapped, part, dict(cell.get("options", {})))
                engine.backward(loss / len(micro))
        grads.append(engines.full_grads(cell, wrapped, names))
        engine.step()
    return grads


def _micro_batches(batch, kind: str, n: int) -> list:
    if n == 1:
        return [batch]
    if kind == "audioldm":
        return [{k: v[i::n] for k, v in batch.items()} for i in range(n)]
    return [tuple(v[i::n] for v in batch) for i in range(n)]


def main() -> None:
    cells = json.loads(open(sys.argv[1]).read())
    if any(c["engine"].startswith("zero") for c in cells):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    _count_paths()
    records = []
    for cell in cells:
        start = time.perf_counter()
        record: dict = {"cell": cell}
        PATHS.update(fast=0, graph=0)
        try:
            variants = [cell.get("variant", "gradpatch")] + ([cell["against"]] if cell.get("against") else [])
            results = []
            policy = cell.get("policy", "respect")
            for variant in variants:
                with models.checkpoint_variant(variant), settings.checkpoint_policy_scope(policy):
                    results.append(run(cell, rank, world))
            if rank == 0:
                kind = cell.get("model", "audioldm")
                key = tuple(sorted(cell.get("options", {}).items())), cell.get("steps", models.STEPS)
                if cell.get("against"):
                    record.update(engines.compare_runs(results[0], results[1]))
                else:
                    record.update(models.compare(results[0], kind, cell["trainable"], *key))
        except Exception as error:  # noqa: BLE001 - recorded for the test to judge
            record["error"] = f"{type(error).__name__}: {error}"
            record["traceback"] = traceback.format_exc()[-3000:]
        record["paths"] = dict(PATHS)
        record["seconds"] = round(time.perf_counter() - start, 2)
        records.append(record)
        if rank == 0:
            print(json.dumps({k: record.get(k) for k in ("cell", "rel", "error", "seconds")}), flush=True)
    if rank == 0:
        with open(sys.argv[2], "w") as handle:
            json.dump(records, handle)
    dist.barrier()
    dist.destroy_process_group()
    # As in ddp_audioldm.py: skip interpreter finalization (gloo worker threads outlive the group).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
