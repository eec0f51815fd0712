"""The ``budget:<size>`` policy under torch.compile: gradients exact, and one warning saying that
compiled regions are not planned (their checkpointed blocks are all recomputed). Fresh interpreters:
the warning is once per process."""
from __future__ import annotations

import json

import pytest

from support import last_json, run_python

SCRIPT = '''
import json, warnings
import torch, torch.nn as nn
from gradpatch import settings
from gradpatch.checkpointing.checkpoint import checkpoint

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    def forward(self, x):
        return checkpoint(self._forward, (x,), self.parameters(), True)
    def _forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))

torch.manual_seed(0)
model = nn.Sequential(Block(), Block(), Block()).double()
x = torch.randn(4, 8, dtype=torch.float64)

def grads(run):
    model.zero_grad(set_to_none=True)
    run(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]

with settings.checkpoint_policy_scope("never"):
    want = grads(model)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with settings.checkpoint_policy_scope(POLICY):
        eager = grads(model) if EAGER_FIRST else want  # measured and planned
        compiled = torch.compile(model, backend="eager")
        got = [grads(compiled) for _ in range(3)]
ours = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
err = max((a - b).abs().max().item() for g in [eager, *got] for a, b in zip(g, want))
print(json.dumps({"err": err, "warnings": ours}))
'''


@pytest.mark.slow
@pytest.mark.parametrize("policy, eager_first", [("budget:1MiB", True), ("budget:1MiB", False),
                                                 ("respect", True)])
def test_budget_under_compile_warns_once_and_keeps_gradients_exact(policy, eager_first):
    code = SCRIPT.replace("POLICY", json.dumps(policy)).replace("EAGER_FIRST", str(eager_first))
    result = last_json(run_python(code, timeout=600))
    assert result["err"] < 1e-12
    if policy == "respect":
        assert result["warnings"] == []
        return
    (message,) = result["warnings"]
    assert message.startswith(f"gradpatch: checkpoint policy '{policy}' is not applied inside torch.compile regions")
    assert "all recomputed" in message
