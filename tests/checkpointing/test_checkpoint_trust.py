"""The fixed checkpoint computes what the block computes without checkpointing, as autograd would.

Each case is checked against no checkpoint (the reference, rtol 1e-5) and against torch's
non-reentrant checkpoint, which agrees with it; upstream V1 (AudioLDM's ``CheckpointFunction``) is
shown where it does not. Covered: blocks whose forward depends on ``requires_grad`` flags or on
grad mode (an earlier fast path cleared parameter flags and detached inputs while ``func`` first ran,
so such blocks computed another forward than their recompute); outputs' ``requires_grad``; outputs
that are views of inputs and are modified in place; memory held for replaced parameters; pickling
the patched objects.
"""
from __future__ import annotations

import functools
import gc
import os
import pickle
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from support import ROOT, last_json
from gradpatch.checkpointing import compat
from gradpatch.checkpointing import checkpoint as ck

torch.set_num_threads(1)
TOL = dict(rtol=1e-5, atol=1e-7)


class Branching(nn.Module):
    """A block whose forward depends on what autograd state it observes, as attention and LoRA
    code does (``if self.lora.weight.requires_grad``, ``if x.requires_grad``, ...)."""

    def __init__(self, on: str) -> None:
        super().__init__()
        self.on = on
        self.base = nn.Linear(8, 8)
        self.lora = nn.Linear(8, 8, bias=False)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x)
        if self.on == "param.requires_grad" and self.lora.weight.requires_grad:
            h = h + self.lora(x)
        elif self.on == "x.requires_grad" and x.requires_grad:
            h = h * 2 + self.lora(x)
        elif self.on == "grad mode" and torch.is_grad_enabled():
            h = h.tanh() + self.lora(x)
        elif self.on == "intermediate.requires_grad" and h.requires_grad:
            h = h.sin() + self.lora(h)
        return h


BRANCHES = ["param.requires_grad", "x.requires_grad", "grad mode", "intermediate.requires_grad"]


def v1(func, x, params):
    """Upstream V1, AudioLDM's copy (absent from the lowest-torch environment: skipped there)."""
    util = pytest.importorskip("audioldm.latent_diffusion.util")
    if issubclass(util.CheckpointFunction, ck.CheckpointFunction):
        pytest.skip("gradpatch active in this process (GRADPATCH set): upstream already fixed")
    return util.CheckpointFunction.apply(func, 1, x, *params)


IMPLS = {
    "none": lambda block, x: block.body(x),
    "fixed": lambda block, x: ck.checkpoint(block.body, (x,), block.parameters(), True),
    "torch": lambda block, x: torch_checkpoint(block.body, x, use_reentrant=False),
    "V1": lambda block, x: v1(block.body, x, list(block.parameters())),
}


def output_and_grads(impl: str, branch: str, frozen_base: bool):
    torch.manual_seed(0)
    block = Branching(branch)
    block.base.requires_grad_(not frozen_base)
    a = torch.randn(4, 8, requires_grad=True)
    x = a * 1.5 if branch != "param.requires_grad" else a.detach()  # requires grad or not
    out = IMPLS[impl](block, x)
    out.square().sum().backward()
    grads = [t.grad for t in (a, *block.parameters())]
    return out.detach(), grads


@pytest.mark.parametrize("frozen_base", [False, True], ids=["base-trainable", "base-frozen"])
@pytest.mark.parametrize("branch", BRANCHES)
def test_block_branching_on_autograd_state_equals_reference(branch, frozen_base):
    want_out, want = output_and_grads("none", branch, frozen_base)
    for impl in ("fixed", "torch"):
        out, got = output_and_grads(impl, branch, frozen_base)
        assert_close(out, want_out, **TOL)
        assert [g is None for g in got] == [g is None for g in want], impl
        for g, w in zip(got, want):
            if w is not None:
                assert_close(g, w, **TOL)


def test_upstream_v1_sees_another_grad_mode_in_forward_than_in_recompute():
    """What the fix must not do: V1 runs the forward under no_grad, its recompute with grad."""
    want_out, want = output_and_grads("none", "grad mode", False)
    out, got = output_and_grads("V1", "grad mode", False)
    assert (out - want_out).abs().max() > 0.05
    assert not torch.allclose(got[1], want[1], rtol=1e-3)


def test_fast_path_changes_no_flag_the_block_can_observe():
    seen = []
    block = Branching("none")
    block.base.weight.requires_grad_(False)

    def func(x):
        seen.append((x.requires_grad, block.base.weight.requires_grad, block.lora.weight.requires_grad,
                     torch.is_grad_enabled(), block.base(x).requires_grad))
        return block.lora(block.base(x))

    x = torch.randn(2, 8, requires_grad=True) * 1
    ck.checkpoint(func, (x,), block.parameters()).sum().backward()
    assert seen == [(True, False, True, True, True)] * 2  # forward, recompute


