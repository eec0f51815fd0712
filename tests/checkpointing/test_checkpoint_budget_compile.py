"""The ``budget:<size>`` policy under torch.compile (``gradpatch.checkpointing.budget.traced``): compiled
blocks are planned (kept blocks traced as plain calls, the others through torch's checkpoint), the
final graph is whole, gradients equal a float64 reference without checkpoint over every parameter at
every step; where a block cannot be measured (``fullgraph=True`` before any eager step) it is
recomputed, with one warning. Fresh interpreters: the warning is once per process, and dynamo's
caches start empty."""
from __future__ import annotations

import json

import pytest

from support import COMPILED_BLOCKS, last_json, run_python

SCRIPT = COMPILED_BLOCKS + '''
model = nn.Sequential(*[Block(w) for w in (64, 32, 64, 16)]).double()
x = torch.randn(64, 8, dtype=torch.float64)

with settings.checkpoint_policy_scope("never"):
    want = grads(model)
errors, counts = [], []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with settings.checkpoint_policy_scope(POLICY):
        if EAGER_FIRST:  # measured and planned eagerly
            for _ in range(3):
                errors.append(grads(model))
        if HOW == "in place":  # model.compile(): its compiled call set aside while the plan is made
            model.compile(backend=backend, fullgraph=FULLGRAPH, dynamic=DYNAMIC)
            compiled = model
        elif HOW == "function":  # the model's call inside a compiled function: measured at graph breaks
            compiled = torch.compile(lambda inputs: model(inputs), backend=backend, fullgraph=FULLGRAPH,
                                     dynamic=DYNAMIC)
        else:
            compiled = torch.compile(model, backend=backend, fullgraph=FULLGRAPH, dynamic=DYNAMIC)
        for _ in range(7):  # measured on eager steps (the first one compiled, every block recomputed)
            before = len(graphs)
            errors.append(grads(compiled))
            counts.append(graphs[before:])
        plan = checkpoint_plan(model)
ours = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
err, scale = worst(errors, want)
print(json.dumps({"err": err, "scale": scale, "warnings": ours, "graphs": counts,
                  "plan": [e.recomputed for e in plan], "hooks": len(model._forward_pre_hooks),
                  "compiled_call": getattr(model, "_compiled_call_impl", None) is not None}))
'''


def _run(policy: str, eager_first: bool, fullgraph: bool, dynamic: bool = False, how: str = "wrapper") -> dict:
    code = (SCRIPT.replace("POLICY", json.dumps(policy)).replace("EAGER_FIRST", str(eager_first))
            .replace("FULLGRAPH", str(fullgraph)).replace("DYNAMIC", str(dynamic)).replace("HOW", json.dumps(how)))
    return last_json(run_python(code, timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize("eager_first, fullgraph, how", [(False, False, "wrapper"), (True, True, "wrapper"),
                                                     (False, False, "in place"), (False, False, "function")])
def test_budget_plans_compiled_blocks_with_exact_gradients(eager_first, fullgraph, how):
    # 64 x width float64 activations: 32, 16, 32 and 8 KiB kept by the blocks (less the RNG state
    # the checkpoint keeps): 40 KiB keeps some blocks, not all. A model compiled in place
    # (model.compile()) has its compiled call back once planned; no hook of the plan's is left (a
    # compiled function calling the model had them left, unplanned, before).
    result = _run("budget:40KiB", eager_first, fullgraph, how=how)
    assert result["err"] <= 1e-12 * result["scale"], result
    assert result["compiled_call"] is (how == "in place") and result["hooks"] == 0, result
    assert result["warnings"] == []
    recomputed = result["plan"]
    assert len(recomputed) == 4 and 0 < sum(recomputed) < 4, recomputed  # planned: some kept
    # The last steps run one whole graph, the plan baked in: a checkpoint per recomputed block only.
    # (Before planning in compiled code, every block took torch's checkpoint: 4 in the graph.)
    final = [c for c in result["graphs"] if c][-1]
    assert final == [sum(recomputed)], result["graphs"]
    assert result["graphs"][-2:] == [[], []]  # no recompilation once planned


@pytest.mark.slow
@pytest.mark.parametrize("policy, fullgraph, dynamic, why", [
    ("budget:1MiB", True, False, "graph may not break"),  # fullgraph=True from the first step
    ("budget:1MiB", False, True, "dynamic shapes"),  # the bytes a block keeps have no bound
    ("respect", True, False, None)])
def test_unplannable_compiled_blocks_are_recomputed_with_one_warning(policy, fullgraph, dynamic, why):
    result = _run(policy, False, fullgraph, dynamic)
    assert result["err"] <= 1e-12 * result["scale"], result
    assert result["graphs"][0] == [4]  # every block through torch's checkpoint
    if policy == "respect":
        assert result["warnings"] == []
        return
    (message,) = result["warnings"]
    assert message.startswith(f"gradpatch: checkpoint policy '{policy}' is not applied inside torch.compile regions")
    assert "all recomputed" in message and why in message
