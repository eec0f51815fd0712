"""The fixed checkpoint under sharding engines: FSDP2, FSDP1, DDP, DeepSpeed ZeRO-2/3.

Each engine group is one launch of ``scripts/sharded_train.py`` under ``GRADPATCH=1 python -m
torch.distributed.run --standalone --nproc_per_node=2`` (gloo over loopback, CPU, float64, the tiny
AudioLDM UNet and F5-TTS CFM); the launch runs its cells one after the other and rank 0 records, per
cell, the largest relative gradient error of each of two plain-SGD steps against one process on the
whole batch without checkpointing, the trainable tensors without a gradient and the frozen ones with
one. A cell with ``against`` is compared with the same configuration under torch's non-reentrant
checkpoint instead (bfloat16 mixed precision). ``variant``: ``upstream`` runs upstream's checkpoint
(gradpatch reverted) to show it failing; ``torch`` runs torch's non-reentrant checkpoint, which
gradpatch must never be worse than.

Run alone: ``python -m pytest -m distributed tests/checkpointing/test_sharded.py``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"
EXACT = 1e-6  # relative, float64 (DeepSpeed hands gradients back in float32 buffers: ~1e-7)
BF16 = 2e-2  # relative, gradpatch against torch's checkpoint under the same bfloat16 policy
TENSORS = {("audioldm", "attn2"): 20, ("audioldm", "all"): 210, ("f5", "all"): 43, ("f5", "attn"): 16}


def cell(engine, trainable, expect="exact", **kw):
    return dict(engine=engine, trainable=trainable, expect=expect, **kw)


FSDP2 = [cell("fsdp2", t, layout=layout, reshard=reshard)
         for layout in ("outer", "inner") for reshard in (True, False) for t in ("attn2", "all")] + [
    cell("fsdp2", "all", layout="nested"),
    # every block recomputed, ResBlocks too: a block that is itself the FSDP2 unit keeps the fast path
    cell("fsdp2", "all", layout="outer", policy="always"),
    cell("fsdp2", "attn2", layout="outer", reshard=False, policy="always"),
    # the budget plan measures in steps 1-2 and holds from step 3
    cell("fsdp2", "all", layout="inner", policy="budget:1MiB", steps=3),
    # peak: measures in steps 1-2, records step 3 and the plan's step 4, holds from step 5; the size keeps
    # some blocks (per rank: every block recomputed 10.7 MiB, every block kept 18.9 MiB)
    cell("fsdp2", "all", layout="outer", policy="peak:14MiB", steps=5),
    cell("fsdp2", "attn2", layout="inner", variant="torch"),
    cell("fsdp2", "all", layout="inner", variant="upstream", expect="silently wrong"),
    cell("fsdp2", "all", layout="inner", accumulate=True),
    cell("fsdp2", "attn2", layout="inner", accumulate=True, reshard=False),
    cell("fsdp2", "all", layout="inner", offload=True),
    cell("fsdp2", "attn2", layout="outer", bf16=True, against="torch", expect="bf16"),
    cell("fsdp2", "attn2", layout="inner", bf16=True, against="torch", expect="bf16"),
    cell("fsdp2", "all", layout="inner", bf16=True, offload=True, against="torch", expect="bf16"),
] + [cell("fsdp2", t, model="f5", layout="inner", options=options)
     for t, options in [("all", {"cache": False}), ("all", {"cache": False, "grad_steps": 1}),
                        ("all", {"cache": False, "checkpoint_steps": True}),
                        ("attn", {"cache": False, "checkpoint_steps": True})]]

FSDP1_DDP = [cell("fsdp1", t, layout=layout, orig=orig)
             for layout in ("outer", "inner") for orig in (True, False) for t in ("attn2", "all")
             if (layout, orig, t) != ("outer", False, "attn2")] + [
    # FSDP1's own rule: without use_orig_params a unit's parameters must all train or all be frozen.
    cell("fsdp1", "attn2", layout="outer", orig=False, expect="fsdp refuses"),
    cell("fsdp1", "all", layout="inner", orig=True, variant="torch"),
    cell("fsdp1", "all", layout="inner", orig=True, variant="upstream", expect="silently wrong"),
    cell("ddp", "attn2"), cell("ddp", "all"), cell("ddp", "all", accumulate=True),
    cell("ddp", "attn2", kwargs={"static_graph": True}),
    cell("ddp", "attn2", kwargs={"find_unused_parameters": True}),
    cell("ddp", "all", policy="budget:1MiB", steps=3),
    cell("ddp", "all", policy="peak:14.5MiB", steps=5),
]

DEEPSPEED = [cell(engine, t) for engine in ("zero2", "zero3") for t in ("attn2", "all")] + [
    cell("zero3", "attn2", variant="torch"),
    cell("zero3", "all", variant="upstream", expect="raises"),
]

GROUPS = {"fsdp2": FSDP2, "fsdp1_ddp": FSDP1_DDP, "deepspeed": DEEPSPEED}

# A rank killed by a signal inside torch's or gloo's native code (CI once saw glibc abort an FSDP2 rank
# with "malloc(): unaligned tcache chunk detected" under load; ten launches of the same group on the
# same commit did not repeat it) relaunches its group once, with a warning. A Python error, a
# timeout, a wrong or missing gradient, or a second crash fails as before.
CRASH_RELAUNCHES = 1
NATIVE_CRASH = re.compile(r"\(SIG(ABRT|SEGV|BUS|ILL|FPE)\)")


def launch(group: str, root: Path) -> dict[str, dict]:
    """Run the group's cells in one 2-rank launch, once per test session (also across pytest-xdist
    workers, which share ``root`` and take turns through a file lock); records by cell id."""
    from filelock import FileLock

    if group == "deepspeed":
        pytest.importorskip("deepspeed")
    out, failed = root / f"{group}.out", root / f"{group}.failed"
    with FileLock(str(root / f"{group}.lock")):
        if not out.exists() and not failed.exists():
            cells = [{k: v for k, v in c.items() if k != "expect"} for c in GROUPS[group]]
            (root / f"{group}.json").write_text(json.dumps(cells))
            env = {**os.environ, "GRADPATCH": "1", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
                   "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(SCRIPTS / "sharded_train.py"), str(root / f"{group}.json"), str(out)]
            for attempt in range(1 + CRASH_RELAUNCHES):
                result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
                crashed = result.returncode != 0 and NATIVE_CRASH.search(result.stderr)
                if not crashed or attempt == CRASH_RELAUNCHES:
                    break
                (root / f"{group}.crashed").write_text(_tail(result))
                warnings.warn(f"{group}: a rank died of a native crash; the group is launched once more\n"
                              f"{_tail(result)[-1500:]}", stacklevel=1)
            if result.returncode != 0:  # every cell of the group fails with this, without launching again
                out.unlink(missing_ok=True)
                failed.write_text(_tail(result))
    assert not failed.exists(), failed.read_text()
    return {cell_id(r["cell"]): r for r in json.loads(out.read_text())}


def _tail(result: subprocess.CompletedProcess) -> str:
    """The end of a launch's output: rank 0's last finished cells, then the ranks' errors."""
    return "finished cells (rank 0, last 3):\n" + "\n".join(result.stdout.splitlines()[-3:]) + \
        "\n\n" + result.stderr[-5000:]


