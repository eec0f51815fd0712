"""The ``budget:<size>`` policy's byte model against memory, and plans that follow the model.

Blocks here end in ``sigmoid``, which saves its output: that output is also the next block's input,
held by that block's checkpoint, so summing per-block saved bytes would count it twice. Memory is
measured independently, at the allocator (the profiler's allocation events during the forward: the
bytes still allocated after it). The kept extra bytes stay within 5% of the budget, and
``checkpoint_plan().kept_bytes`` within 5% of the measured extra, also after gradual unfreezing,
eval/train switches and autocast on/off; gradients equal those without checkpointing.
"""
from __future__ import annotations

import pytest
import torch

import gradpatch
from gradpatch.checkpointing import budget
from gradpatch.checkpointing.budget import key, planner

from checkpoint_models import Block, chain, extra


def train(model, x, policy: str, steps: int, autocast: bool = False) -> list:
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with gradpatch.checkpoint_policy_scope(policy), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).mean()
        loss.backward()  # outside autocast, as torch recommends: its cached casts are freed
    return [p.grad for p in model.parameters()]


def check(model, x, size: int, respect: int, largest: int) -> None:
    policy = f"budget:{size}"
    train(model, x, policy, budget.TIMING_CALLS + 1)
    with gradpatch.checkpoint_policy_scope(policy):
        plan = budget.checkpoint_plan(model)
    kept = extra(model, x, policy) - respect
    assert plan.complete, plan
    assert kept <= 1.05 * size, (kept / size, plan)
    if any(e.recomputed for e in plan):  # no block that fits is left out
        assert kept >= size - largest - 2**12, (kept / size, plan)
    assert plan.kept_bytes == pytest.approx(kept, rel=0.05, abs=2**12), (kept, plan)


@pytest.fixture(autouse=True)
def fresh_planner():
    budget.reset()
    yield
    budget.reset()


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_kept_bytes_match_memory_at_three_budgets(fraction):
    model, x = chain(), torch.randn(64, 128)
    respect, never = extra(model, x, "respect"), extra(model, x, "never")
    largest = (never - respect) // len(model) + 2**12
    check(model, x, int(fraction * (never - respect)), respect, largest)
    # The old per-block sum counted each output twice; now the blocks add up to never's extra. (An
    # output that only ops after the blocks save is counted too: an upper bound there.)
    with gradpatch.checkpoint_policy_scope("budget:1GiB"):
        train(model, x, "budget:1GiB", budget.TIMING_CALLS + 1)
        total = budget.checkpoint_plan(model).kept_bytes
    assert total == pytest.approx(never - respect, rel=0.02)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_real_audioldm_unet_keeps_its_budget(fraction, monkeypatch):
    """The tiny AudioLDM UNet (the real ``UNetModel``: 8 ResBlocks and 4 transformer blocks, every
    one checkpointed, dropout on): the kept extra stays within the budget and ``checkpoint_plan()``
    says it within 5%, whichever blocks the measured times choose. With every byte worth the same
    time (seconds pinned to bytes: no timing), the plan fills at least 90% of the budget."""
    from checkpoint_models import TARGETS, allocated_after_forward, build, install, step

    target = TARGETS["audioldm"]
    model, x = build(target, dropout=0.1).train(), torch.randn(2, 4, 16, 16)
    install(monkeypatch, target, "fixed")

    def kept(size: int) -> tuple[int, object]:
        with gradpatch.checkpoint_policy_scope(f"budget:{size}"):
            for _ in range(budget.TIMING_CALLS + 1):
                step(model, target, x)
            plan = budget.checkpoint_plan(model)
            return allocated_after_forward(model, x) - respect, plan

    with gradpatch.checkpoint_policy_scope("respect"):
        respect = allocated_after_forward(model, x)
    with gradpatch.checkpoint_policy_scope("never"):
        never = allocated_after_forward(model, x)
    size = int(fraction * (never - respect))
    for pinned in (False, True):
        budget.reset()
        if pinned:
            monkeypatch.setattr(planner.Block, "seconds", property(
                lambda b: float(b.step_bytes) if b.measured and not b.opaque else 0.0))
        extra_, plan = kept(size)
        assert plan.complete and len(plan) == 12, plan
        assert 0 < extra_ <= 1.05 * size, (extra_ / size, plan)
        assert plan.kept_bytes == pytest.approx(extra_, rel=0.05), (extra_, plan)
    assert extra_ >= 0.90 * size, (extra_ / size, plan)


