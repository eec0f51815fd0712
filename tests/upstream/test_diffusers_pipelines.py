"""diffusers pipelines with ``cache=False``: real diffusers, tiny random components, no downloads."""
from __future__ import annotations

import inspect
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

import gradpatch  # noqa: E402
from gradpatch.testing import add_lora, stable_diffusion_pipeline  # noqa: E402
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel  # noqa: E402
from diffusers.pipelines.pipeline_utils import DiffusionPipeline  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:diffusers", "ignore:.*deprecated"),
              pytest.mark.usefixtures("single_thread")]
SEED = 0


def _reinit_zeros(*models: torch.nn.Module) -> None:
    """Zero-initialised weights give zero gradients upstream of them: re-initialise them."""
    with torch.no_grad():
        for model in models:
            for param in model.parameters():
                if param.dim() > 1 and not param.any():
                    param.normal_(0, 0.05)


def _scheduler() -> DDIMScheduler:
    return DDIMScheduler(clip_sample=False, set_alpha_to_one=False, steps_offset=1)


def build_sd():
    """A tiny StableDiffusionPipeline (LoRA on the UNet) and CFG prompt embeddings."""
    pipe, embeds = stable_diffusion_pipeline(SEED)
    return pipe, add_lora(pipe.unet), embeds


@pytest.fixture(scope="module")
def sd():
    return build_sd()


def _sd_kwargs(embeds, steps: int = 3, output_type: str = "pt") -> dict:
    return dict(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], height=16, width=16,
                num_inference_steps=steps, guidance_scale=2.0, output_type=output_type,
                generator=torch.Generator().manual_seed(SEED))


def _grads(output: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return list(torch.autograd.grad((output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum(), params))


def _reference(pipe, kwargs: dict, no_grad_calls: int = 0, calls: list[int] | None = None) -> torch.Tensor:
    """The undecorated ``__call__`` under enable_grad; the first ``no_grad_calls`` UNet calls without graph."""
    calls, forward = calls if calls is not None else [0], pipe.unet.forward

    def counted(*args, **kw):
        calls[0] += 1
        with torch.set_grad_enabled(calls[0] > no_grad_calls):
            return forward(*args, **kw)

    pipe.unet.forward = counted
    try:
        with torch.enable_grad():
            return inspect.unwrap(type(pipe).__call__)(pipe, **kwargs)[0]
    finally:
        del pipe.unet.forward


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_cache_true_is_bitwise_unpatched_and_signature(sd):
    pipe, _, embeds = sd
    before = pipe(**_sd_kwargs(embeds))[0]
    with gradpatch.applied("diffusers") as report:
        statuses = {r.patch: r.status for r in report}
        assert statuses["diffusers.pipelines"] == gradpatch.Status.APPLIED  # late apply: class already defined
        assert hasattr(StableDiffusionPipeline.__call__, "__gradpatch_original__")
        params = inspect.signature(StableDiffusionPipeline.__call__).parameters
        assert {"cache", "grad_steps", "checkpoint_steps", "prompt_embeds"} <= set(params)
        after = pipe(**_sd_kwargs(embeds))[0]
        explicit = pipe(**_sd_kwargs(embeds), cache=True)[0]
        with pytest.raises(ValueError, match="cache=False"):
            pipe(**_sd_kwargs(embeds), grad_steps=1)
    assert after.grad_fn is None and torch.equal(before, after) and torch.equal(before, explicit)


def test_cache_false_matches_undecorated_reference(sd):
    pipe, params, embeds = sd
    pipe.unet.train(), pipe.vae.eval()
    with gradpatch.applied("diffusers"):
        for output_type in ("pt", "latent"):
            out = pipe(**_sd_kwargs(embeds, output_type=output_type), cache=False)[0]
            ref = _reference(pipe, _sd_kwargs(embeds, output_type=output_type))
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-7)
            grads = _grads(out, params)
            assert all(g.abs().sum() > 0 for g in grads)
            _close(grads, _grads(ref, params))
        for output_type in ("pil", "np"):
            with pytest.raises(ValueError, match="output_type='pt'"):
                pipe(**_sd_kwargs(embeds, output_type=output_type), cache=False)
    assert pipe.unet.training and not pipe.vae.training  # modes as the caller set them
    pipe.unet.eval()


def test_grad_steps_and_checkpoint_steps(sd):
    pipe, params, embeds = sd
    with gradpatch.applied("diffusers"):
        plain = pipe(**_sd_kwargs(embeds, steps=4), cache=False)[0]
        checkpointed = pipe(**_sd_kwargs(embeds, steps=4), cache=False, checkpoint_steps=True)[0]
        last = pipe(**_sd_kwargs(embeds, steps=4), cache=False, grad_steps=1)[0]
        last_two = pipe(**_sd_kwargs(embeds, steps=4), cache=False, grad_steps=2, checkpoint_steps=True)[0]
    torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-7)
    _close(_grads(checkpointed, params), _grads(plain, params))
    # batched CFG: one UNet call per step, so the first 4 - K calls are the no-grad ones
    _close(_grads(last, params), _grads(_reference(pipe, _sd_kwargs(embeds, steps=4), no_grad_calls=3), params))
    _close(_grads(last_two, params), _grads(_reference(pipe, _sd_kwargs(embeds, steps=4), no_grad_calls=2), params))
    assert "forward" not in vars(pipe.unet) and "step" not in vars(pipe.scheduler)


