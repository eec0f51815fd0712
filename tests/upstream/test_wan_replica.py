"""Wan2.2 (GitHub only) on a replica: ``WanT2V.generate`` and Wan-Animate's ``Generator.get_motion``.

``patches/wan.py`` recognises ``wan.text2video:WanT2V.generate`` (and the other pipelines' ``generate``)
and ``wan.modules.animate.motion_encoder:Generator.get_motion`` by fingerprints of
Wan-Video/Wan2.2@42bf4cf (2026-03-17). The replica below is a package ``wan`` written to a temporary
folder: ``WanT2V._prepare_model_for_timestep``, ``WanT2V.generate`` and ``Generator.get_motion`` as
upstream wrote them (with the imports their names resolve through, so the fingerprints are upstream's;
the engine recognises them), and, in place of upstream's modules, a tiny flow-matching Euler
scheduler under the solver names ``generate`` imports, tiny denoisers (high/low noise, switched at
``boundary``), a text embedding and a VAE, and a tiny motion encoder. The fixes are compared with the
same computation written by hand in float64 with grad on (CFG, the two experts, the Euler step; the
latent detached at the top of step N-K for ``grad_steps``; the motion encoder without checkpoint).
"""
from __future__ import annotations

import copy
import sys
import textwrap

import pytest
import torch

import gradpatch
from support import assert_grads_close

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.filterwarnings("ignore::UserWarning",
                                                                                   "ignore::FutureWarning")]

FM_SOLVERS = """
import numpy as np
import torch


def get_sampling_sigmas(sampling_steps, shift):
    sigma = np.linspace(1, 0, sampling_steps + 1)[:sampling_steps]
    return shift * sigma / (1 + (shift - 1) * sigma)


class FlowEuler:  # stands in for upstream's UniPC / DPM++ solvers: a first-order flow-matching step
    def __init__(self, num_train_timesteps=1000, shift=1, use_dynamic_shifting=False):
        self.num_train_timesteps = num_train_timesteps

    def set_timesteps(self, num_inference_steps=None, device=None, shift=1.0, sigmas=None):
        if sigmas is None:
            sigmas = get_sampling_sigmas(num_inference_steps, shift)
        self.sigmas = torch.tensor(list(sigmas) + [0.0], dtype=torch.float64)
        self.timesteps = (self.sigmas[:-1] * self.num_train_timesteps).to(torch.float32).to(device)
        self.index = 0

    def step(self, model_output, timestep, sample, return_dict=False, generator=None):
        i, self.index = self.index, self.index + 1
        return (sample + model_output * float(self.sigmas[i + 1] - self.sigmas[i]),)


FlowDPMSolverMultistepScheduler = FlowEuler


def retrieve_timesteps(scheduler, num_inference_steps=None, device=None, timesteps=None, sigmas=None, **kwargs):
    scheduler.set_timesteps(sigmas=sigmas, device=device)
    return scheduler.timesteps, len(scheduler.timesteps)
"""

FM_SOLVERS_UNIPC = """
from .fm_solvers import FlowEuler as FlowUniPCMultistepScheduler
"""

