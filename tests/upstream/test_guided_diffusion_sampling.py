"""guided-diffusion-sdk 1.0.0: the sampling loops, whose generators hold ``with th.no_grad():`` around
their ``yield``.

A tiny random ``UNetModel`` (no downloads) and a 4-step ``SpacedDiffusion``. The reference is the loop
the generator runs, written here by hand without its grad-off block: ``p_sample`` / ``ddim_sample`` (which
upstream leaves undecorated) called step by step with grad, the latent entering step N-K detached for
``grad_steps=K``. Upstream is shown failing in the same tests: no graph from ``p_sample_loop``, and grad
off in the caller's own loop body while it iterates the progressive generator. Marked ``upstream_wave``.
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("guided_diffusion")

import gradpatch  # noqa: E402
from support import assert_grads_close, upstream_method, weighted_grads  # noqa: E402
from gradpatch.testing import reinit_zero_weights  # noqa: E402

pytestmark = [pytest.mark.upstream_wave, pytest.mark.usefixtures("single_thread")]
N, SHAPE = 4, (1, 3, 8, 8)


def _setup() -> tuple[Any, Any, Any]:
    from guided_diffusion.script_util import create_gaussian_diffusion
    from guided_diffusion.unet import UNetModel

    torch.manual_seed(0)
    model = UNetModel(image_size=8, in_channels=3, model_channels=32, out_channels=3, num_res_blocks=1,
                      attention_resolutions=(2,), channel_mult=(1, 2), num_head_channels=16)
    model = reinit_zero_weights(model, std=0.05).eval()
    diffusion = create_gaussian_diffusion(steps=N, noise_schedule="cosine")
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).requires_grad_()
    return model, diffusion, noise


def reference(diffusion: Any, model: Any, noise: Any, first: int, ddim: bool) -> Any:
    img = noise
    for step, i in enumerate(reversed(range(N))):
        img = img.detach() if step == first else img
        t = torch.tensor([i] * SHAPE[0])
        img = (diffusion.ddim_sample if ddim else diffusion.p_sample)(model, img, t, clip_denoised=True)["sample"]
    return img


def _grads(out: Any, model: Any, noise: Any) -> list[Any]:
    return weighted_grads(out, [noise, *model.parameters()])


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2}, {"grad_steps": 3}, {"checkpoint_steps": True}],
                         ids=["plain", "grad_steps=1", "grad_steps=2", "grad_steps=3", "checkpoint_steps"])
@pytest.mark.parametrize("loop", ["p_sample_loop", "ddim_sample_loop"])
def test_loop_gradients_equal_the_hand_written_loop(loop: str, options: dict) -> None:
    model, diffusion, noise = _setup()
    if not options:
        out = upstream_method(type(diffusion).__mro__[1], loop).__get__(diffusion)(model, SHAPE, noise=noise)
        assert not out.requires_grad
    with gradpatch.applied("guided_diffusion"):
        torch.manual_seed(0)
        got = _grads(getattr(diffusion, loop)(model, SHAPE, noise=noise, cache=False, **options), model, noise)
    torch.manual_seed(0)
    first = N - options["grad_steps"] if "grad_steps" in options else -1  # -1: nothing detached
    want = _grads(reference(diffusion, model, noise, first, loop.startswith("ddim")), model, noise)
    assert_grads_close(got, want)
    if not options:
        assert want[0].any() and sum(w is not None and bool(w.any()) for w in want) > 0.7 * len(want)


def test_progressive_generator_keeps_the_callers_grad_mode() -> None:
    """Upstream: the consumer's own loop body runs with grad off. Patched (``cache=False``): grad on
    between items, every item carries a graph, and the last equals the reference's gradients."""
    model, diffusion, noise = _setup()
    upstream = upstream_method(type(diffusion).__mro__[1], "p_sample_loop_progressive").__get__(diffusion)
    modes = [torch.is_grad_enabled() for _ in upstream(model, SHAPE, noise=noise)]
    assert modes == [False] * N
    with gradpatch.applied("guided_diffusion"):
        torch.manual_seed(0)
        items, modes = [], []
        for out in diffusion.p_sample_loop_progressive(model, SHAPE, noise=noise, cache=False):
            modes.append(torch.is_grad_enabled())
            items.append(out["sample"])
    assert modes == [True] * N and all(item.requires_grad for item in items)
    torch.manual_seed(0)
    assert_grads_close(_grads(items[-1], model, noise), _grads(reference(diffusion, model, noise, -1, False), model, noise))


def _cond_fn(x: Any, t: Any, p_mean_var: Any, **kwargs: Any) -> Any:
    """Guidance differentiating through the model (``cond_fn_with_grad=True``): a loss on ``pred_xstart``."""
    with torch.enable_grad():
        loss = (p_mean_var["pred_xstart"] - 0.2).square().sum()
        return torch.autograd.grad(loss, x, retain_graph=True)[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_grad_steps_with_guidance_through_the_model(k: int) -> None:
    """``cond_fn_with_grad=True`` evaluates the model inside its own ``enable_grad()`` to differentiate a
    loss through it: the cut steps record those evaluations for it (before: "element 0 of tensors does
    not require grad"), and the gradients are the hand-written loop's, the latent detached at N-K."""
    model, diffusion, noise = _setup()
    with gradpatch.applied("guided_diffusion"):
        torch.manual_seed(0)
        out = diffusion.p_sample_loop(model, SHAPE, noise=noise, cond_fn=_cond_fn, cond_fn_with_grad=True,
                                      model_kwargs={}, cache=False, grad_steps=k)
        got = _grads(out, model, noise)
    torch.manual_seed(0)
    img = noise
    for step, i in enumerate(reversed(range(N))):
        img = img.detach() if step == N - k else img
        img = diffusion.p_sample_with_grad(model, img, torch.tensor([i] * SHAPE[0]), cond_fn=_cond_fn,
                                            model_kwargs={})["sample"]
    assert_grads_close(got, _grads(img, model, noise))
