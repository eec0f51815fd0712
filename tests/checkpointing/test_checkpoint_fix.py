"""Unit properties of gradpatch.checkpointing.checkpoint on small torch modules.

Every property is checked against the same computation without any checkpoint (the reference), at
rtol=1e-5: the gradient of every parameter that should get one, and ``None`` for frozen ones. Both
implementation paths are exercised on purpose: the fast path (``Recompute``) for everything a
caller declares, the graph path (non-reentrant torch checkpoint) for undeclared tensors, non-leaf
parameters and unusual outputs; ``paths`` counts which one ran.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from gradpatch import settings
import gradpatch.checkpointing.paths
from gradpatch.checkpointing import compat, recompute
from gradpatch.checkpointing import checkpoint as ck

torch.set_num_threads(1)
TOL = dict(rtol=1e-5, atol=1e-6)


class Block(nn.Module):
    """A transformer-ish block calling the checkpoint the way upstream does."""

    def __init__(self, dim: int = 8, dropout: float = 0.0, flag: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.ctx_proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)
        self.flag = flag
        self.impl: Callable = ck.checkpoint

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        return self.impl(self._forward, (x, context), self.parameters(), self.flag)

    def _forward(self, x: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        h = self.fc2(self.drop(F.gelu(self.fc1(self.norm(x)))))
        if context is not None:
            h = h + self.ctx_proj(context).mean(1, keepdim=True)
        return x + h


def no_checkpoint(func, inputs, params=(), flag=True):
    return func(*inputs)


def make(seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), Block(**kw), Block(**kw))


def set_impl(model: nn.Module, impl: Callable) -> None:
    for m in model.modules():
        if isinstance(m, Block):
            m.impl = impl


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{name} should get no gradient"
        else:
            assert got[name] is not None, f"{name} got no gradient"
            assert_close(got[name], want[name], **TOL, msg=lambda m: f"{name}: {m}")


def run(model: nn.Module, impl: Callable, x: torch.Tensor, context=None, seed: int = 1) -> dict:
    set_impl(model, impl)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    h = model[0](x)
    model[2](model[1](h, context), context).square().mean().backward()
    return grads(model)


@pytest.fixture
def paths(monkeypatch):
    """Count calls of each implementation path."""
    counts = {"fast": 0, "graph": 0}
    fast_apply, graph = recompute.Recompute.apply, gradpatch.checkpointing.paths.graph_path

    def counting_fast(*a):
        counts["fast"] += 1
        return fast_apply(*a)

    def counting_graph(*a):
        counts["graph"] += 1
        return graph(*a)

    monkeypatch.setattr(recompute.Recompute, "apply", counting_fast)
    monkeypatch.setattr(gradpatch.checkpointing.paths, "graph_path", counting_graph)
    return counts


FREEZE = {
    "all-trainable": lambda n: False,
    "layernorm": lambda n: ".norm." in n,
    "first-linear": lambda n: n.startswith("1.fc1"),
    "all-but-one": lambda n: not n.startswith("2.fc2.weight"),
    "block-1": lambda n: n.startswith("1."),
}


@pytest.mark.parametrize("frozen", FREEZE)
def test_frozen_subsets_match_reference(frozen, paths):
    x = torch.randn(3, 4, 8)
    model = make()
    for n, p in model.named_parameters():
        p.requires_grad_(not FREEZE[frozen](n))
    want = run(model, no_checkpoint, x)
    assert_grads_equal(run(model, ck.checkpoint, x), want)
    # With everything before and in block 1 frozen, block 1 needs no graph node at all.
    assert paths == {"fast": 1 if frozen == "all-but-one" else 2, "graph": 0}


def test_upstream_v1_fails_where_fix_succeeds():
    pytest.importorskip("audioldm", reason="upstream is not in the lowest-torch environment")
    from audioldm.latent_diffusion.util import CheckpointFunction as V1Function
    from audioldm.latent_diffusion.util import checkpoint as v1_checkpoint

    if issubclass(V1Function, ck.CheckpointFunction):
        pytest.skip("gradpatch active in this process (GRADPATCH set): upstream already fixed")

    model = make()
    model[1].norm.requires_grad_(False)
    x = torch.randn(3, 4, 8)
    without_none = lambda f: lambda t: f(t, None)  # noqa: E731 (V1 also breaks on None inputs)
    with pytest.raises(RuntimeError, match="does not require grad"):
        run(model, lambda f, i, p, flag: v1_checkpoint(without_none(f), i[:1], p, flag), x)
    with pytest.raises(RuntimeError, match="does not require grad"):
        run(model, lambda f, i, p, flag: V1Function.apply(without_none(f), 1, i[0], *p), x)
    assert_grads_equal(run(model, ck.checkpoint, x), run(model, no_checkpoint, x))


def test_all_frozen_grad_wrt_input():
    model = make()
    model.requires_grad_(False)
    x = torch.randn(3, 4, 8, requires_grad=True)
    set_impl(model, ck.checkpoint)
    (gx,) = torch.autograd.grad(model(x).sum(), x)
    set_impl(model, no_checkpoint)
    (want,) = torch.autograd.grad(model(x).sum(), x)
    assert_close(gx, want, **TOL)


def test_whole_subnet_input_without_grad(paths):
    """Inputs need no grad, parameters do: torch's reentrant checkpoint returns no gradient here."""
    block = Block()
    x = torch.randn(3, 4, 8)
    out = ck.checkpoint(block._forward, (x, None), block.parameters())
    assert out.requires_grad
    out.sum().backward()
    got = grads(block)
    block.zero_grad(set_to_none=True)
    block._forward(x, None).sum().backward()
    assert_grads_equal(got, grads(block))
    assert paths["fast"] == 1


