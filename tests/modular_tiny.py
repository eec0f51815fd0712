"""The tiny SDXL modular pipeline of tests/upstream/test_modular_pipelines.py (also a row of
tests/sampling/test_sampler_contract.py): real diffusers modular blocks, tiny random components (float64),
plus a prompt-adapter block (a ``torch.nn.Module`` component set with ``update_components``)."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel  # noqa: E402
from diffusers.modular_pipelines import (  # noqa: E402
    ComponentSpec, InputParam, ModularPipelineBlocks, OutputParam, SequentialPipelineBlocks)
from diffusers.modular_pipelines.stable_diffusion_xl import before_denoise, decoders, denoise  # noqa: E402
from diffusers.modular_pipelines.stable_diffusion_xl.modular_blocks_stable_diffusion_xl import (  # noqa: E402
    StableDiffusionXLBeforeDenoiseStep)

SEED, SCALE, SIZE = 0, 7.5, 16  # SCALE: the guider's default guidance_scale
TIME_IDS = [SIZE, SIZE, 0, 0, SIZE, SIZE]  # original size, crop corner, target size (SDXL's add_time_ids)


class PromptAdapterStep(ModularPipelineBlocks):
    """A block of this test (defined before ``apply()``): a residual adapter on both prompt embeddings."""

    model_name = "stable-diffusion-xl"

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [ComponentSpec("prompt_adapter", torch.nn.Module)]

    @property
    def inputs(self) -> list[InputParam]:
        return [InputParam("prompt_embeds", required=True), InputParam("negative_prompt_embeds")]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [OutputParam("prompt_embeds", kwargs_type="denoiser_input_fields"),
                OutputParam("negative_prompt_embeds", kwargs_type="denoiser_input_fields")]

    @torch.no_grad()
    def __call__(self, components, state):
        block_state = self.get_block_state(state)
        adapter = components.prompt_adapter
        block_state.prompt_embeds = block_state.prompt_embeds + adapter(block_state.prompt_embeds)
        block_state.negative_prompt_embeds = block_state.negative_prompt_embeds + adapter(
            block_state.negative_prompt_embeds)
        self.set_block_state(state, block_state)
        return components, state


def latent_shift_block() -> type:
    """A loop sub-block (called as ``block(components, block_state, i=i, t=t)``), defined when called."""

    class LatentShift(ModularPipelineBlocks):
        model_name = "stable-diffusion-xl"

        @property
        def expected_components(self) -> list[ComponentSpec]:
            return [ComponentSpec("latent_shift", torch.nn.Module)]

        @torch.no_grad()
        def __call__(self, components, block_state, i: int, t: int):
            block_state.scaled_latents = block_state.scaled_latents + components.latent_shift(block_state.scaled_latents)
            return components, block_state

    return LatentShift


class OnDevice:
    """``ModularPipeline.device`` reads ``.device`` of its first ``torch.nn.Module`` component, which
    diffusers' models have and plain torch modules do not."""

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device  # type: ignore[attr-defined]


class Adapter(OnDevice, torch.nn.Linear):
    pass


class PreNet(OnDevice, torch.nn.Conv2d):
    pass


def _reinit(*models: torch.nn.Module) -> None:
    with torch.no_grad():
        for model in models:
            for param in model.parameters():
                if param.dim() > 1 and not param.any():  # zero-initialised outputs: no gradient upstream
                    param.normal_(0, 0.05)


def build(shift: type | None = None, loop: type = denoise.StableDiffusionXLDenoiseStep):
    """A tiny SDXL modular pipeline (float64) and its trainable modules; ``shift``: a LatentShift class
    to run in the loop before the denoiser; ``loop``: the denoising step."""
    torch.manual_seed(SEED)
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
                                norm_num_groups=4, attention_head_dim=4, addition_embed_type="text_time",
                                addition_time_embed_dim=4, projection_class_embeddings_input_dim=16 + 6 * 4)
    vae = AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        norm_num_groups=4, sample_size=SIZE)
    adapter, pre = Adapter(16, 16), PreNet(4, 4, 1)
    for model in (unet, vae, adapter, pre):
        model.double()
    _reinit(unet, vae)
    if shift is not None:
        class ShiftedDenoiseStep(denoise.StableDiffusionXLDenoiseLoopWrapper):
            block_classes = [denoise.StableDiffusionXLLoopBeforeDenoiser, shift,
                             denoise.StableDiffusionXLLoopDenoiser, denoise.StableDiffusionXLLoopAfterDenoiser]
            block_names = ["before_denoiser", "shift", "denoiser", "after_denoiser"]

        loop = ShiftedDenoiseStep
    blocks = SequentialPipelineBlocks.from_blocks_dict({
        "input": before_denoise.StableDiffusionXLInputStep, "adapter": PromptAdapterStep,
        "before_denoise": StableDiffusionXLBeforeDenoiseStep, "denoise": loop,
        "decode": decoders.StableDiffusionXLDecodeStep})
    pipe = blocks.init_pipeline()
    pipe.update_components(unet=unet, vae=vae, prompt_adapter=adapter,
                           scheduler=DDIMScheduler(clip_sample=False, set_alpha_to_one=False, steps_offset=1),
                           **({"latent_shift": pre} if shift is not None else {}))
    pipe.set_progress_bar_config(disable=True)
    modules = dict(unet=unet, vae=vae, prompt_adapter=adapter, **({"latent_shift": pre} if shift is not None else {}))
    return pipe, modules


def embeds() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()
            for shape in ((1, 6, 16), (1, 6, 16), (1, 16), (1, 16))]


def call_kwargs(embeds: list[torch.Tensor], steps: int, seeded: bool = True) -> dict:
    """The pipeline's inputs; ``seeded``: a fresh generator (else the global RNG draws the noise)."""
    return dict(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], pooled_prompt_embeds=embeds[2],
                negative_pooled_prompt_embeds=embeds[3], height=SIZE, width=SIZE, num_inference_steps=steps,
                output_type="pt", output="images", **({"generator": torch.Generator().manual_seed(SEED)} if seeded else {}))
