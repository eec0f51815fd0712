"""The ``budget:<size>`` checkpoint policy: parsing, the knapsack, and the real AudioLDM UNet.

Gradients under the policy (while it measures and once it keeps blocks) equal those of the same model
without any checkpoint (``checkpoint = lambda f, i, p, flag: f(*i)``) at rtol 1e-5, with dropout on
and frozen subsets. Memory is measured at the allocator level with the profiler's allocation events.
"""
from __future__ import annotations

import itertools
import random
from contextlib import contextmanager

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import gradpatch
from support import last_json, run_python
from gradpatch import settings
from gradpatch.checkpointing import budget
from gradpatch.checkpointing.budget import knapsack
from gradpatch.patching import patch as registry
from checkpoint_models import TARGETS, allocated_after_forward, assert_grads_equal, build, freeze, install, step

AUDIOLDM = TARGETS["audioldm"]


@pytest.mark.parametrize("text, size", [
    ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5e9", 1_500_000_000), ("10kB", 10_000),
    ("3 MB", 3_000_000), ("0.5gib", 2**29), ("100", 100), ("0", 0), ("7b", 7), ("1KiB", 1024),
    ("2.5E3", 2500), ("1tb", 10**12),
])
def test_sizes(text, size):
    assert settings.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-5MB", "5XB", "1e", "inf", "nan", "5 M B", "1e30"])
def test_bad_sizes_say_what_to_write(text):
    with pytest.raises(ValueError, match="size"):
        settings.parse_size(text)
    with pytest.raises(ValueError) as error:
        settings.set_checkpoint_policy(f"budget:{text}")
    assert f"checkpoint policy 'budget:{text}'" in str(error.value)
    assert settings.checkpoint_policy == "respect"


def test_policy_accepted_by_setter_and_scope():
    assert settings.set_checkpoint_policy(" budget:512MiB ") == "respect"
    try:
        assert settings.checkpoint_policy == "budget:512MiB"
        with gradpatch.checkpoint_policy_scope("budget:1GB"):
            assert settings.checkpoint_policy == "budget:1GB"
        assert settings.checkpoint_policy == "budget:512MiB"
    finally:
        settings.set_checkpoint_policy("respect")
    with pytest.raises(ValueError, match="respect, always, never, budget:<size>"):
        settings.set_checkpoint_policy("sometimes")


def test_policy_accepted_by_environment_and_apply():
    code = """
import json, warnings
warnings.simplefilter("always")
import gradpatch
from gradpatch import settings
first = settings.checkpoint_policy
gradpatch.apply("audioldm", checkpoint="budget:1.5e9")
with gradpatch.applied("audioldm", checkpoint="budget:2GB"):
    inside = settings.checkpoint_policy
print(json.dumps([first, settings.checkpoint_policy, inside]))
"""
    out = last_json(run_python(code, env={"GRADPATCH": "audioldm", "GRADPATCH_CHECKPOINT": "budget:2GiB"}))
    assert out == ["budget:2gib", "budget:1.5e9", "budget:2GB"]
    result = run_python("import gradpatch", env={"GRADPATCH": "audioldm",
                                                 "GRADPATCH_CHECKPOINT": "budget:2 gigs"})
    warnings = [line for line in result.stderr.splitlines() if "ConfigWarning" in line]
    assert result.returncode == 0 and len(warnings) == 1, result.stderr
    assert "GRADPATCH_CHECKPOINT='budget:2 gigs' is not one of respect, always, never, budget:<size> or peak:<size>;" \
           " '2 gigs' is not a size" in warnings[0]


