"""ControlNet's own package ``cldm`` (lllyasviel/ControlNet, GitHub only): the declared fixes on a replica.

``patches/controlnet.py`` recognises ``cldm.ddim_hacked:DDIMSampler`` (``register_buffer``, ``sample``,
``ddim_sampling``, ``p_sample_ddim``, ...) and ``cldm.cldm:ControlLDM.sample_log`` (with ``get_input``,
...) by fingerprints from lllyasviel/ControlNet@ed85cd1. No installable package carries ``cldm``, so the
test writes a replica package ``cldm`` (below, written to a temporary directory and imported from there)
whose declared methods are upstream's source verbatim: ``DDIMSampler.__init__`` to ``p_sample_ddim``
of ``cldm/ddim_hacked.py`` (``register_buffer`` moving every buffer to CUDA; guidance by two
``apply_model`` calls per step; ``encode``, ``stochastic_encode`` and ``decode`` left out, their patches
fail as expected) and ``ControlLDM`` of ``cldm/cldm.py`` from ``__init__`` to ``sample_log`` (its four
declared methods, all recognised; one it only inherited would be skipped as unknown code). ``ControlLDM``
subclasses the real SD2 ``LatentDiffusion`` of stable-diffusion-sdkit's ``ldm`` (ControlNet's own
``ldm`` is a copy of SD2's), and ``sample_log`` uses that package's
``DDIMSampler``, as upstream; the locked UNet (its encoder run under ``torch.no_grad()``, the control
residuals added to the middle block and the skip) and the control network are tiny stand-ins.

In float64, with classifier-free guidance and ``eta > 0``: upstream builds no graph (and, on a machine
without CUDA, its ``register_buffer`` fails); with ``gradpatch.applied("controlnet")`` (``"ldm"`` too
for ``sample_log``, whose sampler is ``ldm``'s), ``cache=True`` is upstream bit for bit and
``cache=False`` gives the gradients, over every parameter of the UNet and the control network and the
hint and text conditioning, of the same methods with their ``@torch.no_grad()`` removed by hand.
"""
from __future__ import annotations

import contextlib
import importlib
import sys

import pytest

torch = pytest.importorskip("torch")

import gradpatch  # noqa: E402
from support import assert_grads_close, weighted_grads  # noqa: E402
from ldm_reference import cpu_buffers, first_calls_without_grad, replaced, undecorated  # noqa: E402

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.filterwarnings(
    "ignore:gradpatch. patch 'controlnet.DDIMSampler.(encode|decode|stochastic_encode)' failed")]
STEPS, BATCH, SCALE, ETA = 4, 2, 3.0, 0.5  # 1000 % STEPS == 0: make_ddim_timesteps stays in range
LATENT = (4, 4, 4)  # sample_log: (channels, hint height // 8, hint width // 8)