# --- outputs' requires_grad follows autograd's rules -----------------------------------------------

def test_output_depending_on_nothing_that_requires_grad_does_not_require_grad():
    block = Branching("none")
    x = torch.randn(2, 8)  # requires no grad
    out, plain = ck.checkpoint(lambda t: (block.base(t), t * 2), (x,), block.parameters())
    assert out.requires_grad and not plain.requires_grad
    ref_out, ref_plain = torch_checkpoint(lambda t: (block.base(t), t * 2), x, use_reentrant=False)
    assert ref_out.requires_grad and not ref_plain.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        plain.sum().backward()
    block.requires_grad_(False)
    out = ck.checkpoint(block.base, (x,), block.parameters())
    assert not out.requires_grad and out.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


def test_upstream_v1_marks_every_output_as_requiring_grad():
    block = Branching("none")
    x = torch.randn(2, 8)
    out, plain = v1(lambda t: (block.base(t), t * 2), x, list(block.parameters()))
    assert plain.requires_grad  # what autograd would not do; the fix does not either (above)


# --- outputs that are inputs or views of them, modified in place -----------------------------------

ALIASING = {
    "view of input": lambda lin: lambda x: x[1:],
    "input as is": lambda lin: lambda x: (x, lin.weight * 2),
    "view and computed": lambda lin: lambda x: (x.view(-1), (x + lin.bias).tanh()),
    "views of each other": lambda lin: lambda x: (lambda h: (h, h[0]))(lin(x) * 2),
}


def in_place_after(impl: str, case: str):
    """Gradients after the caller modifies the first output in place, or the error raised."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    a = torch.randn(3, 4, requires_grad=True)
    x = a * 2
    func = ALIASING[case](lin)
    try:
        out = {"none": lambda: func(x),
               "fixed": lambda: ck.checkpoint(func, (x,), lin.parameters()),
               "torch": lambda: torch_checkpoint(func, x, use_reentrant=False),
               "V1": lambda: v1(func, x, list(lin.parameters()))}[impl]()
        outs = out if isinstance(out, tuple) else (out,)
        outs[0].mul_(3)
        (sum(o.square().sum() for o in outs) + x.sum()).backward()
    except RuntimeError as exc:
        return str(exc).split(":")[0]
    return [a.grad, lin.weight.grad, lin.bias.grad]


@pytest.mark.parametrize("case", ALIASING)
def test_output_aliasing_input_modified_in_place(case):
    """As with torch's non-reentrant checkpoint: the same gradients as without checkpointing, or,
    where the recompute would need the input's value from before the change, torch's error."""
    reference, got = in_place_after("torch", case), in_place_after("fixed", case)
    if isinstance(reference, str):
        assert got == reference == "one of the variables needed for gradient computation has " \
                                   "been modified by an inplace operation"
        return
    want = in_place_after("none", case)
    for result in (reference, got):
        assert [g is None for g in result] == [g is None for g in want]
        for g, w in zip(result, want):
            if w is not None:
                assert_close(g, w, **TOL)


def test_upstream_v1_refuses_in_place_on_a_view_of_an_input():
    v1(lambda t: t, torch.ones(1), [])  # skips where upstream cannot be had
    assert "is a view and is being modified inplace" in in_place_after("V1", "view of input")


def test_in_place_on_a_view_of_a_parameter_raises_as_without_checkpoint():
    lin = nn.Linear(4, 4)
    for run in (lambda f: f(), lambda f: ck.checkpoint(f, (), lin.parameters())):
        with pytest.raises(RuntimeError, match="view of a leaf Variable"):
            run(lambda: lin.weight.t()).add_(1)


# --- memory and pickling ---------------------------------------------------------------------------

def test_replaced_parameters_and_modules_are_not_kept_alive():
    block = Branching("none")
    x = torch.randn(2, 8, requires_grad=True)
    ck.checkpoint(block.body, (x,), block.parameters()).sum().backward()
    old = weakref.ref(block.base.weight)
    block.base = nn.Linear(8, 8)  # nothing of gradpatch's may hold the old layer's parameters
    gc.collect()
    assert old() is None
    ck.checkpoint(block.body, (x,), block.parameters()).sum().backward()
    shift = torch.randn(8, requires_grad=True) * 2  # a non-leaf the block reads undeclared:
    block.body = lambda t: block.base(t) + shift  # the graph path, remembered per code object  # noqa: F821 (read by the lambda, deleted below on purpose)
    ck.checkpoint(block.body, (x,), block.parameters()).sum().backward()
    gone = weakref.ref(block)
    del block
    gc.collect()
    assert gone() is None


def test_non_reentrant_wrapper_pickles():
    wrapper = ck.replace_torch_checkpoint(torch.utils.checkpoint.checkpoint)
    back = pickle.loads(pickle.dumps(functools.partial(wrapper, use_reentrant=None)))
    lin = nn.Linear(3, 3)
    back(lin, torch.randn(2, 3)).sum().backward()  # no input requires grad: non-reentrant needed
    assert lin.weight.grad is not None


PICKLE_SCRIPT = """
import functools, json, pickle, sys
import torch
import gradpatch
import audioldm.latent_diffusion.util as util
import audioldm.latent_diffusion.attention as attention

