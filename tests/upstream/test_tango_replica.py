"""Tango's ``AudioDiffusion.inference`` (GitHub only): the declared fix on a replica of its sampler.

``patches/tango.py`` documents the opt-in (``gradpatch.differentiable("models:AudioDiffusion.inference",
step="unet", steps="num_steps")``; ``models`` is too generic a name to declare). The replica keeps its
shape: ``@torch.no_grad()``; prompt embeddings for classifier-free guidance from a frozen text encoder
under an in-body ``with torch.no_grad():``; a diffusers scheduler loop over ``num_steps`` with one
CFG-batched ``self.unet`` call and ``inference_scheduler.step`` per step. Real diffusers parts: a tiny
``UNet2DConditionModel``, a ``CLIPTextModel`` standing in for FLAN-T5, ``DDIMScheduler``. Compared
with the same loop written by hand without the decorator.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import gradpatch  # noqa: E402
from gradpatch.patching import catalogue  # noqa: E402
from gradpatch.patching.activation import known_patches  # noqa: E402
from gradpatch.testing import reinit_zero_weights  # noqa: E402
from support import assert_grads_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
STEPS = 3


class AudioDiffusion(torch.nn.Module):
    def __init__(self, unet, text_encoder) -> None:
        super().__init__()
        self.unet, self.text_encoder = unet, text_encoder

    def tokenizer(self, prompt, max_length=6, **kwargs):
        ids = torch.tensor([[3 + ord(ch) % 90 for ch in text[:max_length]] + [1] * (max_length - len(text[:max_length]))
                            for text in prompt])
        return SimpleNamespace(input_ids=ids, attention_mask=(ids != 1).long())

    def prepare_latents(self, batch_size, inference_scheduler, num_channels_latents, dtype, device):
        latents = torch.randn((batch_size, num_channels_latents, 8, 8), device=device, dtype=dtype)
        return latents * inference_scheduler.init_noise_sigma

    def encode_text_classifier_free(self, prompt, num_samples_per_prompt):
        batch = self.tokenizer(prompt)
        with torch.no_grad():
            prompt_embeds = self.text_encoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask)[0]
        uncond = self.tokenizer([""] * len(prompt))
        with torch.no_grad():
            negative = self.text_encoder(input_ids=uncond.input_ids, attention_mask=uncond.attention_mask)[0]
        embeds = torch.cat([negative, prompt_embeds]).repeat_interleave(num_samples_per_prompt, 0)
        mask = torch.cat([uncond.attention_mask, batch.attention_mask]).repeat_interleave(num_samples_per_prompt, 0)
        return embeds, mask.bool()

    @torch.no_grad()
    def inference(self, prompt, inference_scheduler, num_steps=20, guidance_scale=3, num_samples_per_prompt=1,
                  disable_progress=True):
        batch_size = len(prompt) * num_samples_per_prompt
        prompt_embeds, boolean_prompt_mask = self.encode_text_classifier_free(prompt, num_samples_per_prompt)
        inference_scheduler.set_timesteps(num_steps)
        timesteps = inference_scheduler.timesteps
        latents = self.prepare_latents(batch_size, inference_scheduler, self.unet.config.in_channels,
                                       prompt_embeds.dtype, None)
        for i, t in enumerate(timesteps):
            latent_model_input = torch.cat([latents] * 2)
            latent_model_input = inference_scheduler.scale_model_input(latent_model_input, t)
            noise_pred = self.unet(latent_model_input, t, encoder_hidden_states=prompt_embeds,
                                   encoder_attention_mask=boolean_prompt_mask).sample
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
            latents = inference_scheduler.step(noise_pred, t, latents).prev_sample
        return latents


def _setup():
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
                                norm_num_groups=4, attention_head_dim=4)
    text = CLIPTextModel(CLIPTextConfig(bos_token_id=0, eos_token_id=2, pad_token_id=1, hidden_size=16,
                                        intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
                                        vocab_size=100, projection_dim=16)).requires_grad_(False)
    return AudioDiffusion(reinit_zero_weights(unet, std=0.05), text).eval()


def _scheduler():
    from diffusers import DDIMScheduler

    return DDIMScheduler(clip_sample=False, set_alpha_to_one=False, steps_offset=1)


def reference(model, prompt, first, guidance_scale=3.0):
    scheduler = _scheduler()
    embeds, mask = model.encode_text_classifier_free(prompt, 1)
    scheduler.set_timesteps(STEPS)
    latents = model.prepare_latents(len(prompt), scheduler, 4, embeds.dtype, None)
    for i, t in enumerate(scheduler.timesteps):
        latents = latents.detach() if i == first else latents
        pred = model.unet(scheduler.scale_model_input(torch.cat([latents] * 2), t), t, encoder_hidden_states=embeds,
                          encoder_attention_mask=mask).sample
        uncond, text = pred.chunk(2)
        latents = scheduler.step(uncond + guidance_scale * (text - uncond), t, latents).prev_sample
    return latents


@pytest.fixture
def patched():
    """The opt-in line ``patches/tango.py`` documents, on the replica's module."""
    tango = __import__(f"{catalogue.builtin_package().__name__}.tango", fromlist=["FIX"])
    original = vars(AudioDiffusion)["inference"]
    record = gradpatch.differentiable(f"{__name__}:AudioDiffusion.inference", step="unet", steps="num_steps")
    assert record.status.value == "applied" and known_patches()[record.patch].fix == tango.FIX
    yield
    gradpatch.revert(record.patch)
    assert vars(AudioDiffusion)["inference"] is original


def _grads(out, model):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return torch.autograd.grad((out * weight).sum(), list(model.unet.parameters()), allow_unused=True)


def test_upstream_gives_no_graph():
    model = _setup()
    assert not model.inference(["a dog barks"], _scheduler(), num_steps=STEPS).requires_grad


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2}, {"checkpoint_steps": True}],
                         ids=["plain", "grad_steps=1", "grad_steps=2", "checkpoint_steps"])
def test_declared_fix_gives_the_hand_fixed_gradients(patched, options):
    model = _setup()
    torch.manual_seed(3)
    got = _grads(model.inference(["a dog barks"], _scheduler(), num_steps=STEPS, cache=False, **options), model)
    torch.manual_seed(3)
    first = STEPS - options["grad_steps"] if "grad_steps" in options else -1
    want = _grads(reference(model, ["a dog barks"], first), model)
    assert_grads_close(got, want)
    if not options:
        assert sum(w is not None and bool(w.any()) for w in want) > 0.7 * len(want)