#: ``cldm/ddim_hacked.py``: upstream's imports and ``DDIMSampler`` up to ``p_sample_ddim``, verbatim.
DDIM_HACKED = r'''# lllyasviel/ControlNet@ed85cd1 cldm/ddim_hacked.py: its imports and DDIMSampler up to p_sample_ddim,
# verbatim (encode, stochastic_encode and decode left out).
import torch
import numpy as np
from tqdm import tqdm

from ldm.modules.diffusionmodules.util import make_ddim_sampling_parameters, make_ddim_timesteps, noise_like, extract_into_tensor


class DDIMSampler(object):
    def __init__(self, model, schedule="linear", **kwargs):
        super().__init__()
        self.model = model
        self.ddpm_num_timesteps = model.num_timesteps
        self.schedule = schedule

    def register_buffer(self, name, attr):
        if type(attr) == torch.Tensor:
            if attr.device != torch.device("cuda"):
                attr = attr.to(torch.device("cuda"))
        setattr(self, name, attr)

    def make_schedule(self, ddim_num_steps, ddim_discretize="uniform", ddim_eta=0., verbose=True):
        self.ddim_timesteps = make_ddim_timesteps(ddim_discr_method=ddim_discretize, num_ddim_timesteps=ddim_num_steps,
                                                  num_ddpm_timesteps=self.ddpm_num_timesteps,verbose=verbose)
        alphas_cumprod = self.model.alphas_cumprod
        assert alphas_cumprod.shape[0] == self.ddpm_num_timesteps, 'alphas have to be defined for each timestep'
        to_torch = lambda x: x.clone().detach().to(torch.float32).to(self.model.device)

        self.register_buffer('betas', to_torch(self.model.betas))
        self.register_buffer('alphas_cumprod', to_torch(alphas_cumprod))
        self.register_buffer('alphas_cumprod_prev', to_torch(self.model.alphas_cumprod_prev))

        # calculations for diffusion q(x_t | x_{t-1}) and others
        self.register_buffer('sqrt_alphas_cumprod', to_torch(np.sqrt(alphas_cumprod.cpu())))
        self.register_buffer('sqrt_one_minus_alphas_cumprod', to_torch(np.sqrt(1. - alphas_cumprod.cpu())))
        self.register_buffer('log_one_minus_alphas_cumprod', to_torch(np.log(1. - alphas_cumprod.cpu())))
        self.register_buffer('sqrt_recip_alphas_cumprod', to_torch(np.sqrt(1. / alphas_cumprod.cpu())))
        self.register_buffer('sqrt_recipm1_alphas_cumprod', to_torch(np.sqrt(1. / alphas_cumprod.cpu() - 1)))

        # ddim sampling parameters
        ddim_sigmas, ddim_alphas, ddim_alphas_prev = make_ddim_sampling_parameters(alphacums=alphas_cumprod.cpu(),
                                                                                   ddim_timesteps=self.ddim_timesteps,
                                                                                   eta=ddim_eta,verbose=verbose)
        self.register_buffer('ddim_sigmas', ddim_sigmas)
        self.register_buffer('ddim_alphas', ddim_alphas)
        self.register_buffer('ddim_alphas_prev', ddim_alphas_prev)
        self.register_buffer('ddim_sqrt_one_minus_alphas', np.sqrt(1. - ddim_alphas))
        sigmas_for_original_sampling_steps = ddim_eta * torch.sqrt(
            (1 - self.alphas_cumprod_prev) / (1 - self.alphas_cumprod) * (
                        1 - self.alphas_cumprod / self.alphas_cumprod_prev))
        self.register_buffer('ddim_sigmas_for_original_num_steps', sigmas_for_original_sampling_steps)

    @torch.no_grad()
    def sample(self,
               S,
               batch_size,
               shape,
               conditioning=None,
               callback=None,
               normals_sequence=None,
               img_callback=None,
               quantize_x0=False,
               eta=0.,
               mask=None,
               x0=None,
               temperature=1.,
               noise_dropout=0.,
               score_corrector=None,
               corrector_kwargs=None,
               verbose=True,
               x_T=None,
               log_every_t=100,
               unconditional_guidance_scale=1.,
               unconditional_conditioning=None, # this has to come in the same format as the conditioning, # e.g. as encoded tokens, ...
               dynamic_threshold=None,
               ucg_schedule=None,
               **kwargs
               ):
        if conditioning is not None:
            if isinstance(conditioning, dict):
                ctmp = conditioning[list(conditioning.keys())[0]]
                while isinstance(ctmp, list): ctmp = ctmp[0]
                cbs = ctmp.shape[0]
                if cbs != batch_size:
                    print(f"Warning: Got {cbs} conditionings but batch-size is {batch_size}")

            elif isinstance(conditioning, list):
                for ctmp in conditioning:
                    if ctmp.shape[0] != batch_size:
                        print(f"Warning: Got {cbs} conditionings but batch-size is {batch_size}")

            else:
                if conditioning.shape[0] != batch_size:
                    print(f"Warning: Got {conditioning.shape[0]} conditionings but batch-size is {batch_size}")

        self.make_schedule(ddim_num_steps=S, ddim_eta=eta, verbose=verbose)
        # sampling
        C, H, W = shape
        size = (batch_size, C, H, W)
        print(f'Data shape for DDIM sampling is {size}, eta {eta}')

        samples, intermediates = self.ddim_sampling(conditioning, size,
                                                    callback=callback,
                                                    img_callback=img_callback,
                                                    quantize_denoised=quantize_x0,
                                                    mask=mask, x0=x0,
                                                    ddim_use_original_steps=False,
                                                    noise_dropout=noise_dropout,
                                                    temperature=temperature,
                                                    score_corrector=score_corrector,
                                                    corrector_kwargs=corrector_kwargs,
                                                    x_T=x_T,
                                                    log_every_t=log_every_t,
                                                    unconditional_guidance_scale=unconditional_guidance_scale,
                                                    unconditional_conditioning=unconditional_conditioning,
                                                    dynamic_threshold=dynamic_threshold,
                                                    ucg_schedule=ucg_schedule
                                                    )
        return samples, intermediates

    @torch.no_grad()
    def ddim_sampling(self, cond, shape,
                      x_T=None, ddim_use_original_steps=False,
                      callback=None, timesteps=None, quantize_denoised=False,
                      mask=None, x0=None, img_callback=None, log_every_t=100,
                      temperature=1., noise_dropout=0., score_corrector=None, corrector_kwargs=None,
                      unconditional_guidance_scale=1., unconditional_conditioning=None, dynamic_threshold=None,
                      ucg_schedule=None):
        device = self.model.betas.device
        b = shape[0]
        if x_T is None:
            img = torch.randn(shape, device=device)
        else:
            img = x_T

        if timesteps is None:
            timesteps = self.ddpm_num_timesteps if ddim_use_original_steps else self.ddim_timesteps
        elif timesteps is not None and not ddim_use_original_steps:
            subset_end = int(min(timesteps / self.ddim_timesteps.shape[0], 1) * self.ddim_timesteps.shape[0]) - 1
            timesteps = self.ddim_timesteps[:subset_end]

        intermediates = {'x_inter': [img], 'pred_x0': [img]}
        time_range = reversed(range(0,timesteps)) if ddim_use_original_steps else np.flip(timesteps)
        total_steps = timesteps if ddim_use_original_steps else timesteps.shape[0]
        print(f"Running DDIM Sampling with {total_steps} timesteps")

        iterator = tqdm(time_range, desc='DDIM Sampler', total=total_steps)

        for i, step in enumerate(iterator):
            index = total_steps - i - 1
            ts = torch.full((b,), step, device=device, dtype=torch.long)

            if mask is not None:
                assert x0 is not None
                img_orig = self.model.q_sample(x0, ts)  # TODO: deterministic forward pass?
                img = img_orig * mask + (1. - mask) * img

            if ucg_schedule is not None:
                assert len(ucg_schedule) == len(time_range)
                unconditional_guidance_scale = ucg_schedule[i]

            outs = self.p_sample_ddim(img, cond, ts, index=index, use_original_steps=ddim_use_original_steps,
                                      quantize_denoised=quantize_denoised, temperature=temperature,
                                      noise_dropout=noise_dropout, score_corrector=score_corrector,
                                      corrector_kwargs=corrector_kwargs,
                                      unconditional_guidance_scale=unconditional_guidance_scale,
                                      unconditional_conditioning=unconditional_conditioning,
                                      dynamic_threshold=dynamic_threshold)
            img, pred_x0 = outs
            if callback: callback(i)
            if img_callback: img_callback(pred_x0, i)

            if index % log_every_t == 0 or index == total_steps - 1:
                intermediates['x_inter'].append(img)
                intermediates['pred_x0'].append(pred_x0)

        return img, intermediates

    @torch.no_grad()
    def p_sample_ddim(self, x, c, t, index, repeat_noise=False, use_original_steps=False, quantize_denoised=False,
                      temperature=1., noise_dropout=0., score_corrector=None, corrector_kwargs=None,
                      unconditional_guidance_scale=1., unconditional_conditioning=None,
                      dynamic_threshold=None):
        b, *_, device = *x.shape, x.device

        if unconditional_conditioning is None or unconditional_guidance_scale == 1.:
            model_output = self.model.apply_model(x, t, c)
        else:
            model_t = self.model.apply_model(x, t, c)
            model_uncond = self.model.apply_model(x, t, unconditional_conditioning)
            model_output = model_uncond + unconditional_guidance_scale * (model_t - model_uncond)

        if self.model.parameterization == "v":
            e_t = self.model.predict_eps_from_z_and_v(x, t, model_output)
        else:
            e_t = model_output

        if score_corrector is not None:
            assert self.model.parameterization == "eps", 'not implemented'
            e_t = score_corrector.modify_score(self.model, e_t, x, t, c, **corrector_kwargs)

        alphas = self.model.alphas_cumprod if use_original_steps else self.ddim_alphas
        alphas_prev = self.model.alphas_cumprod_prev if use_original_steps else self.ddim_alphas_prev
        sqrt_one_minus_alphas = self.model.sqrt_one_minus_alphas_cumprod if use_original_steps else self.ddim_sqrt_one_minus_alphas
        sigmas = self.model.ddim_sigmas_for_original_num_steps if use_original_steps else self.ddim_sigmas
        # select parameters corresponding to the currently considered timestep
        a_t = torch.full((b, 1, 1, 1), alphas[index], device=device)
        a_prev = torch.full((b, 1, 1, 1), alphas_prev[index], device=device)
        sigma_t = torch.full((b, 1, 1, 1), sigmas[index], device=device)
        sqrt_one_minus_at = torch.full((b, 1, 1, 1), sqrt_one_minus_alphas[index],device=device)

        # current prediction for x_0
        if self.model.parameterization != "v":
            pred_x0 = (x - sqrt_one_minus_at * e_t) / a_t.sqrt()
        else:
            pred_x0 = self.model.predict_start_from_z_and_v(x, t, model_output)

        if quantize_denoised:
            pred_x0, _, *_ = self.model.first_stage_model.quantize(pred_x0)

        if dynamic_threshold is not None:
            raise NotImplementedError()

        # direction pointing to x_t
        dir_xt = (1. - a_prev - sigma_t**2).sqrt() * e_t
        noise = sigma_t * noise_like(x.shape, device, repeat_noise) * temperature
        if noise_dropout > 0.:
            noise = torch.nn.functional.dropout(noise, p=noise_dropout)
        x_prev = a_prev.sqrt() * pred_x0 + dir_xt + noise
        return x_prev, pred_x0
'''