def cell_id(c: dict) -> str:
    return "-".join(f"{k}={v}" if not isinstance(v, bool) else (k if v else f"no_{k}")
                    for k, v in c.items() if k != "expect").replace(" ", "")


@pytest.fixture(scope="session")
def launches(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' base directories share this parent
        root = root.parent
    root = root / "sharded"
    root.mkdir(exist_ok=True)
    cache: dict[str, dict] = {}
    return lambda group: cache[group] if group in cache else cache.setdefault(group, launch(group, root))


CASES = [pytest.param(group, c, id=f"{group}:{cell_id(c)}") for group, cells in GROUPS.items() for c in cells]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("group, spec", CASES)
def test_gradients_under_sharding(launches, group, spec):
    record = launches(group)[cell_id(spec)]
    expect, model = spec["expect"], spec.get("model", "audioldm")
    summary = {k: record.get(k) for k in ("rel", "missing", "frozen_with_grad", "error")}
    if expect == "fsdp refuses":
        assert "use_orig_params=False" in (record.get("error") or ""), summary
        return
    if expect == "raises":  # upstream under ZeRO-3: a full-size gradient for an empty partition
        assert "invalid gradient" in (record.get("error") or ""), summary
        return
    assert record.get("error") is None, record.get("traceback")
    assert all(s > 0 for s in record["scale"]), "vacuous: the reference gradients are all zero"
    if expect == "silently wrong":  # upstream: no error, gradients missing after step 1, step 2 off
        assert record["missing"] and max(record["rel"]) > 1e-4, summary
        return
    assert not record["missing"] and not record["frozen_with_grad"], summary
    assert max(record["rel"]) <= (BF16 if expect == "bf16" else EXACT), summary
    if expect == "exact":
        assert record["tensors"] == TENSORS[model, spec["trainable"]]
    if spec.get("variant", "gradpatch") == "gradpatch" and model == "audioldm" and spec["engine"] != "fsdp1":
        # Engines' modules inside the checkpointed block (inner shards, ZeRO-3): torch's checkpoint;
        # a block that is itself the FSDP2 unit, or under DDP/ZeRO-2: gradpatch's own node.
        inside = spec.get("layout") in ("inner", "nested") or spec["engine"] == "zero3"
        paths = record["paths"]
        assert paths["graph"] > 0 if inside else (paths["fast"] > 0 and paths["graph"] == 0), paths


def test_parameters_as_restores_absent_entries_and_keeps_an_engines_changes():
    """An engine (FSDP1 ``use_orig_params``) unregisters a parameter inside the block and registers its
    own: the swap must neither write ``None`` back nor undo the engine's change."""
    import torch

    from gradpatch.checkpointing.graph_path import parameters_as

    linear = torch.nn.Linear(2, 2)
    weight, bias = linear.weight, linear.bias
    del linear._parameters["bias"]  # absent while the block runs, as FSDP1 leaves it
    engines = torch.nn.Parameter(torch.zeros(2, 2))
    with parameters_as([(linear, "weight", torch.ones(2, 2)), (linear, "bias", bias)]):
        assert linear._parameters["bias"] is bias
        linear._parameters["weight"] = engines  # the engine's own change during the block
    assert "bias" not in linear._parameters and linear._parameters["weight"] is engines
    linear._parameters["weight"] = weight
    with parameters_as([(linear, "weight", engines)]):
        assert linear.weight is engines
    assert linear.weight is weight


def test_modules_of_finds_bound_methods_partials_and_closures():
    import functools

    import torch

    from gradpatch.checkpointing.sharding import modules_of, sharded_inside

    a, b, c = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    def closure(x):
        return c(x)

    assert [m for m in modules_of(a.forward)] == [a]
    assert {id(m) for m in modules_of(functools.partial(closure, b))} == {id(b), id(c)}
    assert sharded_inside(a.forward) is None  # no process group: nothing is walked


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_inside_names_the_engine_and_the_module(run_python_single_rank):
    assert run_python_single_rank == {"fsdp2": "FSDP2 (fully_shard) on attn1",
                                      "unit itself": None,
                                      "zero3": "DeepSpeed ZeRO-3 on ff.net.2"}


@pytest.fixture
def run_python_single_rank(tmp_path):
    """One gloo rank in a fresh interpreter: what ``sharded_inside`` says about a BasicTransformerBlock
    with FSDP2 on its attention modules, on a block that is itself the FSDP2 unit, and with a parameter
    carrying ZeRO-3's ``ds_id``."""
    from support import last_json, run_python

    pytest.importorskip("deepspeed")
    return last_json(run_python(f"""
        import json, torch, torch.distributed as dist
        import deepspeed  # ZeRO-3's marks are looked for only once DeepSpeed is imported
        from torch.distributed.fsdp import fully_shard
        from audioldm.latent_diffusion.attention import BasicTransformerBlock
        from gradpatch.checkpointing.sharding import sharded_inside
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        block = BasicTransformerBlock(16, 2, 8)
        fully_shard(block.attn1)
        unit = BasicTransformerBlock(16, 2, 8)
        fully_shard(unit)
        zero = BasicTransformerBlock(16, 2, 8)
        zero.ff.net[2].weight.ds_id = 7
        print(json.dumps({{"fsdp2": sharded_inside(block._forward), "unit itself": sharded_inside(unit._forward),
                          "zero3": sharded_inside(zero._forward)}}))
        dist.destroy_process_group()
    """, env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}))