def test_none_integer_and_plain_inputs():
    block = Block()
    index = torch.tensor([2, 0, 1])  # integer tensor input, cannot require grad
    x = torch.randn(3, 4, 8, requires_grad=True)

    def func(x, none, index, scale):
        assert none is None and scale == 0.5
        return block._forward(x[index], None) * scale

    targets = [x, *block.parameters()]
    got = torch.autograd.grad(ck.checkpoint(func, (x, None, index, 0.5), block.parameters()).sum(),
                              targets, allow_unused=True)
    want = torch.autograd.grad(func(x, None, index, 0.5).sum(), targets, allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert_close(g, w, **TOL)


def test_output_requires_grad_follows_autograd_rules():
    block = Block()
    block.requires_grad_(False)
    x = torch.randn(2, 3, 8)
    assert not ck.checkpoint(block._forward, (x, None), block.parameters()).requires_grad
    x.requires_grad_()
    assert ck.checkpoint(block._forward, (x, None), block.parameters()).requires_grad
    out, count = ck.checkpoint(lambda t: (t * 2, t.argmax()), (x,))
    assert out.requires_grad and not count.requires_grad and count.dtype == torch.int64


def closure_model() -> tuple[nn.Module, nn.Parameter, torch.Tensor]:
    torch.manual_seed(0)
    block = Block(dropout=0.3)
    lora = nn.Parameter(torch.randn(8, 8) * 0.1)  # not a child of block: kohya-style LoRA
    block.fc2.register_forward_hook(lambda m, args, out: out + args[0][..., :8] @ lora)
    base = torch.randn(8, requires_grad=True)
    return block, lora, base


def test_closure_and_hook_parameters_get_gradients(paths):
    block, lora, base = closure_model()
    block.requires_grad_(False)  # everything the caller declares is frozen
    x = torch.randn(3, 4, 8)
    targets = [lora, base]
    results = []
    for seed in (5, 6, 7):  # later calls are served from the escape cache: no second probe
        for impl in (no_checkpoint, ck.checkpoint):
            shift = base * 2  # a non-leaf closure tensor

            def func(x):
                return block._forward(x + shift, None)

            torch.manual_seed(seed)
            results.append(torch.autograd.grad(impl(func, (x,), block.parameters()).sum(), targets))
        for g, w in zip(results[-1], results[-2]):
            assert_close(g, w, **TOL)
    assert paths == {"fast": 0, "graph": 3}
    calls = []
    block.fc1.register_forward_pre_hook(lambda m, a: calls.append(1))
    shift = base * 2
    ck.checkpoint(func, (x,), block.parameters()).sum().backward()
    assert len(calls) == 2  # forward + recompute, no probe


def test_declared_parameters_with_closure_parameter_in_a_module(paths):
    """Declared trainable parameters plus an undeclared one: all of them get reference gradients."""
    torch.manual_seed(0)
    model = make(dropout=0.2)
    lora = nn.Parameter(torch.randn(8, 8) * 0.1)
    model[1].fc1.register_forward_hook(lambda m, a, out: out + torch.cat([a[0] @ lora] * 2, -1))
    x = torch.randn(3, 4, 8)
    want = run(model, no_checkpoint, x)
    want_lora, lora.grad = lora.grad.clone(), None
    assert_grads_equal(run(model, ck.checkpoint, x), want)
    assert_close(lora.grad, want_lora, **TOL)
    # The hook's parameter is a leaf: the forward's graph names it, so both blocks take the fast path.
    assert paths == {"fast": 2, "graph": 0}


@pytest.mark.parametrize("frozen", ["all-trainable", "first-linear"])
def test_dropout_replays_rng(frozen):
    model = make(dropout=0.5)
    for n, p in model.named_parameters():
        p.requires_grad_(not FREEZE[frozen](n))
    x = torch.randn(3, 4, 8)
    want = run(model, no_checkpoint, x, seed=3)
    after_reference = torch.rand(4)
    got = run(model, ck.checkpoint, x, seed=3)
    assert_close(torch.rand(4), after_reference)  # the RNG stream is not perturbed by recompute
    assert_grads_equal(got, want)


def test_cpu_autocast_replayed():
    model = make()
    x = torch.randn(3, 4, 8)
    results = []
    for impl in (no_checkpoint, ck.checkpoint):
        set_impl(model, impl)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model[2](model[1](model[0](x)))
        out.float().square().mean().backward()  # backward outside autocast, as recommended
        results.append(grads(model))
    assert_grads_equal(results[1], results[0])


def test_cuda_autocast_state_replayed(monkeypatch):
    """No GPU here: CUDA autocast state is thread-local and can be set anyway; the recompute must
    see what the forward saw (upstream V2 replays only this one, V1 none)."""
    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    seen = []

    def func(x):
        seen.append((compat.autocast_enabled("cuda"), compat.autocast_dtype("cuda")))
        return x * 2

    x = torch.randn(3, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.float16):
        out = ck.checkpoint(func, (x,))
    out.sum().backward()
    assert seen == [(True, torch.float16)] * 2


@pytest.mark.parametrize("policy, flag, runs", [
    ("respect", True, 2), ("respect", False, 1), ("always", True, 2), ("always", False, 2),
    ("never", True, 1), ("never", False, 1)])
def test_policies_count_recomputations(policy, flag, runs):
    calls = []
    x = torch.randn(2, 8, requires_grad=True)
    lin = nn.Linear(8, 8)

    def func(t):
        calls.append(1)
        return lin(t)

    with settings.checkpoint_policy_scope(policy):
        ck.checkpoint(func, (x,), lin.parameters(), flag).sum().backward()
        assert len(calls) == runs
        calls.clear()
        # Upstream's checkpoint calls CheckpointFunction.apply only when its flag is set.
        ck.CheckpointFunction.apply(func, 1, x, *lin.parameters()).sum().backward()
        assert len(calls) == (1 if policy == "never" else 2)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_grad_disabled_calls_func_once(mode):
    block = Block()
    x = torch.randn(2, 3, 8)
    calls = []
    block.fc1.register_forward_pre_hook(lambda m, a: calls.append(1))
    with mode():
        out = ck.checkpoint(block._forward, (x, None), block.parameters())
    assert out.grad_fn is None and len(calls) == 1
    with torch.no_grad():
        assert torch.equal(out, block._forward(x, None))


def test_autograd_grad_and_backward_inputs():
    model = make()
    x = torch.randn(3, 4, 8)
    set_impl(model, no_checkpoint)
    p = model[1].fc1.weight
    (want,) = torch.autograd.grad(model(x).sum(), [p])
    set_impl(model, ck.checkpoint)
    (got,) = torch.autograd.grad(model(x).sum(), [p])
    assert_close(got, want, **TOL)
    model(x).sum().backward(inputs=[p])
    assert_close(p.grad, want, **TOL)
    assert all(q.grad is None for q in model.parameters() if q is not p)


def test_retain_graph_second_backward():
    model = make(dropout=0.3)
    x = torch.randn(3, 4, 8)
    want = run(model, no_checkpoint, x)
    set_impl(model, ck.checkpoint)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    assert_grads_equal(grads(model), {n: None if g is None else 2 * g for n, g in want.items()})


def test_parameter_hooks_run_once():
    """Upstream runs tensor hooks of parameters inside its inner autograd.grad and again outside."""
    model = make()
    x = torch.randn(3, 4, 8)
    calls = []
    model[1].fc1.weight.register_hook(lambda g: calls.append(1) or g * 0.5)
    want = run(model, no_checkpoint, x)
    assert len(calls) == 1
    assert_grads_equal(run(model, ck.checkpoint, x), want)
    assert len(calls) == 2


def double_backward(model: nn.Module, impl: Callable, x: torch.Tensor) -> dict:
    """Gradient penalty on the input gradient and on a parameter gradient (second order)."""
    set_impl(model, impl)
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    torch.manual_seed(1)
    loss = model(x).square().mean()
    gx, gw = torch.autograd.grad(loss, [x, model[1].fc1.weight], create_graph=True)
    (loss + gx.square().sum() + gw.square().sum()).backward()
    return grads(model)


@pytest.mark.parametrize("frozen", ["all-trainable", "layernorm"])
def test_double_backward_matches_reference(frozen, paths):
    model = make(dropout=0.2)
    for n, p in model.named_parameters():
        p.requires_grad_(not FREEZE[frozen](n))
    x = torch.randn(3, 4, 8)
    want = double_backward(model, no_checkpoint, x)
    assert_grads_equal(double_backward(model, ck.checkpoint, x), want)
    assert paths["graph"] == 0


def maml(model: nn.Module, impl: Callable, inner_lr: nn.Parameter) -> dict:
    """One MAML step with fast weights swapped into the modules (as in seeds/maml-*.txt)."""
    set_impl(model, impl)
    model.zero_grad(set_to_none=True)
    inner_lr.grad = None
    support, query = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1)), \
        torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(2))
    adapted = [m for m in model.modules() if isinstance(m, nn.Linear)]
    slow = {(m, n): p for m in adapted for n, p in m._parameters.items()}
    inner = model(support).square().mean()
    g = torch.autograd.grad(inner, list(slow.values()), create_graph=True, allow_unused=True)
    try:
        for (m, n), p, gp in zip(slow, slow.values(), g):
            if gp is not None:
                m._parameters[n] = p - F.softplus(inner_lr) * gp  # non-leaf fast weight
        model(query).square().mean().backward()
    finally:
        for (m, n), p in slow.items():
            m._parameters[n] = p
    return {**grads(model), "inner_lr": inner_lr.grad.clone()}


