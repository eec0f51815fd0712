"""A tiny DiffSynth-Studio pipeline: a real pipeline class (``WanVideoPipeline``, ``ZImagePipeline``) whose
units, ``model_fn``, DiT, text embedding and VAE are tiny float64 modules, so that its own ``__call__``
body (scheduler, unit runner, denoising loop, CFG, VAE) runs on CPU in milliseconds."""
from __future__ import annotations

import torch
from diffsynth.diffusion.base_pipeline import PipelineUnit

C, H, W, D = 2, 4, 4, 8


class DiT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.ctx, self.out = torch.nn.Conv2d(C, D, 1), torch.nn.Linear(D, D), torch.nn.Conv2d(D, C, 1)

    def forward(self, x, t, context):
        h = self.inp(x) + self.ctx(context)[:, :, None, None] + t.view(-1, 1, 1, 1) / 1000
        return self.out(torch.tanh(h))


class Text(torch.nn.Module):  # a prompt -> one embedding
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, D)

    def forward(self, prompt: str):
        return self.embed(torch.tensor([ord(c) % 128 for c in prompt or " "])).mean(0, keepdim=True)


class VAE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(C, 3, 1)

    def forward(self, z):
        return self.conv(z)

    def decode(self, z, device=None, tiled=False, tile_size=None, tile_stride=None):
        return self(z[:, :, 0])[:, :, None]  # (B, C, T=1, H, W)


class Noise(PipelineUnit):
    def __init__(self, noise) -> None:
        super().__init__(input_params=("seed",), output_params=("latents",))
        self.noise = noise

    def process(self, pipe, seed):
        return {"latents": self.noise.clone()}


class Prompt(PipelineUnit):
    def __init__(self) -> None:
        super().__init__(seperate_cfg=True, input_params_posi={"prompt": "prompt"},
                         input_params_nega={"prompt": "negative_prompt"}, output_params=("context",))

    def process(self, pipe, prompt):
        return {"context": pipe.text(prompt)}


def model_fn(dit=None, latents=None, timestep=None, context=None, **kwargs):
    x = latents[:, :, 0] if latents.dim() == 5 else latents
    out = dit(x, timestep, context)
    return out[:, :, None] if latents.dim() == 5 else out


def pipeline(cls, video: bool):
    torch.manual_seed(0)
    pipe = cls(device="cpu", torch_dtype=torch.float64)
    pipe.dit, pipe.text, pipe.vae_decoder = DiT().double(), Text().double(), VAE().double()
    pipe.vae = pipe.vae_decoder
    noise = torch.randn((1, C, 1, H, W) if video else (1, C, H, W), dtype=torch.float64)
    pipe.units, pipe.post_units, pipe.model_fn = [Noise(noise), Prompt()], [], model_fn
    return pipe, noise



def call_kwargs(video: bool, steps: int = 4, cfg: float = 2.0) -> dict:
    """The keyword arguments of a call: a prompt and a negative one, CFG, no progress bar, a tensor output."""
    kwargs = dict(prompt="a cat", negative_prompt="blurry", num_inference_steps=steps, cfg_scale=cfg, seed=0,
                  progress_bar_cmd=lambda iterable: iterable)
    if video:
        kwargs.update(output_type="floatpoint", height=16, width=16, num_frames=1, tiled=False)
    return kwargs