def test_checkpoint_steps_around_the_unets_own_gradient_checkpointing():
    """diffusers' ``enable_gradient_checkpointing()`` (torch's non-reentrant checkpoint per block, in
    train mode) inside a step that ``checkpoint_steps`` recomputes: the step's recompute runs torch's
    checkpoint again, which recomputes its blocks once more; gradients equal the plain call's."""
    pipe, params, embeds = build_sd()
    pipe.unet.enable_gradient_checkpointing()
    pipe.unet.train()
    with gradpatch.applied("diffusers"):
        plain = pipe(**_sd_kwargs(embeds), cache=False)[0]
        checkpointed = pipe(**_sd_kwargs(embeds), cache=False, checkpoint_steps=True)[0]
    torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-7)
    grads = _grads(checkpointed, params)
    assert all(g.abs().sum() > 0 for g in grads)
    _close(grads, _grads(plain, params))


@pytest.mark.parametrize("kind, scheduler", [("img2img", "DDIMScheduler"), ("img2img", "EulerDiscreteScheduler"),
                                             ("img2img", "HeunDiscreteScheduler"), ("txt2img", "PNDMScheduler")])
def test_grad_steps_locates_steps(sd, kind, scheduler):
    """Loops over a suffix of the timesteps (strength), with repeated timesteps (Heun, PNDM)."""
    from diffusers import StableDiffusionImg2ImgPipeline

    pipe, params, embeds = sd
    components = dict(pipe.components, scheduler=getattr(diffusers, scheduler).from_config(pipe.scheduler.config))
    cls = StableDiffusionImg2ImgPipeline if kind == "img2img" else StableDiffusionPipeline
    other = cls(**components)
    other.set_progress_bar_config(disable=True)

    def kwargs() -> dict:
        if kind == "txt2img":
            return _sd_kwargs(embeds, steps=4)
        image = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        return {k: v for k, v in _sd_kwargs(embeds, steps=4).items() if k not in ("height", "width")} | dict(
            image=image, strength=0.5)

    calls = [0]
    _reference(other, kwargs(), calls=calls)  # one UNet call per loop iteration (batched CFG)
    timesteps = len(other.scheduler.timesteps)
    assert calls[0] == timesteps if kind == "txt2img" else 1 < calls[0] < timesteps
    with gradpatch.applied("diffusers"):
        last = other(**kwargs(), cache=False, grad_steps=1)[0]
    reference = _reference(other, kwargs(), no_grad_calls=calls[0] - 1)
    torch.testing.assert_close(last, reference, rtol=1e-5, atol=1e-7)
    _close(_grads(last, params), _grads(reference, params))