#: ``cldm/cldm.py``: upstream's imports, stand-in networks, ``ControlLDM`` from ``__init__`` to ``sample_log`` verbatim.
CLDM = r'''# lllyasviel/ControlNet@ed85cd1 cldm/cldm.py: its imports and ControlLDM up to sample_log, verbatim
# (configure_optimizers and low_vram_shift left out); ControlledUnetModel and ControlNet are tiny stand-ins.
import einops
import torch
import torch as th
import torch.nn as nn

from ldm.modules.diffusionmodules.util import (
    conv_nd,
    linear,
    zero_module,
    timestep_embedding,
)

from einops import rearrange, repeat
from torchvision.utils import make_grid
from ldm.modules.attention import SpatialTransformer
from ldm.modules.diffusionmodules.openaimodel import UNetModel, TimestepEmbedSequential, ResBlock, Downsample, AttentionBlock
from ldm.models.diffusion.ddpm import LatentDiffusion
from ldm.util import log_txt_as_img, exists, instantiate_from_config
from ldm.models.diffusion.ddim import DDIMSampler
import torch.nn.functional as F


def embed(x, timesteps, context, time_embed, text):
    return (time_embed(timesteps[:, None].to(x.dtype) / 1000) + text(context.mean(1)))[:, :, None, None]


class ControlledUnetModel(nn.Module):
    """Stand-in for the locked UNet: encoder under torch.no_grad(), control residuals added to the
    middle block's output and to the skip."""

    def __init__(self, in_channels=4, width=8, context_dim=16):
        super().__init__()
        self.time_embed, self.text = nn.Linear(1, width), nn.Linear(context_dim, width)
        self.input_block = nn.Conv2d(in_channels, width, 3, padding=1)
        self.middle_block = nn.Conv2d(width, width, 3, padding=1)
        self.output_block = nn.Conv2d(2 * width, width, 3, padding=1)
        self.out = nn.Conv2d(width, in_channels, 3, padding=1)

    def forward(self, x, timesteps=None, context=None, control=None, only_mid_control=False, **kwargs):
        with torch.no_grad():
            emb = embed(x, timesteps, context, self.time_embed, self.text)
            skip = F.silu(self.input_block(x) + emb)
            h = self.middle_block(skip)
        if control is not None:
            h += control.pop()
        if not (only_mid_control or control is None):
            skip = skip + control.pop()
        return self.out(F.silu(self.output_block(torch.cat([h, skip], 1)) + emb))


class ControlNet(nn.Module):
    """Stand-in for the control network: hint encoder (8x down), a trainable encoder, one output
    convolution per residual (upstream's zero convolutions, here randomly initialised)."""

    def __init__(self, in_channels=4, hint_channels=3, width=8, context_dim=16):
        super().__init__()
        self.time_embed, self.text = nn.Linear(1, width), nn.Linear(context_dim, width)
        self.input_hint_block = nn.Conv2d(hint_channels, width, 3, padding=1)
        self.input_block = nn.Conv2d(in_channels, width, 3, padding=1)
        self.middle_block = nn.Conv2d(width, width, 3, padding=1)
        self.zero_convs = nn.ModuleList([nn.Conv2d(width, width, 1), nn.Conv2d(width, width, 1)])

    def forward(self, x, hint, timesteps, context, **kwargs):
        guided_hint = self.input_hint_block(F.avg_pool2d(hint, 8))
        h = F.silu(self.input_block(x) + guided_hint + embed(x, timesteps, context, self.time_embed, self.text))
        return [self.zero_convs[0](h), self.zero_convs[1](F.silu(self.middle_block(h)))]


class ControlLDM(LatentDiffusion):

    def __init__(self, control_stage_config, control_key, only_mid_control, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.control_model = instantiate_from_config(control_stage_config)
        self.control_key = control_key
        self.only_mid_control = only_mid_control
        self.control_scales = [1.0] * 13

    @torch.no_grad()
    def get_input(self, batch, k, bs=None, *args, **kwargs):
        x, c = super().get_input(batch, self.first_stage_key, *args, **kwargs)
        control = batch[self.control_key]
        if bs is not None:
            control = control[:bs]
        control = control.to(self.device)
        control = einops.rearrange(control, 'b h w c -> b c h w')
        control = control.to(memory_format=torch.contiguous_format).float()
        return x, dict(c_crossattn=[c], c_concat=[control])

    def apply_model(self, x_noisy, t, cond, *args, **kwargs):
        assert isinstance(cond, dict)
        diffusion_model = self.model.diffusion_model

        cond_txt = torch.cat(cond['c_crossattn'], 1)

        if cond['c_concat'] is None:
            eps = diffusion_model(x=x_noisy, timesteps=t, context=cond_txt, control=None, only_mid_control=self.only_mid_control)
        else:
            control = self.control_model(x=x_noisy, hint=torch.cat(cond['c_concat'], 1), timesteps=t, context=cond_txt)
            control = [c * scale for c, scale in zip(control, self.control_scales)]
            eps = diffusion_model(x=x_noisy, timesteps=t, context=cond_txt, control=control, only_mid_control=self.only_mid_control)

        return eps

    @torch.no_grad()
    def get_unconditional_conditioning(self, N):
        return self.get_learned_conditioning([""] * N)

    @torch.no_grad()
    def log_images(self, batch, N=4, n_row=2, sample=False, ddim_steps=50, ddim_eta=0.0, return_keys=None,
                   quantize_denoised=True, inpaint=True, plot_denoise_rows=False, plot_progressive_rows=True,
                   plot_diffusion_rows=False, unconditional_guidance_scale=9.0, unconditional_guidance_label=None,
                   use_ema_scope=True,
                   **kwargs):
        use_ddim = ddim_steps is not None

        log = dict()
        z, c = self.get_input(batch, self.first_stage_key, bs=N)
        c_cat, c = c["c_concat"][0][:N], c["c_crossattn"][0][:N]
        N = min(z.shape[0], N)
        n_row = min(z.shape[0], n_row)
        log["reconstruction"] = self.decode_first_stage(z)
        log["control"] = c_cat * 2.0 - 1.0
        log["conditioning"] = log_txt_as_img((512, 512), batch[self.cond_stage_key], size=16)

        if plot_diffusion_rows:
            # get diffusion row
            diffusion_row = list()
            z_start = z[:n_row]
            for t in range(self.num_timesteps):
                if t % self.log_every_t == 0 or t == self.num_timesteps - 1:
                    t = repeat(torch.tensor([t]), '1 -> b', b=n_row)
                    t = t.to(self.device).long()
                    noise = torch.randn_like(z_start)
                    z_noisy = self.q_sample(x_start=z_start, t=t, noise=noise)
                    diffusion_row.append(self.decode_first_stage(z_noisy))

            diffusion_row = torch.stack(diffusion_row)  # n_log_step, n_row, C, H, W
            diffusion_grid = rearrange(diffusion_row, 'n b c h w -> b n c h w')
            diffusion_grid = rearrange(diffusion_grid, 'b n c h w -> (b n) c h w')
            diffusion_grid = make_grid(diffusion_grid, nrow=diffusion_row.shape[0])
            log["diffusion_row"] = diffusion_grid

        if sample:
            # get denoise row
            samples, z_denoise_row = self.sample_log(cond={"c_concat": [c_cat], "c_crossattn": [c]},
                                                     batch_size=N, ddim=use_ddim,
                                                     ddim_steps=ddim_steps, eta=ddim_eta)
            x_samples = self.decode_first_stage(samples)
            log["samples"] = x_samples
            if plot_denoise_rows:
                denoise_grid = self._get_denoise_row_from_list(z_denoise_row)
                log["denoise_row"] = denoise_grid

        if unconditional_guidance_scale > 1.0:
            uc_cross = self.get_unconditional_conditioning(N)
            uc_cat = c_cat  # torch.zeros_like(c_cat)
            uc_full = {"c_concat": [uc_cat], "c_crossattn": [uc_cross]}
            samples_cfg, _ = self.sample_log(cond={"c_concat": [c_cat], "c_crossattn": [c]},
                                             batch_size=N, ddim=use_ddim,
                                             ddim_steps=ddim_steps, eta=ddim_eta,
                                             unconditional_guidance_scale=unconditional_guidance_scale,
                                             unconditional_conditioning=uc_full,
                                             )
            x_samples_cfg = self.decode_first_stage(samples_cfg)
            log[f"samples_cfg_scale_{unconditional_guidance_scale:.2f}"] = x_samples_cfg

        return log

    @torch.no_grad()
    def sample_log(self, cond, batch_size, ddim, ddim_steps, **kwargs):
        ddim_sampler = DDIMSampler(self)
        b, c, h, w = cond["c_concat"][0].shape
        shape = (self.channels, h // 8, w // 8)
        samples, intermediates = ddim_sampler.sample(ddim_steps, batch_size, shape, cond, verbose=False, **kwargs)
        return samples, intermediates
'''


