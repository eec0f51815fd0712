"""denoising-diffusion-pytorch 2.3.4: ``GaussianDiffusion.sample`` (2-D and 1-D), decorated at every level.

Tiny random U-Nets (no downloads). The reference is the same code with its blockers removed by hand:
every decorated sampling method of the class replaced by its ``__wrapped__`` body for the call, and,
for ``grad_steps=K``, the latent entering step N-K detached by a wrapper around the step method.
Ancestral sampling (``p_sample_loop``) and DDIM (``ddim_sample``) are both checked; upstream is shown
giving no graph in the same test. Marked ``upstream_wave``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("denoising_diffusion_pytorch")

import gradpatch  # noqa: E402
from support import assert_grads_close, upstream_method, weighted_grads  # noqa: E402
from gradpatch.testing import reinit_zero_weights  # noqa: E402

pytestmark = [pytest.mark.upstream_wave, pytest.mark.usefixtures("single_thread")]
METHODS = ("sample", "p_sample_loop", "ddim_sample", "p_sample")


def _model(one_d: bool, sampling_timesteps: int) -> Any:
    torch.manual_seed(0)
    if one_d:
        from denoising_diffusion_pytorch import GaussianDiffusion1D, Unet1D

        unet = Unet1D(dim=8, dim_mults=(1, 2), channels=2)
        diffusion = GaussianDiffusion1D(unet, seq_length=8, timesteps=4, sampling_timesteps=sampling_timesteps)
    else:
        from denoising_diffusion_pytorch import GaussianDiffusion, Unet

        unet = Unet(dim=8, dim_mults=(1, 2), channels=1, flash_attn=False)
        diffusion = GaussianDiffusion(unet, image_size=8, timesteps=4, sampling_timesteps=sampling_timesteps)
    return reinit_zero_weights(diffusion, std=0.05).eval()


@contextlib.contextmanager
def _hand_fixed(cls: type, first: int) -> Iterator[None]:
    """Every decorated sampling method run undecorated; the state entering step ``first`` detached."""
    originals = {name: vars(cls)[name] for name in METHODS}
    for name, method in originals.items():
        setattr(cls, name, upstream_method(cls, name).__wrapped__)
    raw_step = cls.p_sample
    raw_predictions = cls.model_predictions
    count = [0]

    def detaching(step):
        def call(self, x, *args, **kwargs):
            count[0] += 1
            return step(self, x.detach() if count[0] - 1 == first else x, *args, **kwargs)
        return call

    cls.p_sample = detaching(raw_step)  # ancestral: one p_sample per step
    ddim = vars(cls)["ddim_sample"]

    def ddim_sample(self, *args, **kwargs):  # DDIM: one model_predictions per step
        cls.model_predictions = detaching(raw_predictions)
        try:
            return ddim(self, *args, **kwargs)
        finally:
            cls.model_predictions = raw_predictions

    cls.ddim_sample = ddim_sample
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(cls, name, method)


def _grads(out: Any, model: Any) -> list[Any]:
    return weighted_grads(out, model.parameters())


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2}, {"checkpoint_steps": True}],
                         ids=["plain", "grad_steps=1", "grad_steps=2", "checkpoint_steps"])
@pytest.mark.parametrize("sampling", [4, 2], ids=["ancestral", "ddim"])
@pytest.mark.parametrize("one_d", [False, True], ids=["2d", "1d"])
def test_sample_gradients_equal_the_hand_fixed_code(one_d: bool, sampling: int, options: dict) -> None:
    model = _model(one_d, sampling)
    cls = type(model)
    if not options:  # upstream: no graph, whatever the caller's grad mode
        out = upstream_method(cls, "sample").__get__(model)(batch_size=1)
        assert not out.requires_grad
    with gradpatch.applied("denoising_diffusion_pytorch"):
        torch.manual_seed(0)
        got = _grads(model.sample(batch_size=1, cache=False, **options), model)
    torch.manual_seed(0)
    with _hand_fixed(cls, sampling - options.get("grad_steps", sampling)):
        want = _grads(model.sample(batch_size=1), model)
    assert_grads_close(got, want)
    if not options:
        assert sum(w is not None and bool(w.any()) for w in want) > 0.7 * len(want)


def test_cache_true_is_upstream_bitwise() -> None:
    model = _model(False, 2)
    torch.manual_seed(0)
    want = upstream_method(type(model), "sample").__get__(model)(batch_size=1)
    with gradpatch.applied("denoising_diffusion_pytorch"):
        torch.manual_seed(0)
        got = model.sample(batch_size=1)
    assert torch.equal(got, want) and not got.requires_grad