def test_audioldm_cache_false(sd):
    from diffusers import AudioLDMPipeline
    from transformers import ClapTextConfig, ClapTextModelWithProjection, SpeechT5HifiGan, SpeechT5HifiGanConfig

    torch.manual_seed(SEED)
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=8, sample_size=8,
                                in_channels=4, out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=(8, 16),
                                class_embed_type="simple_projection", projection_class_embeddings_input_dim=8,
                                class_embeddings_concat=True)
    vae = AutoencoderKL(block_out_channels=(8, 16), in_channels=1, out_channels=1, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        norm_num_groups=8)
    text = ClapTextModelWithProjection(ClapTextConfig(hidden_size=8, intermediate_size=16, num_attention_heads=1,
                                                      num_hidden_layers=1, vocab_size=100, projection_dim=8))
    vocoder = SpeechT5HifiGan(SpeechT5HifiGanConfig(model_in_dim=8, sampling_rate=16000, upsample_initial_channel=16,
                                                    upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
                                                    resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
                                                    normalize_before=False))
    _reinit_zeros(unet, vae, text, vocoder)
    params = add_lora(unet)
    pipe = AudioLDMPipeline(vae=vae, text_encoder=text, tokenizer=None, unet=unet, scheduler=_scheduler(),
                            vocoder=vocoder)
    pipe.set_progress_bar_config(disable=True)
    embeds = torch.nn.functional.normalize(torch.randn(2, 8), dim=-1)

    def kwargs() -> dict:
        return dict(prompt_embeds=embeds[:1], negative_prompt_embeds=embeds[1:], num_inference_steps=2,
                    audio_length_in_s=0.016, guidance_scale=2.0, output_type="pt",
                    generator=torch.Generator().manual_seed(SEED))

    before = pipe(**kwargs()).audios
    with gradpatch.applied("diffusers"):
        assert torch.equal(pipe(**kwargs()).audios, before)
        audio = pipe(**kwargs(), cache=False).audios
        checkpointed = pipe(**kwargs(), cache=False, checkpoint_steps=True, grad_steps=1).audios
        with pytest.raises(ValueError, match="output_type"):
            pipe(**{**kwargs(), "output_type": "np"}, cache=False)
    with torch.enable_grad():
        ref = inspect.unwrap(AudioLDMPipeline.__call__)(pipe, **kwargs()).audios
    torch.testing.assert_close(audio, ref, rtol=1e-5, atol=1e-7)
    grads = _grads(audio, params)
    assert any(g.abs().sum() > 0 for g in grads)
    _close(grads, _grads(ref, params))
    assert any(g.abs().sum() > 0 for g in _grads(checkpointed, params))


def _tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(SEED)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    _reinit_zeros(model)
    return model


