"""FSDP2 units reached by a checkpointed call other than as its module's children (a
``functools.partial``'s list argument, a closure over a plain list, a global list, a global module, an
object holding them), and the ``budget:<size>`` plan's report of blocks holding FSDP2 units.

The distributed test is one launch of ``scripts/sharded_reach.py`` (gloo, 2 ranks, CPU, float64): two
SGD steps per case against one process on the whole batch without checkpointing. Run alone:
``python -m pytest -m distributed tests/checkpointing/test_sharded_reach.py``.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradpatch.checkpointing.sharding import modules_of

SCRIPTS = Path(__file__).parents[1] / "scripts"
CASES = ("partial_list", "closure_list", "global_list", "global_module", "holder")
EXACT = 1e-9  # relative, float64

GLOBAL_LIST: list = []


def _through_global(x):
    return [m(x) for m in GLOBAL_LIST]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("reach") / "out.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(SCRIPTS / "sharded_reach.py"), str(out)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_units_reached_through_lists_globals_and_objects_get_exact_gradients(launched, case):
    record = launched[case]
    assert "error" not in record, record
    # a, b and head (only a and head through the global module): weight and bias, two steps
    assert record["tensors"] == 2 * (4 if case == "global_module" else 6), record
    assert record["one_side"] == 0 and max(record["rel"]) <= EXACT, record


@pytest.mark.slow
@pytest.mark.distributed
def test_budget_plan_says_why_blocks_holding_fsdp2_units_are_not_planned(launched):
    summary = launched["plan"]
    assert "0 of 4 blocks kept" in summary, summary
    assert "4 of 4 blocks not planned" in summary and "FSDP2 (fully_shard) on inner" in summary, summary


def test_the_search_reaches_lists_partials_closures_globals_and_objects():
    """What the distributed cases rely on, without a process group: every way in finds both units."""
    global GLOBAL_LIST
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    units = [a, b]

    def closure(x):
        return [m(x) for m in units]

    class Holder:
        pass

    holder = Holder()
    holder.units = {"a": a, "b": (b,)}
    owner = torch.nn.Linear(1, 1)
    owner.extra = [a, b]  # a plain list attribute, not registered
    GLOBAL_LIST = units
    calls = {
        "partial list": (functools.partial(lambda ms, x: x, [a, b]), ()),
        "closure list": (closure, ()),
        "global list": (_through_global, ()),
        "argument list": (lambda ms, x: x, ([a, b], None)),
        "object": (functools.partial(lambda h, x: x, holder), ()),
        "method owner's list": (owner.forward, ()),
    }
    for what, (func, args) in calls.items():
        found = {id(m) for m in modules_of(func, args)}
        assert {id(a), id(b)} <= found, what


def test_the_search_reaches_a_namespace_argument_and_skips_a_global_logger():
    import logging
    import types

    a = torch.nn.Linear(1, 1)
    namespace = types.SimpleNamespace(model=a)
    assert any(m is a for m in modules_of(lambda ns, x: x, (namespace, None)))
    assert isinstance(LOGGER, logging.Logger) and modules_of(_uses_logger) == []  # a global: not walked


LOGGER = __import__("logging").getLogger("gradpatch.test.reach")


def _uses_logger(x):
    LOGGER.debug("x")
    return x
