"""``gradpatch.differentiable``: whose grad-off constructs are lifted and whose are honoured, and the
calls that used to fail where plain torch works.

Each test compares float64 gradients with a hand-written reference: the same loop without the
sampler's own grad-off constructs, the caller's callbacks as written (their ``no_grad`` kept).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gradpatch  # noqa: E402
from support import assert_grads_close, weighted_grads  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
N = 4


def _net() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()


def _noise() -> Any:
    return torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()


def _loop(net: Any, x: Any, callback: Any = None) -> Any:
    """The sampler's body as written by hand (no grad-off of its own)."""
    for _ in range(N):
        x0 = net(x)
        if callback is not None:
            x0 = callback(x0)
        x = x + (x0 - x) / 4
    return x


def _sampler(net: Any) -> Any:
    @torch.no_grad()
    def sample(x: Any, callback: Any = None) -> Any:
        return _loop(net, x, callback)

    return sample


def _cut_with(x0: Any) -> Any:
    with torch.no_grad():
        return x0.clamp(-2, 2)


@torch.no_grad()
def _cut_decorated(x0: Any) -> Any:
    return x0.clamp(-2, 2)


def _cut_set_grad(x0: Any) -> Any:
    with torch.set_grad_enabled(False):
        return x0.clamp(-2, 2)


def _scaled(x0: Any, scale: float) -> Any:
    with torch.inference_mode():
        return x0 * scale


class _Clamp:
    def __call__(self, x0: Any) -> Any:
        with torch.no_grad():
            return x0.clamp(-2, 2)


CALLBACKS = {"with": _cut_with, "decorated": _cut_decorated, "set_grad_enabled": _cut_set_grad,
             "partial": functools.partial(_scaled, scale=0.5), "object": _Clamp(), "in_a_list": [_cut_with]}


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_a_callbacks_own_no_grad_is_honoured(name: str) -> None:
    """A callback passed in cuts ``x0``: the network gets no gradient, as in the hand-written loop
    (before: the callback's no_grad was lifted, and the network got a gradient of norm ~2)."""
    net, x = _net(), _noise()
    callback = CALLBACKS[name]

    def sample_list(x: Any, callbacks: Any) -> Any:
        return _sampler(net)(x, callback=callbacks[0])

    if name == "in_a_list":
        got = weighted_grads(gradpatch.differentiable(torch.no_grad()(sample_list))(x, callback), [x, *net.parameters()])
        callback = callback[0]
    else:
        got = weighted_grads(gradpatch.differentiable(_sampler(net))(x, callback=callback), [x, *net.parameters()])
    want = weighted_grads(_loop(net, x, lambda x0: callback(x0).clone()), [x, *net.parameters()])
    assert all(w is None for w in want[1:])
    assert_grads_close(got, want)