def test_maml_learnable_inner_lr(paths):
    model = make()
    lr = nn.Parameter(torch.tensor(0.1))
    want = maml(model, no_checkpoint, lr)
    assert_grads_equal(maml(model, ck.checkpoint, lr), want)
    # Inner step on the fast path; fast weights are non-leaf tensors: graph path, weights rebound.
    assert paths == {"fast": 2, "graph": 2}


def maml_functional(model: nn.Module, impl: Callable, log_lr: nn.Parameter) -> dict:
    """MAML with torch.func.functional_call: fast weights are in the modules only during forward."""
    set_impl(model, impl)
    model.zero_grad(set_to_none=True)
    log_lr.grad = None
    support, query = (torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(seed))
                      for seed in (1, 2))
    params = dict(model.named_parameters())
    inner = model(support).square().mean()
    g = torch.autograd.grad(inner, list(params.values()), create_graph=True, allow_unused=True)
    fast = {n: p - log_lr.exp() * gp for (n, p), gp in zip(params.items(), g) if gp is not None}
    torch.func.functional_call(model, fast, (query,)).square().mean().backward()
    return {**grads(model), "log_lr": log_lr.grad.clone()}


def test_maml_functional_call(paths):
    model = make()
    log_lr = nn.Parameter(torch.tensor(1.0))
    want = maml_functional(model, no_checkpoint, log_lr)
    got = maml_functional(model, ck.checkpoint, log_lr)
    assert_grads_equal(got, want)
    assert_close(got["log_lr"], want["log_lr"], rtol=1e-4, atol=0)
    # Recomputing with the slow weights functional_call put back would be off: the graph path
    # recomputes with the weights of the forward.
    assert paths == {"fast": 2, "graph": 2}