# Upstream's imports of the names generate uses, then its two methods as written at 42bf4cf.
TEXT2VIDEO = '''
import gc
import math
import random
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
from tqdm import tqdm

from .utils.fm_solvers import (
    FlowDPMSolverMultistepScheduler,
    get_sampling_sigmas,
    retrieve_timesteps,
)
from .utils.fm_solvers_unipc import FlowUniPCMultistepScheduler


class WanT2V:
    def _prepare_model_for_timestep(self, t, boundary, offload_model):
        r"""
        Prepares and returns the required model for the current timestep.

        Args:
            t (torch.Tensor):
                current timestep.
            boundary (`int`):
                The timestep threshold. If `t` is at or above this value,
                the `high_noise_model` is considered as the required model.
            offload_model (`bool`):
                A flag intended to control the offloading behavior.

        Returns:
            torch.nn.Module:
                The active model on the target device for the current timestep.
        """
        if t.item() >= boundary:
            required_model_name = 'high_noise_model'
            offload_model_name = 'low_noise_model'
        else:
            required_model_name = 'low_noise_model'
            offload_model_name = 'high_noise_model'
        if offload_model or self.init_on_cpu:
            if next(getattr(
                    self,
                    offload_model_name).parameters()).device.type == 'cuda':
                getattr(self, offload_model_name).to('cpu')
            if next(getattr(
                    self,
                    required_model_name).parameters()).device.type == 'cpu':
                getattr(self, required_model_name).to(self.device)
        return getattr(self, required_model_name)

    def generate(self,
                 input_prompt,
                 size=(1280, 720),
                 frame_num=81,
                 shift=5.0,
                 sample_solver='unipc',
                 sampling_steps=50,
                 guide_scale=5.0,
                 n_prompt="",
                 seed=-1,
                 offload_model=True):
        r"""
        Generates video frames from text prompt using diffusion process.

        Args:
            input_prompt (`str`):
                Text prompt for content generation
            size (`tuple[int]`, *optional*, defaults to (1280,720)):
                Controls video resolution, (width,height).
            frame_num (`int`, *optional*, defaults to 81):
                How many frames to sample from a video. The number should be 4n+1
            shift (`float`, *optional*, defaults to 5.0):
                Noise schedule shift parameter. Affects temporal dynamics
            sample_solver (`str`, *optional*, defaults to 'unipc'):
                Solver used to sample the video.
            sampling_steps (`int`, *optional*, defaults to 50):
                Number of diffusion sampling steps. Higher values improve quality but slow generation
            guide_scale (`float` or tuple[`float`], *optional*, defaults 5.0):
                Classifier-free guidance scale. Controls prompt adherence vs. creativity.
                If tuple, the first guide_scale will be used for low noise model and
                the second guide_scale will be used for high noise model.
            n_prompt (`str`, *optional*, defaults to ""):
                Negative prompt for content exclusion. If not given, use `config.sample_neg_prompt`
            seed (`int`, *optional*, defaults to -1):
                Random seed for noise generation. If -1, use random seed.
            offload_model (`bool`, *optional*, defaults to True):
                If True, offloads models to CPU during generation to save VRAM

        Returns:
            torch.Tensor:
                Generated video frames tensor. Dimensions: (C, N H, W) where:
                - C: Color channels (3 for RGB)
                - N: Number of frames (81)
                - H: Frame height (from size)
                - W: Frame width from size)
        """
        # preprocess
        guide_scale = (guide_scale, guide_scale) if isinstance(
            guide_scale, float) else guide_scale
        F = frame_num
        target_shape = (self.vae.model.z_dim, (F - 1) // self.vae_stride[0] + 1,
                        size[1] // self.vae_stride[1],
                        size[0] // self.vae_stride[2])

        seq_len = math.ceil((target_shape[2] * target_shape[3]) /
                            (self.patch_size[1] * self.patch_size[2]) *
                            target_shape[1] / self.sp_size) * self.sp_size

        if n_prompt == "":
            n_prompt = self.sample_neg_prompt
        seed = seed if seed >= 0 else random.randint(0, sys.maxsize)
        seed_g = torch.Generator(device=self.device)
        seed_g.manual_seed(seed)

        if not self.t5_cpu:
            self.text_encoder.model.to(self.device)
            context = self.text_encoder([input_prompt], self.device)
            context_null = self.text_encoder([n_prompt], self.device)
            if offload_model:
                self.text_encoder.model.cpu()
        else:
            context = self.text_encoder([input_prompt], torch.device('cpu'))
            context_null = self.text_encoder([n_prompt], torch.device('cpu'))
            context = [t.to(self.device) for t in context]
            context_null = [t.to(self.device) for t in context_null]

        noise = [
            torch.randn(
                target_shape[0],
                target_shape[1],
                target_shape[2],
                target_shape[3],
                dtype=torch.float32,
                device=self.device,
                generator=seed_g)
        ]

        @contextmanager
        def noop_no_sync():
            yield

        no_sync_low_noise = getattr(self.low_noise_model, 'no_sync',
                                    noop_no_sync)
        no_sync_high_noise = getattr(self.high_noise_model, 'no_sync',
                                     noop_no_sync)

        # evaluation mode
        with (
                torch.amp.autocast('cuda', dtype=self.param_dtype),
                torch.no_grad(),
                no_sync_low_noise(),
                no_sync_high_noise(),
        ):
            boundary = self.boundary * self.num_train_timesteps

            if sample_solver == 'unipc':
                sample_scheduler = FlowUniPCMultistepScheduler(
                    num_train_timesteps=self.num_train_timesteps,
                    shift=1,
                    use_dynamic_shifting=False)
                sample_scheduler.set_timesteps(
                    sampling_steps, device=self.device, shift=shift)
                timesteps = sample_scheduler.timesteps
            elif sample_solver == 'dpm++':
                sample_scheduler = FlowDPMSolverMultistepScheduler(
                    num_train_timesteps=self.num_train_timesteps,
                    shift=1,
                    use_dynamic_shifting=False)
                sampling_sigmas = get_sampling_sigmas(sampling_steps, shift)
                timesteps, _ = retrieve_timesteps(
                    sample_scheduler,
                    device=self.device,
                    sigmas=sampling_sigmas)
            else:
                raise NotImplementedError("Unsupported solver.")

            # sample videos
            latents = noise

            arg_c = {'context': context, 'seq_len': seq_len}
            arg_null = {'context': context_null, 'seq_len': seq_len}

            for _, t in enumerate(tqdm(timesteps)):
                latent_model_input = latents
                timestep = [t]

                timestep = torch.stack(timestep)

                model = self._prepare_model_for_timestep(
                    t, boundary, offload_model)
                sample_guide_scale = guide_scale[1] if t.item(
                ) >= boundary else guide_scale[0]

                noise_pred_cond = model(
                    latent_model_input, t=timestep, **arg_c)[0]
                noise_pred_uncond = model(
                    latent_model_input, t=timestep, **arg_null)[0]

                noise_pred = noise_pred_uncond + sample_guide_scale * (
                    noise_pred_cond - noise_pred_uncond)

                temp_x0 = sample_scheduler.step(
                    noise_pred.unsqueeze(0),
                    t,
                    latents[0].unsqueeze(0),
                    return_dict=False,
                    generator=seed_g)[0]
                latents = [temp_x0.squeeze(0)]

            x0 = latents
            if offload_model:
                self.low_noise_model.cpu()
                self.high_noise_model.cpu()
                torch.cuda.empty_cache()
            if self.rank == 0:
                videos = self.vae.decode(x0)

        del noise, latents
        del sample_scheduler
        if offload_model:
            gc.collect()
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()

        return videos[0] if self.rank == 0 else None
'''