def test_the_samplers_own_method_passed_in_is_still_lifted() -> None:
    """The sampler's object's own method (bound to it) passed as an argument is the sampler's code."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        @torch.no_grad()
        def denoise(self, x: Any) -> Any:
            return self.net(x)

        @torch.no_grad()
        def sample(self, x: Any, fn: Any) -> Any:
            for _ in range(N):
                x = x + (fn(x) - x) / 4
            return x

    model, x = Model(), _noise()
    got = weighted_grads(gradpatch.differentiable(model.sample)(x, model.denoise), [x, *model.parameters()])
    want = weighted_grads(_loop(model.net, x), [x, *model.parameters()])
    assert_grads_close(got, want)


def test_a_differentiable_callback_lifts_its_own_no_grad() -> None:
    """A callable the caller made differentiable and passed in is lifted by its own call."""
    net, x = _net(), _noise()
    inner = gradpatch.differentiable(torch.no_grad()(lambda x0: x0 * 0.5))
    got = weighted_grads(gradpatch.differentiable(_sampler(net))(x, callback=lambda x0: inner(x0)), [x, *net.parameters()])
    want = weighted_grads(_loop(net, x, lambda x0: x0 * 0.5), [x, *net.parameters()])
    assert_grads_close(got, want)


def test_a_callback_that_cuts_everything_is_named() -> None:
    net, x = _net(), _noise()

    @torch.no_grad()
    def sample(x: Any, finish: Any) -> Any:
        return finish(_loop(net, x))

    with pytest.raises(gradpatch.NotDifferentiableError, match="honoured.*_cut_decorated"):
        gradpatch.differentiable(sample)(x, _cut_decorated)


def test_a_no_grad_logging_callback_keeps_no_graph() -> None:
    """What a ``@torch.no_grad()`` logging callback stores carries no graph, and keeps nothing alive
    after backward (before: 4 of 4 logged tensors had a grad_fn holding every step's ``x0``)."""
    net, x = _net(), _noise()
    logged, seen = [], []

    @torch.no_grad()
    def log(x0: Any) -> Any:
        logged.append((x0 ** 2).mean())
        seen.append(weakref.ref(x0))
        return x0

    out = gradpatch.differentiable(_sampler(net))(x, callback=log)
    got = weighted_grads(out, [x, *net.parameters()])
    assert_grads_close(got, weighted_grads(_loop(net, x), [x, *net.parameters()]))
    assert len(logged) == N and [t.grad_fn for t in logged] == [None] * N and not any(t.requires_grad for t in logged)
    del out
    gc.collect()
    assert [r() for r in seen] == [None] * N


def test_guided_diffusion_denoised_fn_with_its_own_no_grad(monkeypatch: Any) -> None:
    """guided-diffusion-sdk 1.0.0 (a real upstream, not skipped): a ``denoised_fn`` cutting
    ``pred_xstart`` under its own ``no_grad`` leaves the UNet without gradient, as in the hand-written
    loop (before: the UNet got gradients, the hand-written loop none)."""
    from guided_diffusion import nn as gd_nn
    from guided_diffusion.script_util import create_gaussian_diffusion
    from guided_diffusion.unet import UNetModel

    from gradpatch.testing import reinit_zero_weights

    monkeypatch.setattr(gd_nn.GroupNorm32, "forward", torch.nn.GroupNorm.forward)  # upstream: float32 inside

    torch.manual_seed(0)
    shape = (1, 3, 8, 8)
    model = UNetModel(image_size=8, in_channels=3, model_channels=32, out_channels=3, num_res_blocks=1,
                      attention_resolutions=(2,), channel_mult=(1, 2), num_head_channels=16)
    model = reinit_zero_weights(model, std=0.05).double().eval()
    model.dtype = torch.float64  # its input cast; and its float32 sinusoid into time_embed:
    model.time_embed.register_forward_pre_hook(lambda module, args: (args[0].double(),))
    diffusion = create_gaussian_diffusion(steps=N, noise_schedule="cosine")
    noise = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()

    def denoised_fn(x0: Any) -> Any:
        with torch.no_grad():
            return x0.clamp(-1, 1)

    with gradpatch.applied("guided_diffusion"):
        out = diffusion.p_sample_loop(model, shape, noise=noise, denoised_fn=denoised_fn, cache=False)
        got = weighted_grads(out, [noise, *model.parameters()])
    img = noise
    for i in reversed(range(N)):
        t = torch.tensor([i] * shape[0])
        img = diffusion.p_sample(model, img, t, clip_denoised=True, denoised_fn=denoised_fn)["sample"]
    want = weighted_grads(img, [noise, *model.parameters()])
    assert want[0] is not None and all(w is None for w in want[1:])
    assert_grads_close(got, want)


@pytest.mark.parametrize("how", ["submit", "map"])
def test_a_samplers_no_grad_helper_in_a_pool_thread_is_lifted(how: str) -> None:
    """The sampler hands its ``@torch.no_grad()`` network call to a ``ThreadPoolExecutor`` (before: the
    worker's no_grad held, gradients off by 3.5)."""
    net, x = _net(), _noise()

    @torch.no_grad()
    def denoise(x: Any) -> Any:
        return net(x)

    @torch.no_grad()
    def sample(x: Any) -> Any:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for _ in range(N):
                v = pool.submit(denoise, x).result() if how == "submit" else next(pool.map(denoise, [x]))
                x = x + (v - x) / 4
        return x

    got = weighted_grads(gradpatch.differentiable(sample)(x), [x, *net.parameters()])
    assert_grads_close(got, weighted_grads(_loop(net, x), [x, *net.parameters()]))


def test_a_pool_thread_of_the_callers_own_keeps_its_no_grad() -> None:
    """Work the caller's callback submits is the caller's: its no_grad holds."""
    net, x = _net(), _noise()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        got = weighted_grads(gradpatch.differentiable(_sampler(net))(
            x, callback=lambda x0: pool.submit(_cut_decorated, x0).result()), [x, *net.parameters()])
    want = weighted_grads(_loop(net, x, lambda x0: _cut_decorated(x0).clone()), [x, *net.parameters()])
    assert_grads_close(got, want)


class _LoRALinear(torch.nn.Linear):
    """loralib's ``Linear``: ``train(False)`` merges ``B @ A`` into the frozen weight through ``.data``."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.lora_A = torch.nn.Parameter(torch.randn(2, n) * 0.3)
        self.lora_B = torch.nn.Parameter(torch.randn(n, 2) * 0.3)
        self.weight.requires_grad_(False)
        self.merged = False

    def train(self, mode: bool = True) -> Any:
        super().train(mode)
        if not mode and not self.merged:
            self.weight.data += self.lora_B @ self.lora_A
            self.merged = True
        if mode and self.merged:
            self.weight.data -= self.lora_B @ self.lora_A
            self.merged = False
        return self

    def forward(self, x: Any) -> Any:
        out = super().forward(x)
        return out if self.merged else out + x @ (self.lora_B @ self.lora_A).T


@pytest.mark.parametrize("how", ["eval", "train(False)"])
def test_eval_of_a_lora_submodule_by_the_sampler_does_nothing(how: str) -> None:
    """The sampler calls ``eval()`` on a submodule whose ``train()`` merges LoRA weights (before: the
    LoRA parameters got no gradient and stayed merged after the call)."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inner = torch.nn.Sequential(_LoRALinear(4), torch.nn.Tanh())

        @torch.no_grad()
        def sample(self, x: Any) -> Any:
            self.inner[0].eval() if how == "eval" else self.inner[0].train(False)
            for _ in range(N):
                x = x - self.inner(x) / 4
            return x

    model = Model().double()
    x = _noise()
    lora = [model.inner[0].lora_A, model.inner[0].lora_B]
    weight = model.inner[0].weight.clone()
    got = weighted_grads(gradpatch.differentiable(model.sample)(x), [x, *lora])
    assert not model.inner[0].merged and torch.equal(model.inner[0].weight, weight) and model.inner[0].training
    ref = x
    for _ in range(N):
        ref = ref - model.inner(ref) / 4
    assert_grads_close(got, weighted_grads(ref, [x, *lora]))
    model.inner[0].eval()  # outside a call: the override runs
    assert model.inner[0].merged


def _inplace_sampler(net: Any, inplace: bool) -> Any:
    @torch.no_grad()
    def sample(x: Any) -> Any:
        buf = torch.zeros_like(x)
        for _ in range(N):
            if inplace:
                buf[:] = x
            else:
                buf = x * 1
            x = x + (net(buf) - x) / 4
        return x

    return sample


def test_torch_func_grad_over_a_call() -> None:
    """``torch.func.grad`` (which disables saved-tensor hooks) over a call (before: RuntimeError "don't
    yet support saved tensor hooks")."""
    net = _net()
    x = _noise().detach()
    want = torch.func.grad(lambda x: _loop(net, x).pow(2).sum())(x)
    for inplace in (False, True):
        got = torch.func.grad(lambda x: gradpatch.differentiable(_inplace_sampler(net, inplace))(x).pow(2).sum())(x)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_call_under_disabled_saved_tensor_hooks() -> None:
    """Under ``disable_saved_tensors_hooks`` a call builds the plain graph (before: RuntimeError); a
    write into a tensor saved for backward cannot be copied there and raises torch's own error in
    backward, as the hand-written loop does, never a wrong gradient."""
    net, x = _net(), _noise()
    want = weighted_grads(_loop(net, x), [x, *net.parameters()])
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        got = weighted_grads(gradpatch.differentiable(_inplace_sampler(net, False))(x), [x, *net.parameters()])
        out = gradpatch.differentiable(_inplace_sampler(net, True))(x)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            weighted_grads(out, [x, *net.parameters()])
    assert_grads_close(got, want)


def test_an_async_sampler() -> None:
    """An ``async def`` sampler with an in-body ``no_grad`` around its network call, awaited in an event
    loop with another task (before: refused, "returned builtins.coroutine ... (detached, or converted)")."""
    net, x = _net(), _noise()
    modes = []

    async def sample(x: Any) -> Any:
        for _ in range(N):
            with torch.no_grad():
                v = net(x)
            await asyncio.sleep(0)
            x = x + (v - x) / 4
        return x

    async def other() -> None:
        for _ in range(N):
            modes.append(torch.is_grad_enabled())
            await asyncio.sleep(0)

    async def main() -> Any:
        out, _ = await asyncio.gather(gradpatch.differentiable(sample)(x), other())
        return out

    got = weighted_grads(asyncio.run(main()), [x, *net.parameters()])
    assert_grads_close(got, weighted_grads(_loop(net, x), [x, *net.parameters()]))
    assert modes == [True] * N
    with torch.no_grad():  # the caller's no_grad holds
        assert not asyncio.run(gradpatch.differentiable(sample)(x)).requires_grad