@pytest.fixture(scope="module")
def cldm(tmp_path_factory):
    """The replica package ``cldm`` (modules ``cldm.ddim_hacked``, ``cldm.cldm``), importable while the
    module's tests run."""
    root = tmp_path_factory.mktemp("controlnet")
    (root / "cldm").mkdir()
    (root / "cldm" / "__init__.py").write_text("")
    (root / "cldm" / "ddim_hacked.py").write_text(DDIM_HACKED)
    (root / "cldm" / "cldm.py").write_text(CLDM)
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("cldm.ddim_hacked"), importlib.import_module("cldm.cldm")
    finally:
        sys.path.remove(str(root))
        for name in ("cldm.cldm", "cldm.ddim_hacked", "cldm"):
            sys.modules.pop(name, None)


def _setup(cldm_module):
    """A tiny ControlLDM (cldm_v15.yaml's settings, stand-in networks), float64, eval; its conditioning
    (hint image at 8x the latent size, 3-token text context) and the unconditional one (upstream's
    ``log_images``: the same hint, another context)."""
    torch.manual_seed(0)
    model = cldm_module.ControlLDM(
        control_stage_config={"target": "cldm.cldm.ControlNet"}, control_key="hint", only_mid_control=False,
        unet_config={"target": "cldm.cldm.ControlledUnetModel"}, first_stage_config={"target": "torch.nn.Identity"},
        cond_stage_config={"target": "torch.nn.Identity"}, linear_start=0.00085, linear_end=0.012, timesteps=1000,
        first_stage_key="jpg", cond_stage_key="txt", image_size=LATENT[1], channels=LATENT[0],
        cond_stage_trainable=False, conditioning_key="crossattn", scale_factor=0.18215, use_ema=False)
    model = model.double().eval()
    generator = torch.Generator().manual_seed(1)
    hint = torch.rand(BATCH, 3, 8 * LATENT[1], 8 * LATENT[2], generator=generator, dtype=torch.float64)
    text, other = (torch.randn(BATCH, 3, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    hint, text = hint.requires_grad_(), text.requires_grad_()
    cond = {"c_concat": [hint], "c_crossattn": [text]}
    uncond = {"c_concat": [hint], "c_crossattn": [other]}
    return model, cond, uncond


def _sample(model, cond, uncond, entry, sampler_class, **options):
    """``STEPS`` DDIM steps from a fixed start, guided, ``eta`` > 0 (the sampler's noise seeded)."""
    x_T = torch.randn((BATCH, *LATENT), generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    kwargs = dict(x_T=x_T, eta=ETA, unconditional_guidance_scale=SCALE, unconditional_conditioning=uncond, **options)
    torch.manual_seed(5)
    if entry == "sample_log":
        return model.sample_log(cond, BATCH, True, STEPS, **kwargs)[0]
    return sampler_class(model).sample(STEPS, BATCH, LATENT, cond, verbose=False, **kwargs)[0]


def _wrt(model, cond):
    return [*model.model.parameters(), *model.control_model.parameters(), cond["c_concat"][0], cond["c_crossattn"][0]]


def _samplers(entry, cldm):
    """The DDIMSampler class the entry point uses, and the methods to undecorate by hand for it."""
    ddim_hacked, cldm_cldm = cldm
    sampler = ddim_hacked.DDIMSampler if entry == "DDIMSampler.sample" else cldm_cldm.DDIMSampler
    methods = [(sampler, "sample"), (sampler, "ddim_sampling"), (sampler, "p_sample_ddim")]
    return sampler, methods + ([(cldm_cldm.ControlLDM, "sample_log")] if entry == "sample_log" else [])


def _upstream(entry, cldm, model, cond, uncond):
    """Unpatched upstream, on the CPU: ``cldm.ddim_hacked``'s CUDA buffers moved to the CPU by hand."""
    sampler, _ = _samplers(entry, cldm)
    if sampler.__module__ != "cldm.ddim_hacked":
        return _sample(model, cond, uncond, entry, sampler)
    instance = sampler(model)
    with cpu_buffers(instance):
        return _sample(model, cond, uncond, entry, lambda _: instance)


def _reference(entry, cldm, model, cond, uncond, grad_steps=None):
    """The same upstream methods with their ``@torch.no_grad()`` removed by hand; with ``grad_steps=K`` the
    first ``STEPS - K`` calls of ``p_sample_ddim`` (one per step) run under ``no_grad``."""
    sampler, methods = _samplers(entry, cldm)
    with contextlib.ExitStack() as stack:
        stack.enter_context(undecorated(methods))
        step = first_calls_without_grad(vars(sampler)["p_sample_ddim"], STEPS - (grad_steps or STEPS))
        stack.enter_context(replaced(sampler, "p_sample_ddim", step))
        if sampler.__module__ == "cldm.ddim_hacked":
            stack.enter_context(replaced(sampler, "register_buffer", lambda self, name, attr: setattr(
                self, name, attr.to("cpu") if isinstance(attr, torch.Tensor) else attr)))
        latent = _sample(model, cond, uncond, entry, sampler)
    assert step.calls[0] == STEPS
    return latent


def _codebases(entry):
    return ("controlnet", "ldm") if entry == "sample_log" else ("controlnet",)


ENTRIES = ["DDIMSampler.sample", "sample_log"]


def test_replica_is_recognised(cldm):
    """Every declared method the replica has is recognised (applied, not skipped as edited code)."""
    with gradpatch.applied("controlnet") as report:
        status = {record.patch: str(record.status) for record in report if record.upstream == "controlnet"}
    exercised = {f"controlnet.DDIMSampler.{name}" for name in
                 ("register_buffer", "sample", "ddim_sampling", "p_sample_ddim")} | {"controlnet.ControlLDM.sample_log"}
    assert {name: status.get(name) for name in exercised} == dict.fromkeys(exercised, "applied"), status


@pytest.mark.skipif(torch.cuda.is_available(), reason="upstream's forced-CUDA buffers run where CUDA exists")
def test_upstream_fails_on_cpu(cldm):
    model, cond, uncond = _setup(cldm[1])
    with pytest.raises((AssertionError, RuntimeError)):  # torch not compiled with CUDA / no CUDA device
        _sample(model, cond, uncond, "DDIMSampler.sample", cldm[0].DDIMSampler)


@pytest.mark.parametrize("entry", ENTRIES)
def test_upstream_gives_no_graph(cldm, entry):
    model, cond, uncond = _setup(cldm[1])
    with torch.enable_grad():
        latent = _upstream(entry, cldm, model, cond, uncond)
    assert not latent.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        latent.sum().backward()


@pytest.mark.parametrize("entry", ENTRIES)
def test_cache_true_is_upstream_bit_for_bit(cldm, entry):
    model, cond, uncond = _setup(cldm[1])
    with torch.enable_grad():
        want = _upstream(entry, cldm, model, cond, uncond)
        with gradpatch.applied(*_codebases(entry)):
            got = _sample(model, cond, uncond, entry, _samplers(entry, cldm)[0])
    assert torch.equal(got, want)
    assert got.grad_fn is None


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2}, {"checkpoint_steps": True}],
                         ids=["plain", "grad_steps=1", "grad_steps=2", "checkpoint_steps"])
def test_declared_fixes_give_the_hand_fixed_gradients(cldm, entry, options):
    model, cond, uncond = _setup(cldm[1])
    want = weighted_grads(_reference(entry, cldm, model, cond, uncond, options.get("grad_steps")), _wrt(model, cond))
    with gradpatch.applied(*_codebases(entry)):
        latent = _sample(model, cond, uncond, entry, _samplers(entry, cldm)[0], cache=False, **options)
        got = weighted_grads(latent, _wrt(model, cond))
    assert_grads_close(got, want, rtol=1e-10)
    # the locked encoder (under no_grad upstream) gets none; the control network, decoder and inputs do
    locked = {id(p) for p in [*model.model.diffusion_model.time_embed.parameters(),
                              *model.model.diffusion_model.text.parameters(),
                              *model.model.diffusion_model.input_block.parameters(),
                              *model.model.diffusion_model.middle_block.parameters()]}
    assert [g is None for g in want] == [id(t) in locked for t in _wrt(model, cond)]
    assert all(bool(g.any()) for g in want if g is not None)