MOTION_ENCODER = """
import torch
import torch.nn as nn


class Generator(nn.Module):
    def __init__(self, size=8, style_dim=6, motion_dim=4):
        super().__init__()
        self.enc = nn.Module()
        self.enc.enc_motion = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.Tanh(), nn.Flatten(),
                                            nn.Linear(64, motion_dim))  # 3x9x9 faces
        self.dec = nn.Module()
        self.dec.direction = nn.Linear(motion_dim, style_dim)

    def get_motion(self, img):
        #motion_feat = self.enc.enc_motion(img)
        motion_feat = torch.utils.checkpoint.checkpoint((self.enc.enc_motion), img, use_reentrant=True)
        with torch.cuda.amp.autocast(dtype=torch.float32):
            motion = self.dec.direction(motion_feat)
        return motion
"""
STEPS, SIZE, DIM, GUIDE = 3, (8, 8), 6, (1.5, 3.0)  # guide_scale: (low noise, high noise)


class Denoiser(torch.nn.Module):  # WanModel(x: list, t, context: list, seq_len) -> list
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.ctx, self.out = torch.nn.Conv3d(4, 8, 1), torch.nn.Linear(DIM, 8), torch.nn.Conv3d(8, 4, 1)

    def forward(self, x, t, context, seq_len, y=None):
        return [self.out(torch.tanh(self.inp(u[None]) + self.ctx(c.mean(0))[None, :, None, None, None]
                                    + t.view(-1, 1, 1, 1, 1) / 1000))[0] for u, c in zip(x, context)]


