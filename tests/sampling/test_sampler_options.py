"""The sampler keywords on real samplers (tiny F5-TTS CFM, tiny Stable Diffusion pipeline): booleans
that are booleans, integral step counts of any integer type, and no misspelt option swallowed."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

import gradpatch  # noqa: E402
from gradpatch.sampling.options import SamplingOptions  # noqa: E402
from gradpatch.testing import f5_cfm, f5_inputs, stable_diffusion_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def sd(single_thread):
    pytest.importorskip("diffusers")
    return stable_diffusion_pipeline()


def _sd_kwargs(embeds, steps: int = 2) -> dict:
    return dict(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], height=16, width=16,
                num_inference_steps=steps, guidance_scale=2.0, output_type="pt",
                generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("value, expected", [(3, 3), (np.int64(3), 3), (np.uint8(2), 2), (torch.tensor(2), 2),
                                             (None, None)])
def test_grad_steps_accepts_integral_numbers(value, expected):
    options = SamplingOptions(value)
    assert options.grad_steps == expected and type(options.grad_steps) is type(expected)


@pytest.mark.parametrize("value, error", [(True, TypeError), (torch.tensor(True), TypeError), (1.0, TypeError),
                                          ("2", TypeError), (0, ValueError), (np.int64(-1), ValueError)])
def test_grad_steps_refuses_the_rest(value, error):
    with pytest.raises(error, match="grad_steps must be a positive integer"):
        SamplingOptions(value)


def test_diffusers_pipeline_options(sd):
    pipe, embeds = sd
    with gradpatch.applied("diffusers"):
        for bad in ({"cache": "False"}, {"cache": 0}, {"cache": False, "checkpoint_steps": "yes"}):
            with pytest.raises(TypeError, match="must be True or False"):
                pipe(**_sd_kwargs(embeds), **bad)
        for steps in (np.int64(1), torch.tensor(1)):
            out = pipe(**_sd_kwargs(embeds), cache=False, grad_steps=steps).images
            assert out.requires_grad


@pytest.mark.parametrize("misspelt", ["grad_step", "checkpoint_step", "cach", "Grad_Steps"])
def test_diffusers_misspelt_option_is_not_swallowed(sd, misspelt):
    pipe, embeds = sd
    with gradpatch.applied("diffusers", strict=True):
        with pytest.raises(gradpatch.GradpatchError, match=f"got {misspelt}=.*did you mean"):
            pipe(**_sd_kwargs(embeds), cache=False, **{misspelt: 1})
    with gradpatch.applied("diffusers"):
        with pytest.warns(gradpatch.ConfigWarning, match=f"got {misspelt}="):
            pipe(**_sd_kwargs(embeds, steps=1), **{misspelt: 1})


def test_diffusers_unrelated_keywords_pass_quietly(sd):
    pipe, embeds = sd
    with gradpatch.applied("diffusers"), warnings.catch_warnings():
        warnings.simplefilter("error", gradpatch.GradpatchWarning)
        pipe(**_sd_kwargs(embeds, steps=1), cache=True, clip_skip=None)


def test_f5_sample_options(single_thread):
    pytest.importorskip("f5_tts")
    model, (cond, text) = f5_cfm(), f5_inputs()
    with gradpatch.applied("f5_tts"):
        with pytest.raises(TypeError, match="cache must be True or False"):
            model.sample(cond, text, duration=12, steps=2, cache="False")
        with pytest.raises(TypeError, match="checkpoint_steps must be True or False"):
            model.sample(cond, text, duration=12, steps=2, cache=False, checkpoint_steps=1)
        with pytest.raises(TypeError, match="grad_steps must be a positive integer"):
            model.sample(cond, text, duration=12, steps=2, cache=False, grad_steps=True)
        out, _ = model.sample(cond, text, duration=12, steps=2, cache=False, grad_steps=np.int64(1))
        assert out.requires_grad
