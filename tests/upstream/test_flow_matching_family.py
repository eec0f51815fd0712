"""The flow-matching family (``patches/_families.py``: Matcha -> CosyVoice -> Chatterbox -> Seed-VC /
IndexTTS2, and VoxCPM's ``UnifiedCFM``) against the real packages: matcha-tts 0.0.7.2, chatterbox-tts
0.1.7 (its S3Gen decoder and its vendored Matcha copy), seed-vc 0.4.3 (v1 and v2), indextts2-inference
2.1.1 and voxcpm 2.0.3; CosyVoice (GitHub only) through a replica of its solver's shape.

Tiny random models (:mod:`gradpatch.testing_flow`), no downloads. Every case shows upstream failing
(no graph: the entry is ``@torch.inference_mode()``; Chatterbox's and CosyVoice's bodies, unwrapped,
fail in backward because the CFG buffers are refilled in place) and compares ``cache=False`` gradients,
over every parameter and every differentiable input, with upstream's loop copied here by hand with its
blockers removed (no decorator, the CFG batch built with ``torch.cat``, prompt zeroing out of place).
``grad_steps=K`` is compared with that reference detaching the latent entering step N-K (DRaFT-K);
``checkpoint_steps=True`` with the plain reference. Marked ``upstream_wave``
(``pytest -m upstream_wave``).
"""
from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import gradpatch  # noqa: E402
from support import run_python, upstream_method  # noqa: E402
from gradpatch import testing_flow  # noqa: E402

pytestmark = [pytest.mark.upstream_wave, pytest.mark.usefixtures("single_thread")]
N = 3  # Euler steps


# Upstream's solvers, copied by hand with their blockers removed; `first`: the step whose entering
# latent is detached (0: the plain run).

def matcha_reference(model: Any, first: int, mu: Any, mask: Any, spks: Any = None, cond: Any = None) -> Any:
    x = torch.randn_like(mu)
    t_span = torch.linspace(0, 1, N + 1)
    t, dt = t_span[0], t_span[1] - t_span[0]
    for step in range(1, N + 1):
        x = x.detach() if step - 1 == first else x
        x = x + dt * model.estimator(x, mask, mu, t, spks, cond)
        t = t + dt
        if step < N:
            dt = t_span[step + 1] - t
    return x


def chatterbox_reference(model: Any, first: int, mu: Any, mask: Any, spks: Any, cond: Any) -> Any:
    x, rate, zero = torch.randn_like(mu), model.inference_cfg_rate, torch.zeros_like
    t_span = 1 - torch.cos(torch.linspace(0, 1, N + 1) * 0.5 * torch.pi)
    for step, (t, r) in enumerate(zip(t_span[:-1], t_span[1:])):
        x = x.detach() if step == first else x
        t, r = t[None], r[None]
        out = model.estimator.forward(x=torch.cat([x, x]), mask=torch.cat([mask, mask]), mu=torch.cat([mu, zero(mu)]),
                                      t=torch.cat([t, t]), spks=torch.cat([spks, zero(spks)]),
                                      cond=torch.cat([cond, zero(cond)]), r=None)
        v, v_uncond = out.chunk(2)
        x = x + (r - t) * ((1 + rate) * v - rate * v_uncond)
    return x


def seed_vc_reference(model: Any, first: int, mu: Any, x_lens: Any, prompt: Any, style: Any, f0: Any,
                      rate: float = 0.5) -> Any:
    x = torch.randn([mu.size(0), model.in_channels, mu.size(1)])
    t_span = torch.linspace(0, 1, N + 1)
    t, n = t_span[0], prompt.size(-1)
    prompt_x = torch.cat([prompt, torch.zeros_like(x[..., n:])], -1)
    x = torch.cat([torch.zeros_like(x[..., :n]), x[..., n:]], -1)
    for step in range(1, N + 1):
        x = x.detach() if step - 1 == first else x
        dt = t_span[step] - t_span[step - 1]
        out = model.estimator(torch.cat([x, x]), torch.cat([prompt_x, torch.zeros_like(prompt_x)]), x_lens,
                              torch.cat([t[None], t[None]]), torch.cat([style, torch.zeros_like(style)]),
                              torch.cat([mu, torch.zeros_like(mu)]))
        v, v_uncond = out.chunk(2)
        x = x + dt * ((1 + rate) * v - rate * v_uncond)
        t = t + dt
        x = torch.cat([torch.zeros_like(x[..., :n]), x[..., n:]], -1)
    return x