class TextEncoder:  # upstream's T5EncoderModel wrapper: __call__(texts, device) -> list of [L, DIM]
    def __init__(self) -> None:
        self.model = torch.nn.Embedding(128, DIM)

    def __call__(self, texts, device):
        return [self.model(torch.tensor([ord(c) % 128 for c in text], device=device)) for text in texts]


class VAE:  # upstream's Wan2_1_VAE: .model.z_dim, decode(list) -> list of videos
    def __init__(self) -> None:
        self.model = torch.nn.Conv3d(4, 3, 1)
        self.model.z_dim = 4

    def decode(self, zs):
        return [self.model(z[None])[0] for z in zs]


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("replica")
    for path, text in {"wan/__init__.py": "", "wan/utils/__init__.py": "", "wan/modules/__init__.py": "",
                       "wan/modules/animate/__init__.py": "", "wan/utils/fm_solvers.py": FM_SOLVERS,
                       "wan/utils/fm_solvers_unipc.py": FM_SOLVERS_UNIPC, "wan/text2video.py": TEXT2VIDEO,
                       "wan/modules/animate/motion_encoder.py": MOTION_ENCODER}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text) if path.endswith("fm_solvers.py") else text)
    sys.path.insert(0, str(root))
    try:
        import wan.modules.animate.motion_encoder
        import wan.text2video

        yield wan
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "wan" or m.startswith("wan.")]:
            del sys.modules[name]


def _pipeline(wan):
    torch.manual_seed(0)
    pipe = wan.text2video.WanT2V.__new__(wan.text2video.WanT2V)
    pipe.device, pipe.param_dtype, pipe.rank, pipe.sp_size, pipe.t5_cpu, pipe.init_on_cpu = \
        torch.device("cpu"), torch.float32, 0, 1, False, False
    pipe.num_train_timesteps, pipe.boundary, pipe.vae_stride, pipe.patch_size = 1000, 0.875, (4, 4, 4), (1, 2, 2)
    pipe.sample_neg_prompt = "blurry"
    pipe.high_noise_model, pipe.low_noise_model = Denoiser(), Denoiser()
    pipe.text_encoder, pipe.vae = TextEncoder(), VAE()
    return pipe


def _params(pipe):
    return [*pipe.high_noise_model.parameters(), *pipe.low_noise_model.parameters(),
            *pipe.text_encoder.model.parameters(), *pipe.vae.model.parameters()]


def _generate(pipe, **options):
    return pipe.generate("a cat", size=SIZE, frame_num=1, shift=5.0, sampling_steps=STEPS, guide_scale=GUIDE,
                         seed=0, offload_model=False, **options)