class Holder:
    def __init__(self, fn):
        self.fn = fn

objects = [util.checkpoint, functools.partial(util.checkpoint, flag=True), Holder(util.checkpoint),
           util.CheckpointFunction, attention.checkpoint]
if sys.argv[1:] == ["dump"]:
    sys.stdout.buffer.write(pickle.dumps(objects))
    sys.exit()
with open(sys.argv[1], "rb") as f:
    loaded = pickle.load(f)  # pickled by another interpreter, as for a spawn worker
fn, part, holder, cls, bound = loaded
ok = [fn is util.checkpoint, part.func is util.checkpoint, holder.fn is util.checkpoint,
      cls is util.CheckpointFunction, bound is attention.checkpoint,
      "gradpatch" in util.checkpoint.__code__.co_filename]
lin = torch.nn.Linear(3, 3).requires_grad_(False)
lin.bias.requires_grad_(True)  # a frozen weight: upstream's V1 raises here
x = torch.randn(2, 3)
fn(lin, (x,), lin.parameters(), True).sum().backward()
ok.append(lin.bias.grad is not None)
round_trip = pickle.loads(pickle.dumps(objects))
ok.append(round_trip[0] is util.checkpoint and round_trip[3] is util.CheckpointFunction)
gradpatch.revert()
ok.append(pickle.loads(pickle.dumps(util.checkpoint)) is util.checkpoint)
ok.append("gradpatch" not in util.checkpoint.__code__.co_filename)
print(json.dumps(ok))
"""


@pytest.mark.slow
def test_patched_objects_pickle_under_gradpatch_1(tmp_path):
    """Pickled in one interpreter, loaded in another (as for spawn workers), both with GRADPATCH=1;
    upstream's objects pickle by reference, the replacements must too, and revert() restores."""
    pytest.importorskip("audioldm")
    script = tmp_path / "pickling.py"
    script.write_text(PICKLE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    env.update(GRADPATCH="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    dumped = subprocess.run([sys.executable, str(script), "dump"], env=env, capture_output=True,
                            timeout=300)
    assert dumped.returncode == 0, dumped.stderr.decode()[-3000:]
    (tmp_path / "objects.pkl").write_bytes(dumped.stdout)
    loaded = subprocess.run([sys.executable, str(script), str(tmp_path / "objects.pkl")], env=env,
                            capture_output=True, text=True, timeout=300)
    ok = last_json(loaded)
    assert ok == [True] * 10, ok


# --- the torch range pyproject.toml declares ---------------------------------------------------------

def test_compat_matches_torch():
    assert compat.sequence_nr() <= (torch.ones(1, requires_grad=True) * 2).grad_fn._sequence_nr()
    assert not compat.autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compat.autocast_enabled("cpu") and compat.autocast_dtype("cpu") == torch.bfloat16
    assert compat.is_compiling() is False
    assert torch.compile(lambda t: t + int(compat.is_compiling()), backend="eager")(torch.zeros(1)).item() == 1


class Caching(nn.Module):
    """A block that fills a cache from a parameter in its first forward (a positional table), so its
    recompute in backward reads the cache instead: differentiating that recompute gives the parameter
    no gradient, silently."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.freq = nn.Linear(8, 8), nn.Parameter(torch.randn(8))
        self.table = None

    def body(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = self.freq.cos()
        return self.lin(x) * self.table


def test_a_block_whose_recompute_runs_differently_raises_as_torch_does():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    block = Caching()
    block.body(x).square().sum().backward()  # without checkpoint: freq gets its gradient
    assert block.freq.grad is not None and block.freq.grad.abs().sum() > 0
    from torch.utils.checkpoint import CheckpointError

    block = Caching()
    with pytest.raises(CheckpointError):  # torch: another number of saved tensors
        torch_checkpoint(block.body, x, use_reentrant=False).square().sum().backward()
    block = Caching()
    out = ck.checkpoint(block.body, (x,), block.parameters(), True)
    with pytest.raises(RuntimeError, match=r"checkpoint: a checkpointed block \(Caching.body\) built another "
                                           r"graph.*4 autograd nodes then, 3 now.*checkpoint_policy_scope"):
        out.square().sum().backward()
    block = Caching()
    v1(block.body, x, list(block.parameters())).square().sum().backward()
    assert block.freq.grad is None  # upstream V1: no error, and no gradient where one is due