def test_mixed_checkpoint_dict_inputs():
    block = Block()
    x = torch.randn(2, 3, 8, requires_grad=True)
    ctx = torch.randn(2, 5, 8)

    def func(x, context, scale, name):
        assert name == "n"
        return block._forward(x, context) * scale

    inputs = dict(x=x, context=ctx, scale=2.0, name="n")
    got = torch.autograd.grad(ck.mixed_checkpoint(func, inputs, block.parameters(), True).sum(),
                              [x, *block.parameters()])
    want = torch.autograd.grad(func(**inputs).sum(), [x, *block.parameters()])
    for g, w in zip(got, want):
        assert_close(g, w, **TOL)
    assert torch.equal(ck.mixed_checkpoint(func, inputs, block.parameters(), False), func(**inputs))


def test_unusual_outputs_take_graph_path(paths):
    x = torch.randn(3, requires_grad=True)
    out = ck.checkpoint(lambda t: {"y": t.sin()}, (x,))
    (g,) = torch.autograd.grad(out["y"].sum(), x)
    assert_close(g, x.cos())
    assert paths == {"fast": 0, "graph": 1}


def test_nested_checkpoints():
    model = make()
    x = torch.randn(3, 4, 8)
    want = run(model, no_checkpoint, x)
    def in_ours(f, i, p, flag):
        return ck.checkpoint(lambda *a: ck.checkpoint(f, a, p, flag), i, p, flag)

    assert_grads_equal(run(model, in_ours, x), want)
    in_torch = lambda f, i, p, flag: torch.utils.checkpoint.checkpoint(  # noqa: E731
        lambda *a: ck.checkpoint(f, a, p, flag), *i, use_reentrant=False)
    assert_grads_equal(run(model, in_torch, x), want)


