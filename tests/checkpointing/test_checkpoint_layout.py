"""The layout of ``gradpatch.checkpointing``: role-named modules, the budget planner as one package, no
module importing another's private name, the old ``_``-named paths kept one release with a
``DeprecationWarning``, the public paths unchanged, and the torch-free parts torch-free."""
from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

from support import last_json, run_python

PACKAGE = Path(__file__).resolve().parents[2] / "gradpatch" / "checkpointing"
MOVED = {"_paths": "paths", "_recompute": "recompute", "_graph_walk": "graph_walk",
         "_graph_path": "graph_path", "_sharding": "sharding", "_compat": "compat",
         "_measure": "budget.measure", "_block_key": "budget.key", "_budget_compile": "budget.compiled"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.stem not in MOVED)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_old_paths_warn_and_are_the_new_modules(old, new):
    sys.modules.pop(f"gradpatch.checkpointing.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"gradpatch.checkpointing.{old}")
    assert module is importlib.import_module(f"gradpatch.checkpointing.{new}")
    assert any(issubclass(w.category, DeprecationWarning) and f"gradpatch.checkpointing.{new}" in str(w.message)
               for w in caught), [str(w.message) for w in caught]


def test_public_paths_and_names_stay():
    from gradpatch.checkpointing import budget, checkpoint, plan, tradeoff

    assert callable(checkpoint.replace_checkpoint) and callable(tradeoff.tradeoff)
    assert budget.checkpoint_plan is importlib.import_module("gradpatch").checkpoint_plan
    assert budget.TIMING_CALLS >= 1 and callable(budget.reset) and budget.Plan is plan.Plan
    assert plan.choose([plan.Item(1, 1.0)], 1) == [True] and plan.parse_size("1KiB") == 1024


def test_no_module_imports_a_private_name_of_another_and_none_is_long():
    """``from x import _y`` and ``x._y`` on an imported module: none across modules; every module
    under ~300 lines; no ``import a as b`` renaming one of the package's modules."""
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradpatch"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.name}: from {node.module} import {alias.name}")
                    target = f"{node.module}.{alias.name}"
                    if alias.asname and importlib.util.find_spec(target.split(".")[0]) and \
                            target.startswith("gradpatch.checkpointing") and _is_module(target):
                        found.append(f"{path.name}: renames module {target} as {alias.asname}")
                    imported.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in imported and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{path.name}: {node.value.id}.{node.attr}")
        lines = len(path.read_text().splitlines())
        if lines > 300:
            found.append(f"{path.name}: {lines} lines")
    assert not found, found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_the_torch_free_parts_import_no_torch():
    assert last_json(run_python("""
        import json, sys
        import gradpatch, gradpatch.checkpointing.plan, gradpatch.checkpointing.budget
        from gradpatch.checkpointing.budget import knapsack, report
        print(json.dumps("torch" in sys.modules))
    """)) is False
