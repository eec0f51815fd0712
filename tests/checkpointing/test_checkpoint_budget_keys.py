"""What makes a ``budget:<size>`` block new, against memory and gradients: a submodule's setting
(dropout's ``p``) that changes what the block saves, and inputs whose length changes at every step
(speech, text), planned per shape bucket.

Memory is the allocator's (the profiler's allocation events: bytes still allocated after the forward,
as in ``test_checkpoint_budget_follow``); gradients are compared with the same step under ``never``
(same seed: the checkpoint replays dropout's RNG), float64.
"""
from __future__ import annotations

import random

import pytest
import torch

import gradpatch
from gradpatch.checkpointing import budget
from checkpoint_models import chain, extra

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def fresh_planner():
    budget.reset()
    yield
    budget.reset()


def step_grads(model, x, policy: str, seed: int = 0) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with gradpatch.checkpoint_policy_scope(policy):
        model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_same_grads(got, want) -> None:
    scale = max(w.abs().max().item() for w in want)
    assert scale > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12 * scale)


def set_dropout(model, p: float) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p


def test_a_changed_dropout_probability_is_measured_again():
    """Planned with ``p=0`` (dropout saves no mask), then ``p=0.5``: the blocks save their masks too.
    The plan must follow, keeping within the budget and saying what it keeps (it kept 1.333x the
    budget while ``checkpoint_plan()`` said 0.872 before blocks were keyed by their settings)."""
    model, x = chain(), torch.randn(64, 128)
    set_dropout(model, 0.0)
    respect, never = extra(model, x, "respect"), extra(model, x, "never")
    size = int(0.5 * (never - respect))
    policy = f"budget:{size}"
    for seed in range(budget.TIMING_CALLS + 1):
        step_grads(model, x, policy, seed)
    set_dropout(model, 0.5)
    for seed in range(budget.TIMING_CALLS + 1):
        step_grads(model, x, policy, seed)
    with gradpatch.checkpoint_policy_scope(policy):
        plan = budget.checkpoint_plan(model)
    kept = extra(model, x, policy) - extra(model, x, "respect")
    assert plan.complete, plan
    assert kept <= 1.05 * size, (kept / size, plan.kept_bytes / size, plan)
    assert plan.kept_bytes == pytest.approx(kept, rel=0.05, abs=2**12), (kept / size, plan.kept_bytes / size)
    model.double()
    assert_same_grads(step_grads(model, x.double(), policy, 7), step_grads(model, x.double(), "never", 7))


class Mixer(torch.nn.Module):
    """A block over a sequence (batch, length, width): a position-mixing product, so what it saves
    grows faster than its input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        from gradpatch.checkpointing.checkpoint import checkpoint

        return checkpoint(self._forward, (x,), self.parameters(), True)

    def _forward(self, x):
        h = torch.tanh(self.linear(x))
        mixed = torch.softmax(h @ h.transpose(1, 2) / h.shape[-1] ** 0.5, dim=-1) @ h
        return self.drop(mixed).sigmoid()


def test_a_new_length_at_every_step_is_planned_per_bucket():
    """Text-to-speech batches: a new sequence length at every step. Before shape buckets every step
    made new blocks, measured and never planned (after 24 steps: still measuring, nothing kept).
    Planned per power-of-two bucket, the plan completes; at the top of a bucket, longer than every
    length it was measured at, it keeps within its budget; gradients equal ``never``'s."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Mixer(32) for _ in range(6)])
    rng = random.Random(0)
    lengths = [rng.randrange(130, 200) for _ in range(24)]  # one bucket (256)
    top = torch.randn(2, 256, 32)
    respect, never = extra(model, top, "respect"), extra(model, top, "never")
    size = int(0.5 * (never - respect))
    policy = f"budget:{size}"
    for seed, length in enumerate(lengths):
        step_grads(model, torch.randn(2, length, 32), policy, seed)
    with gradpatch.checkpoint_policy_scope(policy):
        plan = budget.checkpoint_plan(model)
    assert plan.complete and len(plan) == 6 and not all(e.recomputed for e in plan), plan
    for seed in range(budget.TIMING_CALLS + 1):  # the top of the bucket: measured again, planned anew
        step_grads(model, top, policy, seed)
    kept = extra(model, top, policy) - extra(model, top, "respect")
    with gradpatch.checkpoint_policy_scope(policy):
        plan = budget.checkpoint_plan(model)
    assert plan.complete and len(plan) == 6 and not all(e.recomputed for e in plan), plan
    assert kept <= 1.05 * size, (kept / size, plan)
    model.double()
    x = torch.randn(2, 170, 32, dtype=torch.float64)
    assert_same_grads(step_grads(model, x, policy, 3), step_grads(model, x, "never", 3))


def test_the_key_holds_submodule_settings_and_an_integer_dropout_probability():
    from gradpatch.checkpointing.budget import key

    block = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0), torch.nn.GELU())
    first = key.state(block)
    block[1].p = 0.5  # Dropout(0) holds the integer 0
    assert key.state(block) != first
    block[1].p = 0
    assert key.state(block) == first
    block[2].approximate = "tanh"
    assert key.state(block) != first
    block[2].approximate = "none"
    block[1].eval()  # a submodule's own mode
    assert key.state(block) != first