def test_input_modified_after_forward_is_detected():
    block = Block()
    x = torch.randn(2, 3, 8, requires_grad=True) * 1
    out = ck.checkpoint(block._forward, (x, None), block.parameters())
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_ddp_shared_block_used_twice(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(self.block(x))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Twice()
        x = torch.randn(3, 4, 8, requires_grad=True)
        model.block.impl = no_checkpoint
        model(x).square().mean().backward()
        want = grads(model)
        model.zero_grad(set_to_none=True)
        model.block.impl = ck.checkpoint
        ddp = DDP(model, find_unused_parameters=True)
        for _ in range(2):  # a second iteration fails if the reducer saw a parameter twice
            model.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
        assert_grads_equal(grads(model), want)
        # What the non_reentrant wrapper exists for: torch's reentrant checkpoint fails here.
        reentrant = Twice()
        reentrant.block.impl = lambda f, i, p, flag: torch.utils.checkpoint.checkpoint(
            f, *i, use_reentrant=True)
        ddp = DDP(reentrant, find_unused_parameters=True)
        with pytest.raises(RuntimeError, match="mark a variable ready only once"):
            for _ in range(2):
                ddp(x).square().mean().backward()
    finally:
        dist.destroy_process_group()


def test_non_reentrant_wrapper():
    seen = []

    def fake_torch_checkpoint(function, *args, use_reentrant=None, **kwargs):
        """doc"""
        seen.append(use_reentrant)
        return function(*args, **kwargs)

    wrapped = ck.non_reentrant(fake_torch_checkpoint)
    assert wrapped.__wrapped__ is fake_torch_checkpoint and wrapped.__doc__ == "doc"
    wrapped(lambda t: t, torch.ones(1))
    wrapped(lambda t: t, torch.ones(1), use_reentrant=True)
    wrapped(lambda t: t, torch.ones(1), use_reentrant=None)
    assert seen == [False, True, False]
    # The real one, in the whole-subnet case reentrant checkpoint gets wrong (no gradient at all).
    real = ck.replace_torch_checkpoint(torch.utils.checkpoint.checkpoint)
    lin = nn.Linear(3, 3)
    real(lin, torch.randn(2, 3)).sum().backward()
    assert lin.weight.grad is not None


def test_factories_and_stale_upstream_reference(monkeypatch):
    import inspect

    util = pytest.importorskip("audioldm.latent_diffusion.util")

    # The engine reverts by identity: every call must build an object of its own.
    made = [ck.replace_checkpoint(util.checkpoint), ck.replace_checkpoint(util.checkpoint),
            ck.replace_checkpoint_function(util.CheckpointFunction),
            ck.replace_checkpoint_function(util.CheckpointFunction),
            ck.replace_mixed_checkpoint(None), ck.replace_mixed_checkpoint(None),
            ck.replace_torch_checkpoint(torch.utils.checkpoint.checkpoint),
            ck.replace_torch_checkpoint(torch.utils.checkpoint.checkpoint)]
    assert len({id(m) for m in made}) == len(made)
    assert inspect.signature(made[0]) == inspect.signature(ck.checkpoint)
    assert made[0].__doc__ == ck.checkpoint.__doc__ and issubclass(made[2], ck.CheckpointFunction)
    # A module still holding upstream's checkpoint function is fixed through the class lookup.
    monkeypatch.setattr(util, "CheckpointFunction", made[2])
    model = make()
    model[1].norm.requires_grad_(False)
    x = torch.randn(3, 4, 8)
    want = run(model, no_checkpoint, x)
    upstream_checkpoint = util.checkpoint
    assert_grads_equal(run(model, lambda *a: upstream_checkpoint(*a), x), want)
    assert_grads_equal(run(model, made[0], x), want)
    inputs = dict(x=torch.randn(2, 8, requires_grad=True))
    assert torch.equal(made[4](lambda x: x * 2, inputs, (), True), inputs["x"] * 2)


def test_declared_parameters_are_not_trusted(paths):
    """What ``params`` declares is not used: a stale, empty or wrong list changes nothing, and each
    call runs ``func`` exactly twice (forward, recompute)."""
    model = make()
    x = torch.randn(3, 4, 8)
    assert_grads_equal(run(model, ck.checkpoint, x), run(model, no_checkpoint, x))
    torch.manual_seed(3)
    old_fc1 = model[1].fc1
    model[1].fc1 = nn.Linear(8, 16)
    old_fc1.zero_grad(set_to_none=True)
    want = run(model, no_checkpoint, x)
    calls = []
    model[1].fc2.register_forward_pre_hook(lambda m, a: calls.append(1))
    for declared in (lambda b: old_fc1.parameters(), lambda b: (), lambda b: b.parameters()):
        calls.clear()
        assert_grads_equal(run(model, lambda f, i, p, flag: ck.checkpoint(f, i, declared(f.__self__), flag), x),
                           want)
        assert len(calls) == 2
    assert old_fc1.weight.grad is None
    model[2].fc2.requires_grad_(False)  # frozen after a call
    model[2].norm.weight.requires_grad_(True)
    want = run(model, no_checkpoint, x)
    assert_grads_equal(run(model, ck.checkpoint, x), want)
    assert paths == {"fast": 10, "graph": 0}
