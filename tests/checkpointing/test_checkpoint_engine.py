"""The checkpoint fix as users get it: ``GRADPATCH=1`` in the environment, nothing in the code.

In a fresh interpreter, each real upstream UNet (AudioLDM and AudioLDM2 V1, ldm from
stable-diffusion-sdkit V2, guided-diffusion-sdk V3) trains with each frozen subset, and every
parameter's gradient equals the same model's with no recomputation at all (policy ``never``) to rtol
1e-5. ``tests/checkpointing/test_checkpoint_upstream.py`` shows upstream failing on the same scenarios.
"""
from __future__ import annotations

import pytest

from support import ROOT, last_json, run_python

pytestmark = pytest.mark.slow

SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import torch
import gradpatch
from checkpoint_models import TARGETS, assert_grads_equal, freeze, step
from gradpatch.testing import reinit_zero_weights

problems, checked = [], 0
for name, target in TARGETS.items():
    for scenario in ["cross-attention-only", "norms-frozen", "encoder-frozen", "all-frozen"]:
        torch.manual_seed(0)
        model = reinit_zero_weights(target.build(0.1))  # dropout on: the recompute must replay the RNG
        model.train()
        freeze(model, target, scenario)
        x = torch.randn(2, 4, 16, 16, requires_grad=scenario == "all-frozen")
        try:
            fixed = step(model, target, x)
            with gradpatch.checkpoint_policy_scope("never"):
                reference = step(model, target, x)
            assert_grads_equal(fixed, reference)
            assert any(g is not None for g in reference.values())
            checked += 1
        except Exception as exc:
            problems.append(f"{{name}}/{{scenario}}: {{exc!r}}"[:400])
statuses = {{r.patch: [str(r.status), r.variant] for r in gradpatch.report()}}
print(json.dumps([problems, checked, statuses]))
"""


def test_every_target_and_frozen_subset_under_gradpatch_1():
    problems, checked, statuses = last_json(run_python(SCRIPT, env={"GRADPATCH": "1"}, timeout=600))
    assert problems == []
    assert checked == 16
    for patch, variant in [("audioldm.checkpoint", "V1"), ("audioldm2.checkpoint", "V1"),
                           ("ldm.checkpoint", "V2"), ("guided_diffusion.checkpoint", "V3")]:
        assert statuses[patch][0] == "applied" and statuses[patch][1].startswith(variant), statuses[patch]