def _reference(pipe, grad_steps=None):
    """The loop by hand in float64: both experts, CFG per expert, the Euler step on the shifted schedule."""
    high, low = copy.deepcopy(pipe.high_noise_model).double(), copy.deepcopy(pipe.low_noise_model).double()
    embed, vae = copy.deepcopy(pipe.text_encoder.model).double(), copy.deepcopy(pipe.vae.model).double()
    context, null = ([embed(torch.tensor([ord(c) % 128 for c in text]))] for text in ("a cat", "blurry"))
    x = torch.randn(4, 1, 2, 2, generator=torch.Generator().manual_seed(0)).double()
    sigmas = [5.0 * s / (1 + 4.0 * s) for s in torch.linspace(1, 0, STEPS + 1, dtype=torch.float64)[:STEPS].tolist()]
    sigmas.append(0.0)
    for i in range(STEPS):
        if grad_steps is not None and i == STEPS - grad_steps:
            x = x.detach()
        t = torch.tensor([sigmas[i] * 1000], dtype=torch.float32)
        model, guide = (high, GUIDE[1]) if t.item() >= 875 else (low, GUIDE[0])
        cond, uncond = model([x], t.double(), context, 1)[0], model([x], t.double(), null, 1)[0]
        x = x + (uncond + guide * (cond - uncond)) * (sigmas[i + 1] - sigmas[i])
    return vae(x[None])[0], [*high.parameters(), *low.parameters(), *embed.parameters(), *vae.parameters()]


def _grads(out, params):
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return [None if g is None else g.double()
            for g in torch.autograd.grad((out * weights).sum(), params, allow_unused=True)]


def test_upstream_generate_gives_no_graph_and_takes_no_cache(wan):
    pipe = _pipeline(wan)
    assert _generate(pipe).grad_fn is None
    with pytest.raises(TypeError, match="cache"):
        _generate(pipe, cache=False)


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2, "checkpoint_steps": True},
                                     {"checkpoint_steps": True}])
def test_declared_fixes_give_the_hand_fixed_gradients(wan, options):
    pipe = _pipeline(wan)
    upstream = _generate(pipe)
    with gradpatch.applied("wan") as report:
        statuses = {r.patch: r.status for r in report}
        assert statuses["wan.WanT2V.generate"] == gradpatch.Status.APPLIED  # recognised by its fingerprint
        assert torch.equal(_generate(pipe), upstream)  # cache=True: upstream, bitwise
        out = _generate(pipe, cache=False, **options)
    want_out, want_params = _reference(pipe, options.get("grad_steps"))
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-6)
    want = _grads(want_out, want_params)
    if "grad_steps" not in options:  # both experts, the text embedding and the VAE
        assert all(w is not None for w in want)
    assert_grads_close(_grads(out, _params(pipe)), want, rtol=1e-4)


def test_grad_steps_counts_timesteps_not_evaluations(wan):
    """Two evaluations per step (CFG): grad_steps=N is the plain run, not a cut after N/2 steps."""
    pipe = _pipeline(wan)
    with gradpatch.applied("wan"):
        out = _generate(pipe, cache=False, grad_steps=STEPS)
        plain = _generate(pipe, cache=False)
    assert_grads_close(_grads(out, _params(pipe)), _grads(plain, _params(pipe)), rtol=1e-6)


def test_motion_encoder_parameters_get_gradients(wan):
    torch.manual_seed(0)
    gen = wan.modules.animate.motion_encoder.Generator()
    faces = torch.randn(2, 3, 9, 9)  # never requires grad
    params = list(gen.parameters())
    upstream = gen.get_motion(faces)  # reentrant checkpoint, no input requiring grad: enc_motion not in the graph
    encoder = list(gen.enc.enc_motion.parameters())
    assert _grads(upstream, encoder) == [None] * len(encoder)
    with gradpatch.applied("wan") as report:
        assert {r.patch: r.status for r in report}["wan.Generator.get_motion"] == gradpatch.Status.APPLIED
        out = gen.get_motion(faces)
    assert torch.equal(out, upstream)
    ref = copy.deepcopy(gen).double()
    want_out = ref.dec.direction(ref.enc.enc_motion(faces.double()))
    assert_grads_close(_grads(out, params), _grads(want_out, list(ref.parameters())), rtol=1e-4)