def seed_vc_v2_reference(model: Any, first: int, mu: Any, x_lens: Any, prompt: Any, style: Any,
                         rates: tuple[float, float] = (0.5, 0.5)) -> Any:
    x, zero = torch.randn([mu.size(0), model.in_channels, mu.size(1)]), torch.zeros_like
    t_span = torch.linspace(0, 1, N + 1)
    t_span = t_span + (-1) * (torch.cos(torch.pi / 2 * t_span) - 1 + t_span)
    t, dt, n = t_span[0], t_span[1] - t_span[0], prompt.size(-1)
    prompt_x = torch.cat([prompt, zero(x[..., n:])], -1)
    x = torch.cat([zero(x[..., :n]), x[..., n:]], -1)
    for step in range(1, N + 1):
        x = x.detach() if step - 1 == first else x
        out = model.estimator(torch.cat([x, x, x]), torch.cat([prompt_x, zero(prompt_x), zero(prompt_x)]),
                              torch.cat([x_lens] * 3), torch.cat([t[None]] * 3), torch.cat([style, zero(style), zero(style)]),
                              torch.cat([mu, mu, zero(mu)]))
        v_full, v_text, v_uncond = out[0:1], out[1:2], out[2:3]
        x = x + dt * ((1 + rates[0] + rates[1]) * v_full - rates[0] * v_uncond - rates[1] * v_text)
        t = t + dt
        if step < N:
            dt = t_span[step + 1] - t
        x = torch.cat([zero(x[..., :n]), x[..., n:]], -1)
    return x


def voxcpm_reference(model: Any, first: int, mu: Any, patch_size: int, cond: Any, zero_star: bool = False) -> Any:
    b = mu.size(0)
    x = torch.randn((b, model.in_channels, patch_size), dtype=mu.dtype)
    t_span = torch.linspace(1, 0, N + 1)
    t_span = t_span + (torch.cos(torch.pi / 2 * t_span) - 1 + t_span)
    t, dt = t_span[0], t_span[0] - t_span[1]
    zero_steps = max(1, int((N + 1) * 0.04))
    for step in range(1, N + 1):
        x = x.detach() if step - 1 == first else x
        if zero_star and step <= zero_steps:
            v = torch.zeros_like(x)
        else:
            out = model.estimator(torch.cat([x, x]), torch.cat([mu, torch.zeros_like(mu)]), t.expand(2 * b),
                                  torch.cat([cond, cond]), torch.zeros(2 * b))
            v, v_uncond = out.chunk(2)
            scale = 1.0
            if zero_star:
                pos, neg = v.reshape(b, -1), v_uncond.reshape(b, -1)
                scale = ((pos * neg).sum(1, keepdim=True) / (neg.square().sum(1, keepdim=True) + 1e-8)).view(b, 1, 1)
            v = v_uncond * scale + 1.0 * (v - v_uncond * scale)  # cfg_value=1.0
        x = x - dt * v
        t = t - dt
        if step < N:
            dt = t - t_span[step + 1]
    return x


@dataclass
class Case:
    upstream: str  # the gradpatch upstream name (apply(upstream))
    build: Callable[[], tuple[Any, dict]]
    entry: str  # the patched method
    reference: Callable[..., Any]
    inputs: tuple[str, ...]  # differentiable inputs
    extra: dict | None = None  # fixed keyword arguments of every call

    def call(self, model: Any, kw: dict, method: Any = None, **options: Any) -> Any:
        method = method or getattr(model, self.entry)
        out = method(**kw, n_timesteps=N, **(self.extra or {}), **options)
        return out[0] if isinstance(out, tuple) else out

    def owner(self, model: Any) -> type:
        return next(c for c in type(model).__mro__ if self.entry in vars(c))


CASES = {
    "matcha": Case("matcha", testing_flow.matcha_cfm, "forward", matcha_reference, ("mu",)),
    "chatterbox-matcha": Case("chatterbox", lambda: testing_flow.matcha_cfm(package="chatterbox"), "forward",
                              matcha_reference, ("mu",)),
    "chatterbox": Case("chatterbox", testing_flow.chatterbox_cfm, "forward", chatterbox_reference,
                       ("mu", "spks", "cond")),
    "seed_vc": Case("seed_vc", testing_flow.seed_vc_cfm, "inference", seed_vc_reference, ("mu", "prompt", "style")),
    "seed_vc_v2": Case("seed_vc", testing_flow.seed_vc_v2_cfm, "inference", seed_vc_v2_reference,
                       ("mu", "prompt", "style")),
    "indextts2": Case("indextts2", lambda: testing_flow.seed_vc_cfm(package="indextts"), "inference",
                      seed_vc_reference, ("mu", "prompt", "style")),
    "voxcpm": Case("voxcpm", testing_flow.voxcpm_cfm, "forward", voxcpm_reference, ("mu", "cond"),
                   {"use_cfg_zero_star": False}),
}
IN_PLACE = {"chatterbox"}  # bodies that fail in backward even unwrapped (CFG buffers refilled in place)


