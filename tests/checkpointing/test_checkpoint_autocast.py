"""The fixed checkpoint under autocast and on CUDA, policies ``respect`` and ``budget``, against the
same AudioLDM UNet without any checkpoint.

On CPU: upstream V1 cannot run the UNet under bf16 autocast at all (its recompute runs outside
autocast), while the fix matches no checkpointing. Tests marked ``cuda`` (skipped without a GPU):
dropout replaying the CUDA RNG, fp16/bf16 autocast with ``GradScaler``, and DataParallel replicas.
They run with deterministic kernels and without TF32, so that the checkpointed and the plain model
compute the same sums in the same order; low-precision gradients are compared at rtol 1e-3 with a
floor of 1e-3 of the largest gradient.
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import gradpatch
from gradpatch.checkpointing import budget, paths
from checkpoint_models import TARGETS, assert_grads_equal, build, freeze, install

AUDIOLDM = TARGETS["audioldm"]
POLICIES = ["respect", "budget"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def grads(model: torch.nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.detach().float().clone()
            for n, p in model.named_parameters()}


def assert_close_scaled(got: dict, want: dict, rtol: float = 1e-3) -> None:
    """Each gradient to rtol, with an absolute floor of rtol times the largest gradient."""
    floor = rtol * max(w.abs().max().item() for w in want.values() if w is not None)
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert (got[name] is None) == (w is None), name
        if w is not None:
            assert_close(got[name], w, rtol=rtol, atol=floor, msg=lambda m: f"{name}: {m}")


def run_policy(policy: str, model: torch.nn.Module, one_step, want: dict, compare) -> None:
    """Compare every step of ``policy`` with ``want``: for ``budget``, the measuring steps and a
    planned one that keeps about half of the blocks."""
    budget.reset()
    if policy == "respect":
        with gradpatch.checkpoint_policy_scope("respect"):
            compare(one_step(model), want)
        return
    with gradpatch.checkpoint_policy_scope("budget:100GB"):
        for _ in range(budget.TIMING_CALLS):
            compare(one_step(model), want)
    half = sum(e.bytes for e in budget.checkpoint_plan()) // 2
    with gradpatch.checkpoint_policy_scope(f"budget:{half}"):
        compare(one_step(model), want)
        plan = budget.checkpoint_plan()
    assert plan.complete and 0 < sum(not e.recomputed for e in plan) < len(plan), plan
    budget.reset()


def cpu_autocast_step(model: torch.nn.Module) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = AUDIOLDM.call(model, torch.randn(2, 4, 16, 16))
    out.float().square().mean().backward()
    return grads(model)


@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_bf16_autocast_upstream_fails_fix_matches(policy, monkeypatch):
    torch.manual_seed(0)
    model = build(AUDIOLDM, dropout=0.1).train()
    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "none")
        want = cpu_autocast_step(model)
    with pytest.raises(RuntimeError, match="should be the same"):
        cpu_autocast_step(model)  # upstream V1
    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "fixed")
        run_policy(policy, model, cpu_autocast_step, want, assert_close_scaled)


@pytest.fixture
def deterministic_cuda():
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
             torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.use_deterministic_algorithms(saved[0])
    (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
     torch.backends.cuda.matmul.allow_tf32) = saved[1:]


def cuda_model(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return build(AUDIOLDM, dropout=dropout).cuda().train()


def cuda_call(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3)).cuda()
    t = torch.tensor([3, 500], device="cuda")
    y = torch.randn(2, 16, generator=torch.Generator().manual_seed(7)).cuda()
    return model(x, t, y=y)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_dropout_replays_the_cuda_rng(policy, monkeypatch, deterministic_cuda):
    model = cuda_model(dropout=0.3)

    def one_step(model: torch.nn.Module) -> dict:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # seeds the CUDA generator too
        cuda_call(model).square().mean().backward()
        return grads(model)

    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "none")
        want = one_step(model)
    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "fixed")
        run_policy(policy, model, one_step, want, assert_grads_equal)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_autocast_with_grad_scaler(policy, dtype, monkeypatch, deterministic_cuda):
    model = cuda_model(dropout=0.1)

    def one_step(model: torch.nn.Module) -> dict:
        model.zero_grad(set_to_none=True)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=dtype):
            out = cuda_call(model)
        scaler.scale(out.float().square().mean()).backward()
        scaler.unscale_(optimizer)  # the gradients themselves, as the optimiser would see them
        found = grads(model)
        assert all(torch.isfinite(g).all() for g in found.values() if g is not None)
        return found

    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "none")
        want = one_step(model)
    assert any(g is not None and g.abs().max() > 0 for g in want.values())
    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "fixed")
        run_policy(policy, model, one_step, want, assert_close_scaled)


@cuda
@pytest.mark.cuda
def test_cuda_data_parallel_replicas_frozen_subset(monkeypatch, deterministic_cuda):
    """DataParallel replicas hold parameters broadcast in the caller's thread and run in worker
    threads: the fix sends their calls to torch's checkpoint. Only cross-attention trains, so
    upstream V1 raises on the frozen replica parameters; the fix matches no checkpointing. On one
    GPU the replicas share it (``device_ids=[0, 0]``)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.device_count() > 1 else [0, 0]
    model = cuda_model(dropout=0.0)
    freeze(model, AUDIOLDM, "cross-attention-only")
    parallel = torch.nn.DataParallel(model, device_ids=devices)
    replicas_routed = []
    graph_path = paths.graph_path

    def counting_graph_path(func, args, kwargs):
        owner = getattr(func, "__self__", None)
        replicas_routed.append(owner is not None and owner.__dict__.get("_is_replica", False))
        return graph_path(func, args, kwargs)

    def one_step(model: torch.nn.Module) -> dict:
        model.zero_grad(set_to_none=True)
        x = torch.randn(4, 4, 16, 16, generator=torch.Generator().manual_seed(3)).cuda()
        t = torch.tensor([3, 500, 20, 900], device="cuda")
        y = torch.randn(4, 16, generator=torch.Generator().manual_seed(7)).cuda()
        parallel(x, t, y=y).square().mean().backward()
        return grads(model)

    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "none")
        want = one_step(model)
    assert sum(g is not None for g in want.values()) > 0
    with pytest.raises(RuntimeError, match="does not require grad"):
        one_step(model)  # upstream V1
    with monkeypatch.context() as mp:
        install(mp, AUDIOLDM, "fixed")
        mp.setattr(paths, "graph_path", counting_graph_path)
        assert_close_scaled(one_step(model), want, rtol=1e-5)
    assert replicas_routed and all(replicas_routed), replicas_routed
