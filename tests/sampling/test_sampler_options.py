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


@pytest.mark.parametrize("value, expected", [((1, 3), (1, 3)), ([2, 2], (2, 2)), ((np.int64(1), torch.tensor(4)), (1, 4))])
def test_grad_steps_range_accepts_two_positive_integers(value, expected):
    options = SamplingOptions(value)
    assert options.grad_steps is None and options.grad_steps_range == expected and options.truncates
    assert all(type(v) is int for v in options.grad_steps_range)


@pytest.mark.parametrize("value, error", [((1, 2, 3), TypeError), ((1,), TypeError), ((1.0, 2), TypeError),
                                          ((True, 2), TypeError), (("1", "2"), TypeError), ((0, 2), ValueError),
                                          ((1, -2), ValueError), ((3, 2), ValueError)])
def test_grad_steps_range_refuses_the_rest(value, error):
    with pytest.raises(error, match=r"grad_steps=\(lo, hi\) must be two positive integers with lo <= hi"):
        SamplingOptions(value)


def test_grad_steps_range_draw_is_inclusive_uniform_and_seeded():
    options = SamplingOptions((2, 4))
    torch.manual_seed(0)
    first = [options.drawn().grad_steps for _ in range(300)]
    torch.manual_seed(0)
    assert [options.drawn().grad_steps for _ in range(300)] == first  # torch.manual_seed reproduces the draws
    assert {k: first.count(k) for k in (2, 3, 4)} == {k: first.count(k) for k in set(first)}  # within [2, 4]
    assert min(first.count(k) for k in (2, 3, 4)) > 60  # both ends included, about 100 each
    generator = torch.Generator().manual_seed(5)
    drawn = [options.drawn(generator).grad_steps for _ in range(20)]
    generator.manual_seed(5)
    assert drawn == [int(torch.randint(2, 5, (1,), generator=generator)) for _ in range(20)]
    state = torch.random.get_rng_state()
    assert SamplingOptions((3, 3)).drawn().grad_steps == 3  # (k, k) draws nothing
    assert torch.equal(torch.random.get_rng_state(), state)
    assert options.drawn().drawn().grad_steps_range == (2, 4)


def test_diffusers_grad_steps_range_draws_from_the_pipeline_generator(sd):
    """A pipeline given ``generator=`` draws K from it, so that one seeded generator reproduces the call:
    the same output and gradients as drawing K by hand from it, then ``grad_steps=K``."""
    pipe, embeds = sd
    params = [p for p in pipe.unet.parameters() if p.requires_grad]
    with gradpatch.applied("diffusers"):
        def run(**options):
            out = pipe(**_sd_kwargs(embeds, steps=3), cache=False, **options).images
            return out, torch.autograd.grad(out.square().sum(), params, allow_unused=True)

        for seed in range(4):
            torch.manual_seed(123)  # the default generator must not matter
            out, got = run(grad_steps=(1, 3))
            generator = torch.Generator().manual_seed(0)
            k = int(torch.randint(1, 4, (1,), generator=generator))
            kwargs = _sd_kwargs(embeds, steps=3)
            kwargs["generator"] = generator
            torch.manual_seed(seed)
            want_out = pipe(**kwargs, cache=False, grad_steps=k).images
            want = torch.autograd.grad(want_out.square().sum(), params, allow_unused=True)
            assert torch.equal(out, want_out)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True) if w is not None)
        with pytest.raises(ValueError, match="cache=False"):
            pipe(**_sd_kwargs(embeds), grad_steps=(1, 2))


def test_f5_grad_steps_range_is_seeded_by_torch(single_thread):
    pytest.importorskip("f5_tts")
    model, (cond, text) = f5_cfm(), f5_inputs()
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    with gradpatch.applied("f5_tts"):
        def run(grad_steps):
            out, _ = model.sample(cond, text, duration=12, steps=4, seed=0, cache=False, grad_steps=grad_steps)
            return torch.autograd.grad(out.square().sum(), params, allow_unused=True)

        by_k = {k: run(k) for k in (1, 4)}
        assert any(not torch.equal(a, b) for a, b in zip(*by_k.values()) if a is not None)  # K matters here
        for seed in range(3):
            torch.manual_seed(seed)
            got = run((1, 4))
            torch.manual_seed(seed)
            want = run(int(torch.randint(1, 5, (1,))))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True) if w is not None)