def _imports(case: Case) -> None:
    module = {"matcha": "matcha", "chatterbox": "chatterbox", "seed_vc": "seed_vc", "indextts2": "indextts",
              "voxcpm": "voxcpm"}[case.upstream]
    pytest.importorskip(module)


def _grads(out: Any, model: Any, kw: dict, names: tuple[str, ...]) -> list[Any]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    wrt = [kw[name] for name in names] + list(model.parameters())
    return list(torch.autograd.grad((out * weight).sum(), wrt, allow_unused=True))


def _assert_close(got: list[Any], want: list[Any]) -> None:
    assert [g is None for g in got] == [w is None for w in want]
    pairs = [(g, w) for g, w in zip(got, want) if w is not None]
    floor = 1e-6 * max(w.abs().max().item() for _, w in pairs)  # near-zero entries: scaled to the largest
    for g, w in pairs:
        torch.testing.assert_close(g, w, rtol=1e-4, atol=floor)


def _fresh(case: Case) -> tuple[Any, dict]:
    model, kw = case.build()
    for name in case.inputs:
        kw[name] = kw[name].clone().requires_grad_()
    return model, kw


OPTIONS = {"plain": {}, "grad_steps=1": {"grad_steps": 1}, "grad_steps=2": {"grad_steps": 2},
           "checkpoint_steps": {"checkpoint_steps": True}}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_equal_the_hand_fixed_loop(name: str, option: str) -> None:
    case = CASES[name]
    _imports(case)
    model, kw = _fresh(case)
    options = OPTIONS[option]
    # Upstream: no graph (also the model's first forward in this process: see patches/seed_vc.py on a
    # checkpointed first forward of Seed-VC's DiT); bodies refilling buffers in place fail even unwrapped.
    upstream = upstream_method(case.owner(model), case.entry)
    out = case.call(model, kw, upstream.__get__(model))
    assert not out.requires_grad and out.is_inference()
    if option == "plain":
        if name in IN_PLACE:
            out = case.call(model, kw, inspect.unwrap(upstream).__get__(model))
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
    with gradpatch.applied(case.upstream):
        torch.manual_seed(0)
        got = _grads(case.call(model, kw, cache=False, **options), model, kw, case.inputs)
    first = N - options["grad_steps"] if "grad_steps" in options else 0
    torch.manual_seed(0)
    want = _grads(case.reference(model, first, **kw), model, kw, case.inputs)
    _assert_close(got, want)
    if option == "plain":  # the comparison is not vacuous: most parameters and every input get a gradient
        assert sum(w is not None and bool(w.any()) for w in want) > 0.7 * len(want)
        assert all(w is not None and w.any() for w in want[:len(case.inputs)])


@pytest.mark.parametrize("name", list(CASES))
def test_cache_true_is_upstream_bitwise(name: str) -> None:
    case = CASES[name]
    _imports(case)
    model, kw = case.build()
    upstream = upstream_method(case.owner(model), case.entry).__get__(model)
    torch.manual_seed(0)
    want = case.call(model, kw, upstream)
    with gradpatch.applied(case.upstream) as report:
        assert getattr(type(model), case.entry) is not upstream, report
        torch.manual_seed(0)
        got = case.call(model, kw)
    assert torch.equal(got, want) and got.is_inference()


def test_voxcpm_cfg_zero_star_runs_plain_and_refuses_grad_steps() -> None:
    """With CFG-Zero* (the default) the first steps skip the estimator: the plain run matches the
    reference, while ``grad_steps`` cannot tell the steps apart and raises."""
    _imports(CASES["voxcpm"])
    model, kw = _fresh(CASES["voxcpm"])
    with gradpatch.applied("voxcpm"):
        torch.manual_seed(0)
        got = _grads(model(**kw, n_timesteps=N, cache=False), model, kw, ("mu", "cond"))
        with pytest.raises(RuntimeError, match="steps says"):
            model(**kw, n_timesteps=N, cache=False, grad_steps=1)
    torch.manual_seed(0)
    _assert_close(got, _grads(voxcpm_reference(model, 0, zero_star=True, **kw), model, kw, ("mu", "cond")))