def test_gradual_unfreezing_is_measured_again():
    model, x = chain(6), torch.randn(64, 128)
    respect, never = extra(model, x, "respect"), extra(model, x, "never")
    size = (never - respect) // 2
    for block in model[:5]:
        block.requires_grad_(False)
    train(model, x, f"budget:{size}", budget.TIMING_CALLS + 1)
    for i in (4, 2, 0):  # unfreeze from the top down
        for block in model[i:]:
            block.requires_grad_(True)
        respect = extra(model, x, "respect")  # what the checkpoints hold depends on it too
        first = extra(model, x, f"budget:{size}") - respect
        assert first <= 1.05 * size  # the changed blocks are recomputed while measured
        state = torch.get_rng_state()  # the same dropout masks in both
        got = train(model, x, f"budget:{size}", 1)
        torch.set_rng_state(state)
        want = train(model, x, "never", 1)
        assert sum(g is not None for g in got) == 2 * (6 - i)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        check(model, x, size, respect, (never - respect) // 6 + 2**12)


def test_eval_train_and_autocast_switches_are_measured_again():
    model, x = chain(6), torch.randn(64, 128)
    respect, never = extra(model, x, "respect"), extra(model, x, "never")
    size = (never - respect) // 2
    model.eval()  # no dropout: less to keep
    train(model, x, f"budget:{size}", budget.TIMING_CALLS + 1)
    model.train()
    assert extra(model, x, f"budget:{size}") - respect <= 1.05 * size
    check(model, x, size, respect, (never - respect) // 6 + 2**12)
    respect_bf16 = extra(model, x, "respect", autocast=True)
    assert extra(model, x, f"budget:{size}", autocast=True) - respect_bf16 <= 1.05 * size
    train(model, x, f"budget:{size}", budget.TIMING_CALLS + 1, autocast=True)
    kept = extra(model, x, f"budget:{size}", autocast=True) - respect_bf16
    with gradpatch.checkpoint_policy_scope(f"budget:{size}"):
        plan = budget.checkpoint_plan(model)
    assert kept <= 1.05 * size
    assert plan.complete and len(plan) == 6, plan  # the bf16 blocks, measured anew
    assert plan.kept_bytes == pytest.approx(kept, rel=0.05, abs=2**12), (kept, plan)
    # Back to fp32: both dtypes' blocks are planned together, as alternating shapes are.
    train(model, x, f"budget:{size}", budget.TIMING_CALLS + 1)
    assert extra(model, x, f"budget:{size}") - respect <= 1.05 * size


def test_a_block_state_key_is_cheap_and_follows_registration():
    block = Block(8)
    first = key.state(block)
    assert key.state(block) == first
    block.linear.weight.requires_grad_(False)
    assert key.state(block) != first
    block.extra = torch.nn.Linear(2, 2)  # a new submodule: its parameters are listed again
    assert key.state(block)[1] == 0b1110
    assert len(key._PARAMS[block][1]) == 4
    block.eval()
    assert key.state(block)[0] is False
    block.double()
    assert key.state(block)[2] is torch.float64


def test_tradeoff_table_plot_and_cli(tmp_path, capsys):
    from gradpatch import cli
    from gradpatch.checkpointing.tradeoff import tradeoff

    model, x = chain(6), torch.randn(64, 128)
    result = tradeoff(lambda: model(x).mean().backward(), fractions=(0.5,), repeats=1)
    assert [p.policy.split(":")[0] for p in result] == ["respect", "budget", "never"]
    respect, half, never = result
    assert respect.extra_bytes == 0 and respect.ratio == 1
    assert 0 < half.extra_bytes <= never.extra_bytes and never.extra_bytes > 0
    assert "beyond respect" in str(result) and "budget:" in str(result)
    assert "gradpatch tradeoff [" in capsys.readouterr().err  # the progress bar
    pytest.importorskip("matplotlib")
    result.plot(str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "mystep.py").write_text(
        "import torch\n"
        "def make():\n"
        "    layer = torch.nn.Linear(4, 4)\n"
        "    return lambda: layer(torch.randn(2, 4)).sum().backward()\n")
    import os
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert cli.main(["tradeoff", "mystep:make", "--repeats", "1", "--fractions", "0.5"]) == 0
        assert cli.main(["tradeoff", "mystep:missing"]) == 2
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    assert "respect" in captured.out and "never" in captured.out
    assert "cannot load 'mystep:missing'" in captured.err


def test_tradeoff_names_budgets_in_mib_shows_the_spread_warns_when_noisy_and_recommends():
    from gradpatch.checkpointing.tradeoff import Point, Tradeoff, budget_policy
    from gradpatch.settings import check_policy

    mib = 2**20
    # A fake timing source: the points as tradeoff() builds them, with the timings given.
    steady = Tradeoff([Point("respect", 10 * mib, 0, 0.0200, 1.0, (0.0199, 0.0200, 0.0202)),
                       Point(budget_policy(1359274), 10 * mib + 1359274, 1359274, 0.0180, 0.9, (0.0179, 0.018, 0.0181)),
                       Point("never", 14 * mib, 4 * mib, 0.0170, 0.85, (0.0169, 0.0170, 0.0171))])
    text = str(steady)
    lines = text.splitlines()
    assert lines[0].split() == ["policy", "peak", "beyond", "respect", "s/step", "spread", "/respect"]
    assert lines[2].split() == ["budget:1.30MiB", "11.30", "MiB", "1.30", "MiB", "0.0180", "1%", "0.900"]
    assert "budget:1359274" not in text and check_policy("budget:1.30MiB") == "budget:1.30MiB"
    assert "warning" not in text and steady.noise() == ""
    assert lines[-1] == "recommended: budget:1.30MiB (within 10% of the fastest step, never, at 2.70 MiB less peak)"
    noisy = Tradeoff([p._replace(times=(p.seconds * 0.7, p.seconds, p.seconds * 1.3)) for p in steady])
    text = str(noisy)
    assert "60%" in text and "warning: timings too noisy to rank: respect's spread 60% exceeds the 18%" in text
    assert text.splitlines()[-1] == "recommended: respect (the lowest peak; the timings cannot rank the policies)"
    assert max(map(len, text.splitlines())) <= 100
    fastest_is_cheapest = Tradeoff([Point("respect", mib, 0, 0.01, 1.0, (0.01, 0.01)),
                                    Point("never", 2 * mib, mib, 0.02, 2.0, (0.02, 0.02))])
    assert fastest_is_cheapest.recommendation() == "recommended: respect (the fastest step, 1.00 MiB peak)"
    assert [budget_policy(n) for n in (500, 5000, 3 * mib // 2, 200 * mib)] == [
        "budget:500", "budget:0.00477MiB", "budget:1.50MiB", "budget:200MiB"]


def test_tradeoff_takes_a_timing_source():
    from gradpatch.checkpointing.tradeoff import tradeoff

    model, x = chain(2), torch.randn(4, 128)
    ticks = iter(range(1, 1000))
    result = tradeoff(lambda: model(x).mean().backward(), fractions=(0.5,), repeats=3, progress=False,
                      timer=lambda step, cuda: (step(), next(ticks) * 1e-3)[1])
    assert [len(p.times) for p in result] == [3, 3, 3] and result[0].times == (0.001, 0.002, 0.003)
    assert result[1].policy.endswith("MiB") or result[1].policy[7:].isdigit()
    assert "recommended: " in str(result)