def test_class_defined_after_apply_and_cache_hooks_bypassed():
    from diffusers import FirstBlockCacheConfig, FlowMatchEulerDiscreteScheduler

    with gradpatch.applied("diffusers"):
        class TinyFluxPipeline(DiffusionPipeline):
            def __init__(self, transformer, scheduler):
                super().__init__()
                self.register_modules(transformer=transformer, scheduler=scheduler)

            @torch.no_grad()
            def __call__(self, latents, text, pooled, num_inference_steps=4, output_type="latent"):
                self.scheduler.set_timesteps(num_inference_steps)
                img_ids, txt_ids = torch.zeros(latents.shape[1], 3), torch.zeros(text.shape[1], 3)
                for i, t in enumerate(self.scheduler.timesteps):
                    with self.transformer.cache_context("cond"):
                        v = self.transformer(hidden_states=latents, encoder_hidden_states=text,
                                             pooled_projections=pooled, timestep=t.expand(latents.shape[0]) / 1000,
                                             img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
                    latents = self.scheduler.step(v, t, latents, return_dict=False)[0]
                self.maybe_free_model_hooks()
                return latents

        assert hasattr(TinyFluxPipeline.__call__, "__gradpatch_original__")
        model = _tiny_flux()
        pipe = TinyFluxPipeline(model, FlowMatchEulerDiscreteScheduler())
        pipe.set_progress_bar_config(disable=True)
        g = torch.Generator().manual_seed(SEED)
        args = torch.randn(1, 16, 4, generator=g), torch.randn(1, 5, 16, generator=g), torch.randn(1, 8, generator=g)
        params = [p for n, p in model.named_parameters() if "single_transformer_blocks.1" in n]
        with torch.enable_grad():
            uncached = inspect.unwrap(TinyFluxPipeline.__call__)(pipe, *args)
        model.enable_cache(FirstBlockCacheConfig(threshold=1e9))  # always reuse the tail after step 0
        registries = [(m, m._diffusers_hook, list(m._diffusers_hook._fn_refs),
                       [(r.pre_forward, r.forward, r.post_forward) for r in m._diffusers_hook._fn_refs])
                      for m in model.modules() if hasattr(m, "_diffusers_hook")]
        cached = pipe(*args)
        assert not torch.allclose(cached, uncached)  # the cache is on and changes results
        out = pipe(*args, cache=False)
        torch.testing.assert_close(out, uncached, rtol=1e-5, atol=1e-7)
        _close(_grads(out, params), _grads(uncached, params))
        out = pipe(*args, cache=False, checkpoint_steps=True, grad_steps=2)  # recompute in backward, after the call
        assert all(g.abs().sum() > 0 for g in _grads(out, params))
        assert model.is_cache_enabled and torch.equal(pipe(*args), cached)
        for module, registry, refs, fns in registries:  # the very same hooks, state and chain
            assert module._diffusers_hook is registry and registry._fn_refs == refs
            assert [(r.pre_forward, r.forward, r.post_forward) for r in refs] == fns
    assert "__gradpatch_original__" not in vars(TinyFluxPipeline.__call__)


def test_subclasses_helpers_guards_and_revert(sd):
    from gradpatch.sampling.families.diffusers import NotDifferentiableError

    pipe, params, embeds = sd
    originals = {}
    pending = [DiffusionPipeline]
    while pending:
        for cls in pending.pop().__subclasses__():
            originals[cls] = dict(vars(cls))
            pending.append(cls)
    assert "__init_subclass__" not in vars(DiffusionPipeline)
    with gradpatch.applied("diffusers"):
        class Sub(StableDiffusionPipeline):  # decorated __call__ that delegates to super(): one graph
            @torch.no_grad()
            def __call__(self, *args, **kwargs):
                return super().__call__(*args, **kwargs)

            @torch.no_grad()
            def encode_scale(self, x):
                return x * 2

        class Plain(StableDiffusionPipeline):  # undecorated override: no body to run with gradients
            def __call__(self, *args, **kwargs):
                return super().__call__(*args, **kwargs)

        sub = Sub(**pipe.components)
        sub.set_progress_bar_config(disable=True)
        out = sub(**_sd_kwargs(embeds), cache=False)[0]
        torch.testing.assert_close(out, pipe(**_sd_kwargs(embeds), cache=False)[0], rtol=1e-5, atol=1e-7)
        assert all(g.abs().sum() > 0 for g in _grads(out, params))
        x = torch.ones(1, requires_grad=True)
        assert sub.encode_scale(x).grad_fn is None  # outside a cache=False call: decorated as before
        plain = Plain(**pipe.components)
        plain.set_progress_bar_config(disable=True)
        assert torch.equal(plain(**_sd_kwargs(embeds))[0], pipe(**_sd_kwargs(embeds))[0])
        with pytest.raises(NotDifferentiableError, match="not decorated"):
            plain(**_sd_kwargs(embeds), cache=False)
        assert "__init_subclass__" in vars(DiffusionPipeline)
    assert "__init_subclass__" not in vars(DiffusionPipeline)
    for cls, namespace in originals.items():  # every attribute of every class: the very same objects
        assert all(vars(cls).get(name) is value for name, value in namespace.items()), cls
    assert "__gradpatch_original__" not in vars(Sub.__call__) and "__gradpatch_original__" not in vars(Plain.__call__)


def test_helper_runs_undecorated_inside_cache_false_call():
    with gradpatch.applied("diffusers"):
        class Helper(DiffusionPipeline):
            @torch.no_grad()
            def encode_prompt(self, x):
                return x * 2

            @torch.no_grad()
            def __call__(self, x, output_type="pt"):
                return self.encode_prompt(x)

        class Combined(DiffusionPipeline):  # calls another pipeline, as diffusers' combined pipelines do
            @torch.no_grad()
            def __call__(self, x, output_type="pt"):
                return Helper()(x) + Helper()(x, cache=True).detach()

        x = torch.ones(2, requires_grad=True)
        assert Helper()(x).grad_fn is None
        assert Helper()(x, cache=False).grad_fn is not None
        assert Helper().encode_prompt(x).grad_fn is None
        assert Combined()(x).grad_fn is None
        with pytest.raises(TypeError, match="no denoiser"):  # nothing to truncate: an error, not a no-op
            Helper()(x, cache=False, grad_steps=1)
        torch.testing.assert_close(torch.autograd.grad(Combined()(x, cache=False).sum(), x)[0], torch.full((2,), 2.0))


def test_reward_finetuning_lowers_loss(sd):
    pipe, params, embeds = sd
    saved = [p.detach().clone() for p in params]
    optimiser = torch.optim.Adam(params, lr=3e-2)
    losses = []
    with gradpatch.applied("diffusers"):
        for _ in range(6):
            images = pipe(**_sd_kwargs(embeds), cache=False, grad_steps=2, checkpoint_steps=True)[0]
            loss = (images - 1.0).pow(2).mean()  # reward: brighter images
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    assert losses[-1] < losses[0], losses


DEFERRED = """
import gradpatch, sys, torch
status = lambda: {r.patch: str(r.status) for r in gradpatch.report()}
gradpatch.apply("diffusers")
assert set(status().values()) == {"deferred"}, status()
assert "diffusers.pipelines.pipeline_utils" not in sys.modules
from diffusers import AudioLDMPipeline, StableDiffusionPipeline  # lazy modules: patched on import
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
assert status()["diffusers.pipelines"] == "applied", gradpatch.report()
assert hasattr(StableDiffusionPipeline.__call__, "__gradpatch_original__")
assert hasattr(AudioLDMPipeline.__call__, "__gradpatch_original__")
import diffusers.pipelines.stable_diffusion.pipeline_onnx_stable_diffusion as onnx
guarded = onnx.OnnxStableDiffusionPipeline.__call__
assert "__gradpatch_original__" in vars(guarded) and not hasattr(guarded.__gradpatch_original__, "__wrapped__")
try:
    onnx.OnnxStableDiffusionPipeline.__call__(object.__new__(onnx.OnnxStableDiffusionPipeline), cache=False)
except TypeError as exc:
    assert "ONNX" in str(exc), exc
else:
    raise AssertionError("no error")
from diffusers.modular_pipelines.modular_pipeline import ModularPipeline, ModularPipelineBlocks
assert status()["diffusers.modular_pipelines"] == "applied", gradpatch.report()
assert status()["diffusers.modular_pipelines.blocks"] == "applied", gradpatch.report()
import inspect
assert "cache" in inspect.signature(ModularPipeline.__call__).parameters
gradpatch.revert()
assert "cache" not in inspect.signature(ModularPipeline.__call__).parameters
assert "__init_subclass__" not in vars(ModularPipelineBlocks)
assert "__gradpatch_original__" not in vars(StableDiffusionPipeline.__call__)
assert "__init_subclass__" not in vars(DiffusionPipeline)
print("ok")
"""


@pytest.mark.slow
def test_applied_when_diffusers_is_imported_later():
    """apply() before diffusers is imported: the pipeline module is patched the moment it loads."""
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADPATCH="0", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", DEFERRED], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