def test_a_copy_at_another_path_is_found_by_scan(tmp_path: Any) -> None:
    """Matcha's ``flow_matching.py`` copied into a package no patch names is patched by fingerprint
    (fresh interpreter, ``GRADPATCH=matcha``); a copy with a changed solver is left alone."""
    pytest.importorskip("matcha")
    import matcha.models.components.flow_matching as original

    source = open(original.__file__, encoding="utf-8").read()
    (tmp_path / "myfork").mkdir()
    (tmp_path / "myfork" / "__init__.py").write_text("")
    (tmp_path / "myfork" / "cfm.py").write_text(source)
    (tmp_path / "myfork" / "changed.py").write_text(source.replace("x = x + dt * dphi_dt", "x = x + 0.5 * dt * dphi_dt"))
    result = run_python(textwrap.dedent("""
        import json, warnings
        warnings.simplefilter("always")
        import torch, gradpatch
        from gradpatch.testing import reinit_zero_weights
        with warnings.catch_warnings(record=True) as caught:
            import myfork.cfm, myfork.changed
        from types import SimpleNamespace
        decoder = dict(channels=[16], dropout=0.0, attention_head_dim=8, n_blocks=1, num_mid_blocks=1,
                       num_heads=2, act_fn="snakebeta")
        model = reinit_zero_weights(myfork.cfm.CFM(16, 8, SimpleNamespace(solver="euler"), decoder)).eval()
        mu = torch.randn(1, 8, 6, requires_grad=True)
        out = model(mu, torch.ones(1, 1, 6), 2, cache=False)
        out.sum().backward()
        rows = {r.patch: r.status.value for r in gradpatch.report() if "myfork" in r.patch}
        print(json.dumps([rows, bool(mu.grad.abs().sum() > 0),
                          [str(w.message)[:120] for w in caught if "myfork.changed" in str(w.message)]]))
    """), env={"GRADPATCH": "matcha", "HF_HUB_OFFLINE": "1"}, pythonpath=[tmp_path])
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    rows, has_grad, warned = json.loads(result.stdout.strip().splitlines()[-1])
    assert rows == {"myfork.cfm.BASECFM.forward": "applied", "myfork.changed.BASECFM.forward": "skipped"}
    assert has_grad
    assert warned and "does not match any known version" in warned[0]


@pytest.mark.parametrize("name", ["chatterbox", "chatterbox-matcha"])
def test_checkpoint_steps_with_only_the_estimator_trainable(name: str) -> None:
    """No input requires grad: Chatterbox's refilled CFG buffers gain ``requires_grad`` only from the
    second step on, and each step's recompute must see them as they were (else ``CheckpointError``).
    Seed-VC is left out: the first checkpointed forward of its DiT in a process gives wrong parameter
    gradients under ``torch.utils.checkpoint(use_reentrant=False)`` alone (see patches/seed_vc.py)."""
    case = CASES[name]
    _imports(case)
    model, kw = case.build()
    with gradpatch.applied(case.upstream):
        torch.manual_seed(0)
        got = _grads(case.call(model, kw, cache=False, checkpoint_steps=True), model, kw, ())
    torch.manual_seed(0)
    _assert_close(got, _grads(case.reference(model, 0, **kw), model, kw, ()))


def test_chatterbox_speaker_encoder_checkpoint_alias_becomes_non_reentrant() -> None:
    """CAMPPlus's dense layer calls ``cp.checkpoint(self.bn_function, x)`` (``cp`` = torch.utils.checkpoint,
    reentrant by default) in training: with an input that needs no grad, upstream gives ``bn_function``'s
    parameters no gradient; patched, they get the gradients of the same layer without checkpointing."""
    pytest.importorskip("chatterbox")
    from chatterbox.models.s3gen import xvector

    torch.manual_seed(0)
    layer = xvector.CAMDenseTDNNLayer(8, 8, bn_channels=8, kernel_size=3, memory_efficient=True).train()
    x = torch.randn(2, 8, 10)

    def grads() -> list[Any]:
        torch.manual_seed(1)
        out = layer(x)
        return list(torch.autograd.grad(out.square().sum(), list(layer.parameters()), allow_unused=True))

    with pytest.warns(UserWarning):  # torch: "None of the inputs have requires_grad=True"
        upstream = grads()
    assert all(g is None for g in upstream[:2])  # bn_function's batch norm: nothing reaches it
    layer.memory_efficient = False
    want = grads()
    layer.memory_efficient = True
    with gradpatch.applied("chatterbox") as report:
        assert isinstance(xvector.cp, type(xvector)) and xvector.cp is not torch.utils.checkpoint, report
        got = grads()
    assert xvector.cp is torch.utils.checkpoint
    _assert_close(got, want)
    assert all(g is not None for g in got[:2])
