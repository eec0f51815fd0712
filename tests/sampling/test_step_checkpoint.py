"""``checkpoint_steps``: the per-step recompute (``gradpatch.sampling.steps.checkpoint``) and
``checkpoint_steps="budget:<size>"`` (``gradpatch.sampling.steps.budget``).

Gradients are compared with the plain ``cache=False`` call (every step keeps its graph) over every
parameter; the recompute replays dropout; gradpatch block checkpoints inside a step run once in the
forward and once in the recompute (torch's checkpoint around them runs them three times, shown too);
a budget's kept bytes are measured independently at the allocator (bytes still allocated after the
forward: profiler memory events) against ``checkpoint_steps=True``.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import gradpatch
from support import assert_grads_close
from gradpatch.sampling.steps import budget as _step_budget, checkpoint as _step_checkpoint
from gradpatch.sampling.options import SamplingOptions
from gradpatch.sampling.run import differentiable, run_step
from gradpatch.settings import budget_bytes
from gradpatch.testing import f5_cfm, f5_inputs

os.environ.setdefault("TQDM_DISABLE", "1")


def _grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def _close(want, got):
    assert_grads_close(got, want, rtol=1e-5)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.drop = torch.nn.Dropout(0.3)
        self.b.bias.requires_grad_(False)  # frozen: gets no gradient either way

    def forward(self, x, scale):
        return self.b(self.drop(torch.tanh(self.a(x))).sigmoid()) * scale


def _sample(net, x0, outside, options, steps=4, retain=False):
    """A tiny sampler: ``steps`` evaluations through run_step, a closed-over tensor in the update."""
    torch.manual_seed(1)
    with differentiable(net, options):
        x = x0
        for i in range(steps):
            x = x + run_step(i, steps, net, x, outside) * 0.1
    return x


@pytest.mark.parametrize("checkpoint_steps", [True, "budget:0", "budget:2KiB", "budget:1GiB"])
def test_gradients_equal_the_plain_run_with_dropout_closures_and_autograd_grad(checkpoint_steps):
    net = Net().train()
    x0 = torch.randn(4, 8, requires_grad=True)
    outside = torch.randn(1, requires_grad=True)
    leaves = [x0, outside, *net.parameters()]
    ref = _sample(net, x0, outside, SamplingOptions())
    want = torch.autograd.grad(ref.square().sum(), [x0, outside, net.a.weight, net.b.weight])
    out = _sample(net, x0, outside, SamplingOptions(checkpoint_steps=True, step_budget=_bytes(checkpoint_steps)))
    got = torch.autograd.grad(out.square().sum(), [x0, outside, net.a.weight, net.b.weight])
    torch.testing.assert_close(out, ref)
    _close(list(want), list(got))
    # backward(): the same into .grad, frozen bias untouched; a second backward after retain_graph
    out = _sample(net, x0, outside, SamplingOptions(checkpoint_steps=True, step_budget=_bytes(checkpoint_steps)))
    out.square().sum().backward(retain_graph=True)
    once = _grads(leaves)
    out.square().sum().backward()
    assert net.b.bias.grad is None
    _close([2 * g for g in once if g is not None], [g for g in _grads(leaves) if g is not None])


def _bytes(option):
    return None if option is True else budget_bytes(option)


def test_second_order_gradients_flow_through_the_recompute():
    net = Net().eval()
    x0 = torch.randn(4, 8, requires_grad=True)
    outside = torch.ones(1)
    results = []
    for options in (SamplingOptions(), SamplingOptions(checkpoint_steps=True)):
        out = _sample(net, x0, outside, options)
        (g,) = torch.autograd.grad(out.square().sum(), x0, create_graph=True)
        results.append(torch.autograd.grad(g.square().sum(), net.a.weight)[0])
    torch.testing.assert_close(results[1], results[0])


class Conditioned(torch.nn.Module):
    """A denoiser reading conditioning computed with grad outside it (a closure over a non-leaf, as a
    sampler closing over a trainable text encoder's output does)."""

    def __init__(self, cond):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.cond = torch.nn.Linear(8, 8), cond

    def forward(self, x, outside):
        return torch.tanh(self.lin(x) + self.cond) * outside


def test_an_evaluation_reading_a_tensor_it_was_not_given_takes_the_hook_path_for_the_rest_of_the_call(monkeypatch):
    encoder = torch.nn.Linear(3, 8)
    x0, outside = torch.randn(4, 8, requires_grad=True), torch.ones(1)
    attempts, calls = [], []
    original = _step_checkpoint.recomputed

    def counted(fn, args, kwargs, fast, hold=False):
        attempts.append(fast)
        out, after = original(fn, args, kwargs, fast, hold)
        calls.append(after)
        return out, after

    monkeypatch.setattr(_step_checkpoint, "recomputed", counted)
    grads = []
    for options in (SamplingOptions(), SamplingOptions(checkpoint_steps=True)):
        net = Conditioned(encoder(torch.ones(3)))
        out = _sample(net, x0, outside, options)
        out.square().sum().backward()
        grads.append(_grads([x0, encoder.weight, encoder.bias, net.lin.weight, net.lin.bias]))
        x0.grad = encoder.weight.grad = encoder.bias.grad = None
    assert attempts == [True, False, False, False] and calls == [False] * 4  # one try, then hooks at once
    _close(grads[0], grads[1])
    assert all(g is not None for g in grads[1])


def test_a_structured_output_goes_through_the_node_and_comes_back_as_it_was():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def fn(x):
        h = lin(x)
        return {"sample": torch.tanh(h), "extra": (h.sigmoid(), 3)}

    x = torch.randn(4, 8, requires_grad=True)
    want = fn(x)
    (want["sample"].sum() + want["extra"][0].square().sum()).backward()
    expected = _grads([x, lin.weight, lin.bias])
    x.grad = lin.weight.grad = lin.bias.grad = None
    got, fast = _step_checkpoint.recomputed(fn, (x,), {}, True)
    assert fast and set(got) == {"sample", "extra"} and got["extra"][1] == 3
    assert type(got["sample"].grad_fn).__name__ == "RecomputeBackward"
    (got["sample"].sum() + got["extra"][0].square().sum()).backward()
    _close(expected, _grads([x, lin.weight, lin.bias]))


@pytest.mark.parametrize("fast", [True, False], ids=["node", "per-tensor"])
def test_a_recompute_that_runs_differently_raises(fast):
    calls = []

    def fn(x):
        calls.append(1)
        return x.exp() if len(calls) == 1 else x * 2  # saves its output, then its (scalar) input only

    x = torch.randn(3, requires_grad=True)
    out, _ = _step_checkpoint.recomputed(fn, (x,), {}, fast)
    message = "built another graph when recomputed" if fast else "saved 1 tensors for backward in the forward and 0"
    with pytest.raises(RuntimeError, match=message + ".*does not run the same way twice.*checkpoint_steps=False"):
        out.sum().backward()


def test_a_cache_filled_in_the_forward_raises_rather_than_differentiating_the_cached_value():
    """A positional table computed from a parameter on the first call and cached: the recompute
    reads the cache, so differentiating it would give the parameter no gradient (silently)."""
    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.freq = torch.nn.Parameter(torch.randn(4))
            self.table = None

        def forward(self, x):
            if self.table is None:
                self.table = self.freq.cos()
            return x * self.table

    model, x = Rotary(), torch.randn(4, requires_grad=True)
    out, fast = _step_checkpoint.recomputed(model, (x,), {}, True)
    assert fast
    with pytest.raises(RuntimeError, match="2 autograd nodes then, 1 now"):
        out.sum().backward()


def _ldm_grads(model, cond, **options):
    from audioldm.latent_diffusion.ddim import DDIMSampler

    torch.manual_seed(0)
    z, _ = DDIMSampler(model).sample(4, 1, (4, 16, 16), cond, verbose=False, unconditional_guidance_scale=2.0,
                                     unconditional_conditioning=torch.zeros_like(cond), cache=False, **options)
    z.square().mean().backward()
    grads = [p.grad.clone() for p in model.model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_block_checkpoints_inside_a_step_are_not_recomputed_twice(single_thread, monkeypatch):
    """AudioLDM's transformer blocks are checkpointed (upstream default ``checkpoint=True``): around a
    step checkpoint they ran forward, step recompute and block recompute; now forward and recompute."""
    pytest.importorskip("audioldm")
    from audioldm.latent_diffusion.attention import BasicTransformerBlock

    from gradpatch.testing import audioldm_cond, audioldm_ldm

    runs = [0]
    original = BasicTransformerBlock._forward

    def counted(self, *args, **kwargs):
        runs[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BasicTransformerBlock, "_forward", counted)
    with gradpatch.applied("audioldm"):
        model, cond = audioldm_ldm().eval(), audioldm_cond(1)
        blocks = sum(isinstance(m, BasicTransformerBlock) for m in model.model.modules())
        assert blocks and all(m.checkpoint for m in model.model.modules() if isinstance(m, BasicTransformerBlock))
        plain = _ldm_grads(model, cond)
        counts = {}
        for flat in (True, False):
            monkeypatch.setattr(_step_checkpoint, "FLAT", flat)
            runs[0] = 0
            _close(plain, _ldm_grads(model, cond, checkpoint_steps=True))
            counts[flat] = runs[0]
    assert counts[True] == 2 * 4 * blocks  # 4 steps: forward + one recompute per block
    assert counts[False] == 3 * 4 * blocks  # torch's checkpoint: the blocks' own recompute on top


def _allocated_after_forward(model, cond, text, steps, option) -> tuple[int, object]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out, _ = model.sample(cond, text, duration=60, steps=steps, cfg_strength=2.0, seed=0, cache=False,
                              checkpoint_steps=option)
    return sum(e.self_cpu_memory_usage for e in prof.events()), out


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_step_budget_keeps_what_fits_and_gradients_stay_exact(single_thread, monkeypatch, fraction):
    pytest.importorskip("f5_tts")
    model, (cond, text) = f5_cfm().eval(), f5_inputs()
    params = [p for p in model.parameters() if p.requires_grad]
    budgets = []
    real = _step_budget.StepBudget

    def recorded(size):
        budgets.append(real(size))
        return budgets[-1]

    monkeypatch.setattr(_step_budget, "StepBudget", recorded)
    steps = 8
    with gradpatch.applied("f5_tts"):
        _allocated_after_forward(model, cond, text, 2, False)  # warm-up: first-use allocations
        low, out = _allocated_after_forward(model, cond, text, steps, True)
        del out
        high, out = _allocated_after_forward(model, cond, text, steps, False)
        out.square().mean().backward()
        want = _grads(params)
        model.zero_grad(set_to_none=True)
        size = int(fraction * (high - low))
        kept, out = _allocated_after_forward(model, cond, text, steps, f"budget:{size}")
        out.square().mean().backward()
        _close(want, _grads(params))
    budget = budgets[-1]
    (cost,) = budget.costs.values()  # one signature: CFG batched in one call per step
    assert budget.kept == min(steps - 1, size // cost) and budget.kept + budget.recomputed == steps
    extra = kept - low
    assert extra <= 1.05 * size, (extra / size, budget)
    assert extra >= size - cost - 2**14, (extra / size, budget)  # no evaluation that fits is recomputed
    assert budget.kept_bytes == pytest.approx(extra, rel=0.05, abs=2**14), (extra, budget)


@pytest.mark.parametrize("value, error, message", [
    ("budget:lots", ValueError, "checkpoint_steps='budget:lots': 'lots' is not a size"),
    ("fast", TypeError, r"checkpoint_steps must be True or False, or a string 'budget:<size>'"),
    (1, TypeError, "checkpoint_steps must be True or False"),
])
def test_step_budget_option_is_validated(single_thread, value, error, message):
    pytest.importorskip("f5_tts")
    model, (cond, text) = f5_cfm(), f5_inputs()
    with gradpatch.applied("f5_tts"):
        with pytest.raises(error, match=message):
            model.sample(cond, text, duration=12, steps=2, cache=False, checkpoint_steps=value)
        with pytest.raises(ValueError, match="Pass cache=False as well"):
            model.sample(cond, text, duration=12, steps=2, checkpoint_steps="budget:1MiB")


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-after", "backward-inside"])
def test_autocast_with_its_cast_cache_is_not_taken_for_another_graph(backward_inside):
    """Under CPU bf16 autocast the region caches casts of parameters: the first evaluation makes them,
    later ones reuse them (and leave the node, reading history they were not given), and a backward
    inside the still-open region recomputes with them cached. No error, gradients as plain (bf16)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x0 = torch.randn(4, 8, requires_grad=True)

    def run(checkpointed):
        lin.zero_grad()
        x0.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x, fast = x0, True
            for _ in range(3):
                if checkpointed:
                    x, fast = _step_checkpoint.recomputed(lambda v: torch.tanh(lin(v)) + v, (x,), {}, fast)
                else:
                    x = torch.tanh(lin(x)) + x
            loss = x.float().square().sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return [lin.weight.grad.clone(), lin.bias.grad.clone(), x0.grad.clone()]

    want, got = run(False), run(True)
    for g, w in zip(got, want):  # bf16: the recompute's casts accumulate in another order
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * w.abs().max().item())