def test_knapsack_is_optimal_and_within_budget():
    rng = random.Random(0)
    for _ in range(300):
        items = [knapsack.Item(rng.choice([0, rng.randint(1, 1000)]), rng.choice([0.0, rng.random()]))
                 for _ in range(rng.randint(1, 9))]
        size = rng.randint(0, 3000)
        fits = [keep for keep in itertools.product((False, True), repeat=len(items))
                if sum(it.bytes for it, k in zip(items, keep) if k) <= size]
        best = max(sum(it.seconds for it, k in zip(items, keep) if k) for keep in fits)
        keep = knapsack.choose(items, size)
        assert sum(it.bytes for it, k in zip(items, keep) if k) <= size
        assert sum(it.seconds for it, k in zip(items, keep) if k) == pytest.approx(best, abs=1e-12)
        # The fallback rounds sizes up to budget/4096: never over the budget, and at least as good
        # as the best subset within the budget less one rounding unit per item.
        big = [knapsack.Item(it.bytes * 10**6 + rng.randint(0, 999), it.seconds) for it in items]
        chosen = knapsack._rounded(big, [i for i, it in enumerate(big) if 0 < it.bytes <= size * 10**6
                                       and it.seconds > 0], size * 10**6)
        assert sum(big[i].bytes for i in chosen) <= size * 10**6
        margin = size * 10**6 - len(big) * -(-size * 10**6 // knapsack._STEPS)
        within = max(sum(it.seconds for it, k in zip(big, keep) if k and it.bytes > 0)
                     for keep in itertools.product((False, True), repeat=len(big))
                     if sum(it.bytes for it, k in zip(big, keep) if k) <= max(margin, 0))
        assert sum(big[i].seconds for i in chosen) >= within - 1e-12


def test_knapsack_beats_greedy_by_time_per_byte():
    items = [knapsack.Item(60, 6.0), knapsack.Item(50, 4.9), knapsack.Item(50, 4.9)]
    assert knapsack.choose(items, 100) == [False, True, True]  # greedy would take only the first


def step_peak(model, x) -> int:
    """The most bytes allocated at once during a training step, beyond those at its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        AUDIOLDM.call(model, x).square().mean().backward()
    level = peak = 0
    for _, size in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                          if e.name() == "[memory]"):
        level += size
        peak = max(peak, level)
    return peak


@contextmanager
def policy(name: str):
    with gradpatch.checkpoint_policy_scope(name):
        yield


@pytest.fixture
def unet(monkeypatch):
    """The tiny AudioLDM UNet, every block checkpointed, dropout on, the fix installed; a fresh
    budget."""
    torch.manual_seed(0)
    model = build(AUDIOLDM, dropout=0.1)
    model.train()
    budget.reset()
    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "fixed")
        yield model
    budget.reset()


def reference(model, x, monkeypatch):
    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "none")
        return step(model, AUDIOLDM, x)


@pytest.mark.parametrize("scenario", ["cross-attention-only", "encoder-frozen", "none"])
def test_gradients_equal_no_checkpoint_while_measuring_and_planned(unet, monkeypatch, scenario):
    freeze(unet, AUDIOLDM, scenario)
    x = torch.randn(2, 4, 16, 16)
    want = reference(unet, x, monkeypatch)
    with policy("budget:1GiB"):
        for i in range(budget.TIMING_CALLS):  # measuring steps: everything recomputed
            assert_grads_equal(step(unet, AUDIOLDM, x), want)
            if i < budget.TIMING_CALLS - 1:
                plan = budget.checkpoint_plan()
                assert all(e.recomputed for e in plan) and ": measuring" in plan.summary()
    total = sum(e.bytes for e in budget.checkpoint_plan())
    with policy(f"budget:{total // 2}"):
        assert_grads_equal(step(unet, AUDIOLDM, x), want)
        plan = budget.checkpoint_plan(unet)
    assert plan.complete and len(plan) == 12, plan  # 8 ResBlocks and 4 transformer blocks
    assert 0 < sum(not e.recomputed for e in plan) < len(plan), plan
    assert 0 < plan.kept_bytes <= total // 2
    assert all(e.name.endswith("._forward") and e.recompute_seconds >= 0 for e in plan)
    assert any(e.name.startswith("output_blocks.") for e in plan)


def test_plan_keeps_what_it_says_within_the_budget(unet):
    x = torch.randn(2, 4, 16, 16)
    with policy("respect"):
        respect = allocated_after_forward(unet, x)
    with policy("never"):
        never = allocated_after_forward(unet, x)
    with policy("budget:0"):
        for _ in range(budget.TIMING_CALLS):
            step(unet, AUDIOLDM, x)
        assert allocated_after_forward(unet, x) == pytest.approx(respect, abs=2**14)
    estimated = sum(e.bytes for e in budget.checkpoint_plan())
    assert estimated == pytest.approx(never - respect, rel=0.01)  # every kept byte is counted
    for fraction in (0.3, 0.6):
        size = int(fraction * (never - respect))
        with policy(f"budget:{size}"):
            kept = allocated_after_forward(unet, x) - respect
            plan = budget.checkpoint_plan()
        assert 0 < kept <= size
        assert kept == pytest.approx(plan.kept_bytes, rel=0.01)


def test_measuring_steps_peak_as_respect(unet):
    x = torch.randn(2, 4, 16, 16)
    with policy("respect"):
        step(unet, AUDIOLDM, x)  # warm-up: first-call allocations
        respect = step_peak(unet, x)
    with policy("budget:1GiB"):
        first = step_peak(unet, x)
    largest = max(e.bytes for e in budget.checkpoint_plan())
    # Bytes are counted during the checkpoint's own forward: no extra run, no extra memory (far
    # within the bound of one block's activations above respect).
    assert first <= respect + 2**14 < respect + largest
    with policy("budget:1GiB"):
        for _ in range(budget.TIMING_CALLS):
            step(unet, AUDIOLDM, x)
        assert step_peak(unet, x) > respect + largest  # keeping everything: the peak grows


def test_new_shapes_are_measured_and_planned_again(unet, monkeypatch):
    x = torch.randn(2, 4, 16, 16)
    with policy("budget:1GiB"):
        for _ in range(budget.TIMING_CALLS + 1):
            step(unet, AUDIOLDM, x)
        before = budget.checkpoint_plan()
        assert before.complete and not any(e.recomputed for e in before)
        bigger = torch.randn(2, 4, 32, 32)  # a higher resolution
        want = reference(unet, bigger, monkeypatch)
        assert_grads_equal(step(unet, AUDIOLDM, bigger), want)
        during = budget.checkpoint_plan()
        assert all(e.recomputed for e in during) and "measuring" in during.summary()
        for _ in range(budget.TIMING_CALLS):
            step(unet, AUDIOLDM, bigger)
        after = budget.checkpoint_plan()
    assert after.complete and not any(e.recomputed for e in after)
    for old, new in zip(before, after):
        assert new.bytes > 3.5 * old.bytes  # four times the pixels


def test_alternating_shapes_are_planned_together_within_the_budget(unet, monkeypatch):
    small, large = torch.randn(2, 4, 16, 16), torch.randn(2, 4, 32, 32)
    want = {id(x): reference(unet, x, monkeypatch) for x in (small, large)}
    with policy("budget:6MiB"):
        for x in [small, large] * (budget.TIMING_CALLS + 1):
            assert_grads_equal(step(unet, AUDIOLDM, x), want[id(x)])
        plan = budget.checkpoint_plan()
    assert plan.complete and len(plan) == 24, plan  # each block at both shapes
    assert 0 < sum(not e.recomputed for e in plan) < 24 and plan.kept_bytes <= 6 * 2**20


def test_flag_false_and_no_grad_run_once():
    calls = []
    layer = torch.nn.Linear(3, 3)

    def func(x):
        calls.append(1)
        return layer(x)

    from gradpatch.checkpointing.checkpoint import checkpoint
    with policy("budget:1MB"):
        checkpoint(func, (torch.randn(2, 3),), layer.parameters(), False).sum().backward()
        with torch.no_grad():
            checkpoint(func, (torch.randn(2, 3),), layer.parameters(), True)
        assert len(calls) == 2
        # Not a module's method: never planned, always recomputed.
        checkpoint(func, (torch.randn(2, 3),), layer.parameters(), True).sum().backward()
        assert len(calls) == 4


def test_report_and_doctor_show_the_plan(unet, capsys):
    x = torch.randn(2, 4, 16, 16)
    with policy("budget:1GiB"):
        assert "checkpoint policy budget:1GiB" in str(gradpatch.report())
        for _ in range(budget.TIMING_CALLS + 1):
            step(unet, AUDIOLDM, x)
        line = registry.report_line()
        assert line.startswith("checkpoint policy budget:1GiB: 12 of 12 blocks kept"), line
        assert line in str(gradpatch.report())
        with gradpatch.grad_doctor(unet):
            step(unet, AUDIOLDM, x)
    err = capsys.readouterr().err
    assert "12 of 12 blocks kept" in err and "output_blocks.1.0._forward" in err
    assert registry.report_line() == ""
    assert gradpatch.checkpoint_plan is budget.checkpoint_plan


@pytest.mark.slow
def test_doctor_cli_prints_the_finished_plan_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("""
import torch
from gradpatch.testing import audioldm_batch, audioldm_unet
model = audioldm_unet(use_checkpoint=True)
batch = audioldm_batch()
for _ in range(4):
    model.zero_grad()
    model(batch["x"], timesteps=batch["timesteps"], y=batch["y"]).square().mean().backward()
""")
    result = run_python(f"import sys, gradpatch.cli; sys.exit(gradpatch.cli.main(['doctor', {str(script)!r}]))",
                        env={"GRADPATCH": "audioldm", "GRADPATCH_CHECKPOINT": "budget:4MiB"})
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("gradpatch doctor: checkpoint policy budget:4mib:") == 1, result.stderr
    assert "output_blocks.3.0._forward" in result.stderr and "measuring" not in result.stderr


def test_cli_run_checks_the_policy(capsys):
    from gradpatch import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--checkpoint", "budget:lots", "--", "true"])
    assert exit_.value.code == 2
    assert "'lots' is not a size" in capsys.readouterr().err
    assert cli._policy("budget:2GiB") == "budget:2GiB" and cli._policy("never") == "never"


class Shared(torch.nn.Module):
    """One block applied ``times`` times per forward: its kept activations count that many times."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times
        self.block = Block()

    def forward(self, x):
        for _ in range(self.times):
            x = self.block(x)
        return x


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        from gradpatch.checkpointing.checkpoint import checkpoint

        return checkpoint(self._forward, (x,), self.parameters(), True)

    def _forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)).sigmoid()


