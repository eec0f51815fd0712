"""The fixed checkpoint, ``checkpoint_steps`` and ``gradpatch.differentiable`` under the caller's own
memory tools: ``torch.autograd.graph.save_on_cpu()`` and any ``saved_tensors_hooks``. They keep
checkpointing (bytes still allocated after the forward, the profiler's allocation events, as without
the hooks), what they keep goes through the caller's hooks, and gradients equal the plain run's."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import gradpatch
from support import assert_grads_close
from gradpatch.checkpointing.checkpoint import checkpoint
from gradpatch.testing import f5_cfm, f5_inputs

os.environ.setdefault("TQDM_DISABLE", "1")
torch.set_num_threads(1)


class Counting:
    """Saved-tensor hooks that count their calls and keep a detached copy (an offload stand-in)."""

    def __init__(self) -> None:
        self.packed = self.unpacked = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        return tensor.detach().clone()

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        self.unpacked += 1
        return packed

    def __call__(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _kept(fn) -> tuple[int, object]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return sum(e.self_cpu_memory_usage for e in prof.events()), out


class Block(torch.nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return checkpoint(self._forward, (x,), self.parameters(), True)

    def _forward(self, x):
        return x + self.b(torch.tanh(self.a(x)).sigmoid())


@pytest.mark.parametrize("hooks", ["save_on_cpu", "counting"])
def test_fixed_checkpoint_keeps_checkpointing_under_the_callers_hooks(hooks) -> None:
    torch.manual_seed(0)
    net, x = torch.nn.Sequential(*[Block() for _ in range(4)]).double(), torch.randn(256, 128).double()
    counting = Counting()
    outer = torch.autograd.graph.save_on_cpu if hooks == "save_on_cpu" else counting

    def run(policy: str, context) -> tuple[int, list]:
        net.zero_grad(set_to_none=True)
        with gradpatch.checkpoint_policy_scope(policy), context():
            kept, out = _kept(lambda: net(x).square().sum())
        out.backward()
        return kept, [p.grad.clone() for p in net.parameters()]

    bare, _ = run("respect", contextlib.nullcontext)
    plain, want = run("never", contextlib.nullcontext)
    kept, got = run("respect", outer)
    assert_grads_close(got, want, rtol=1e-12)
    copied = x.nbytes if hooks == "counting" else 0  # its copy of the first block's input, made before
    assert kept <= bare + copied + 64 * 1024 < plain / 4, (kept, bare, plain)
    if hooks == "counting":  # each block's node saves its input, through the caller's hooks
        assert counting.packed >= 4 and counting.unpacked == counting.packed


@pytest.mark.parametrize("hooks", ["save_on_cpu", "counting"])
def test_checkpoint_steps_keeps_checkpointing_under_the_callers_hooks(single_thread, hooks) -> None:
    """F5-TTS tiny, 8 steps: under the caller's hooks ``checkpoint_steps`` keeps what it keeps without
    them (each evaluation's inputs, through the caller's hooks), not most evaluations' graphs."""
    pytest.importorskip("f5_tts")
    model, (cond, text) = f5_cfm().eval(), f5_inputs()
    params = [p for p in model.parameters() if p.requires_grad]
    counting = Counting()
    outer = torch.autograd.graph.save_on_cpu if hooks == "save_on_cpu" else counting

    def run(option, context) -> tuple[int, list]:
        model.zero_grad(set_to_none=True)
        with context():
            kept, out = _kept(lambda: model.sample(cond, text, duration=60, steps=8, cfg_strength=2.0, seed=0,
                                                   cache=False, checkpoint_steps=option)[0])
        out.square().mean().backward()
        return kept, [None if p.grad is None else p.grad.clone() for p in params]

    with gradpatch.applied("f5_tts"):
        run(False, contextlib.nullcontext)  # warm-up: first-use allocations
        bare, _ = run(True, contextlib.nullcontext)
        plain, want = run(False, contextlib.nullcontext)
        kept, got = run(True, outer)
        through, through_unpacked = counting.packed, counting.unpacked
        # differentiable(cache=False) without checkpoint_steps: every saved tensor through the hooks
        _, plain_got = run(False, outer)
    print(f"kept after the forward: checkpoint_steps {bare}, under {hooks} {kept}, plain {plain}")
    assert_grads_close(got, want, rtol=1e-5)
    assert_grads_close(plain_got, want, rtol=1e-5)
    assert kept <= bare + 64 * 1024 and kept < plain / 4, (kept, bare, plain)
    if hooks == "counting":
        assert 8 <= through and 0 < through_unpacked <= through  # the evaluations' inputs, the update's math
        assert counting.packed - through > 10 * through  # the plain call saves far more, through them too