def test_a_block_called_twice_per_step_counts_twice():
    sizes = []
    for times in (1, 2):
        budget.reset()
        torch.manual_seed(0)
        model = Shared(times)
        x = torch.randn(32, 64, requires_grad=True)  # both calls see the same signature
        with policy("budget:1GiB"):
            for _ in range(budget.TIMING_CALLS):
                model(x).sum().backward()
            plan = budget.checkpoint_plan(model)
        assert plan.complete and len(plan) == 1, plan
        sizes.append(plan[0].bytes)
    assert sizes[1] == 2 * sizes[0] > 0
    # Calls at different signatures (input requiring grad or not) are separate blocks.
    budget.reset()
    x = torch.randn(32, 64)
    with policy("budget:1GiB"):
        for _ in range(budget.TIMING_CALLS + 1):
            model(x).sum().backward()
        plan = budget.checkpoint_plan(model)
    budget.reset()
    # The first call's output, saved by its sigmoid, is the second's saved input: counted once, in
    # the second (which holds it whether kept or recomputed).
    assert plan.complete and [e.bytes for e in plan] == [sizes[0] - 32 * 64 * 4, sizes[0]], plan


class Escaping(torch.nn.Module):
    """A block reading a non-leaf tensor it is not given: the checkpoint takes torch's own
    non-reentrant checkpoint for it (from its second call on, at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)
        self.log_scale = torch.nn.Parameter(torch.zeros(256))

    def forward(self, x):
        from gradpatch.checkpointing.checkpoint import checkpoint

        self.scale = self.log_scale.exp()  # computed before the call: a non-leaf closure tensor
        return checkpoint(self._forward, (x,), self.parameters(), True)

    def _forward(self, x):
        return torch.tanh(self.linear(x) * self.scale).sigmoid()


def test_blocks_on_torchs_checkpoint_are_measured_without_disturbing_it():
    torch.manual_seed(0)
    model = Escaping()
    x = torch.randn(64, 256, requires_grad=True)  # activations well above the checkpoint's 5 KB

    def grads(create_graph: bool) -> list:
        model.zero_grad(set_to_none=True)
        out = model(x).square().sum()
        first = torch.autograd.grad(out, [x, *model.parameters()], create_graph=create_graph)
        if not create_graph:
            return list(first)
        return list(torch.autograd.grad(sum(g.square().sum() for g in first),
                                        [x, *model.parameters()]))

    want = {}
    with policy("never"):
        for create_graph in (False, True):
            want[create_graph] = grads(create_graph)
    budget.reset()
    with policy("budget:1GiB"):
        for _ in range(budget.TIMING_CALLS + 2):
            for create_graph in (False, True):
                for g, w in zip(grads(create_graph), want[create_graph]):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        plan = budget.checkpoint_plan(model)
    budget.reset()
    assert plan.complete and len(plan) == 1 and plan[0].bytes > 2**16, plan


def test_blocks_only_torchs_checkpoint_runs_are_always_recomputed():
    torch.manual_seed(0)
    model = Block()
    model._is_replica = True  # as DataParallel marks its replicas: the graph path at once
    x = torch.randn(64, 64, requires_grad=True)
    with policy("never"):
        want = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    budget.reset()
    with policy("budget:1GiB"):
        for _ in range(budget.TIMING_CALLS + 1):
            got = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        plan = budget.checkpoint_plan(model)
    budget.reset()
    assert plan.complete and len(plan) == 1 and plan[0].recomputed and plan[0].bytes is None, plan
