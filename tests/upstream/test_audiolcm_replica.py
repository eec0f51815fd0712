"""AudioLCM's ``LCMSampler`` and ``LCM_audio`` (GitHub only): the declared fixes on a replica.

``patches/audiolcm.py`` recognises ``ldm.models.diffusion.scheduling_lcm:LCMSampler.sample`` (with
``lcm_sampling`` and ``step``), ``LCMSampler.register_buffer``, and ``ldm.models.diffusion.lcm_audio:
LCM_audio.sample_log`` / ``decode_first_stage`` by fingerprints from the repositories' history. The
replica keeps their shape: every sampling method ``@torch.no_grad()``; ``register_buffer`` moving the
schedule to ``cuda``; LCM timesteps taken from a 50-step schedule over 1000 training steps; one
``model.apply_model(img, ts, cond, model.unet, w_cond=w_embedding)`` per step (guidance as an
embedding), then the consistency step (boundary scalings, noise between steps); ``sample_log`` builds
an ``LCMSampler`` and calls ``sample``; ``decode_first_stage`` rescales and decodes. The fixes are
compared with the same computation written by hand without the decorators.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradpatch.patching.activation import known_patches  # noqa: E402
from gradpatch.patching.hooks import resolve  # noqa: E402
from support import assert_grads_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
C, T, STEPS, EMBED = 2, 8, 3, 16


class UNet(torch.nn.Module):  # DiffusionWrapper(x, t, c_crossattn=[cond], w_cond=w)
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Conv1d(C, 8, 3, padding=1)
        self.w = torch.nn.Linear(EMBED, 8)
        self.ctx = torch.nn.Linear(4, 8)
        self.out = torch.nn.Conv1d(8, C, 3, padding=1)

    def forward(self, x, t, c_crossattn, w_cond=None):
        h = self.inp(x) + (self.w(w_cond) + self.ctx(c_crossattn[0].mean(1)))[:, :, None] + t[:, None, None] / 1000
        return self.out(torch.nn.functional.silu(h))


class LCM_audio(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_timesteps, self.channels, self.mel_dim, self.mel_length, self.scale_factor = 1000, 0, C, T, 0.5
        betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
        alphas_cumprod = torch.cumprod(1 - betas, 0)
        self.register_buffer("betas", betas.float())
        self.register_buffer("alphas_cumprod", alphas_cumprod.float())
        self.register_buffer("alphas_cumprod_prev", torch.cat([torch.ones(1), alphas_cumprod[:-1].float()]))
        self.unet = UNet()
        self.first_stage_model = torch.nn.Conv1d(C, 3, 1)

    @property
    def device(self):
        return self.betas.device

    def apply_model(self, x_noisy, t, cond, model, w_cond=None, return_ids=False):
        cond = {"c_crossattn": [cond]}
        x_recon = model(x_noisy, t, **cond, w_cond=w_cond)
        return x_recon[0] if isinstance(x_recon, tuple) and not return_ids else x_recon

    @torch.no_grad()
    def decode_first_stage(self, z, predict_cids=False, force_not_quantize=False):
        z = 1. / self.scale_factor * z
        return self.first_stage_model(z)

    @torch.no_grad()
    def sample_log(self, cond, batch_size, ddim, ddim_steps, **kwargs):
        lcm_sampler = LCMSampler(self)
        shape = (self.channels, self.mel_dim, self.mel_length) if self.channels > 0 else (self.mel_dim, self.mel_length)
        samples, intermediates = lcm_sampler.sample(ddim_steps, batch_size, shape, cond, verbose=False, **kwargs)
        return samples, intermediates


def guidance_embedding(w, embedding_dim, dtype=torch.float32):
    w = w * 1000.0
    half_dim = embedding_dim // 2
    emb = torch.log(torch.tensor(10000.0)) / (half_dim - 1)
    emb = torch.exp(torch.arange(half_dim, dtype=dtype) * -emb)
    emb = w.to(dtype)[:, None] * emb[None, :]
    return torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)


def lcm_timesteps(num_inference_steps, original_steps=50, ddpm_num_timesteps=1000):
    k = ddpm_num_timesteps // original_steps
    origin = (np.asarray(list(range(1, original_steps + 1))) * k - 1)[::-1].copy()
    return torch.from_numpy(origin[np.floor(np.linspace(0, len(origin), num=num_inference_steps,
                                                           endpoint=False)).astype(np.int64)]).long()


def consistency_step(alphas_cumprod, timesteps, index, model_output, sample):
    """``LCMSampler.step`` (epsilon prediction), as a function of the step index."""
    timestep = timesteps[index]
    prev_timestep = timesteps[index + 1] if index + 1 < len(timesteps) else timestep
    alpha_prod_t, alpha_prod_t_prev = alphas_cumprod[timestep], alphas_cumprod[prev_timestep]
    scaled = timestep * 10.0
    c_skip, c_out = 0.25 / (scaled ** 2 + 0.25), scaled / (scaled ** 2 + 0.25) ** 0.5
    denoised = c_out * (sample - (1 - alpha_prod_t).sqrt() * model_output) / alpha_prod_t.sqrt() + c_skip * sample
    if index != len(timesteps) - 1:
        noise = torch.randn(model_output.shape, device=model_output.device)
        return alpha_prod_t_prev.sqrt() * denoised + (1 - alpha_prod_t_prev).sqrt() * noise, denoised
    return denoised, denoised


class LCMSampler(object):
    def __init__(self, model, **kwargs):
        super().__init__()
        self.model = model
        self.ddpm_num_timesteps = model.num_timesteps

    def register_buffer(self, name, attr):
        if type(attr) == torch.Tensor:  # noqa: E721
            if attr.device != torch.device("cuda"):
                attr = attr.to(torch.device("cuda"))
        setattr(self, name, attr)

    def make_schedule(self, ddim_discretize="uniform", verbose=True):
        to_torch = lambda x: x.clone().detach().to(torch.float32).to(self.model.device)  # noqa: E731
        self.register_buffer('betas', to_torch(self.model.betas))
        self.register_buffer('alphas_cumprod', to_torch(self.model.alphas_cumprod))
        self.register_buffer('alphas_cumprod_prev', to_torch(self.model.alphas_cumprod_prev))

    @torch.no_grad()
    def sample(self, S, batch_size, shape, conditioning=None, callback=None, normals_sequence=None,
               img_callback=None, verbose=True, x_T=None, guidance_scale=5., original_inference_steps=50,
               timesteps=None, **kwargs):
        self.make_schedule(verbose=verbose)
        self.num_inference_steps = S
        C, T = shape
        samples, intermediates = self.lcm_sampling(conditioning, (batch_size, C, T), x_T=x_T,
                                                   guidance_scale=guidance_scale,
                                                   original_inference_steps=original_inference_steps)
        return samples, intermediates

    @torch.no_grad()
    def lcm_sampling(self, cond, shape, x_T=None, guidance_scale=1., original_inference_steps=100, timesteps=None):
        device = self.model.betas.device
        self.timesteps = timesteps = lcm_timesteps(self.num_inference_steps, original_inference_steps).to(device)
        self._step_index = None
        b = shape[0]
        img = torch.randn(shape, device=device) if x_T is None else x_T
        w = torch.tensor(guidance_scale - 1).repeat(b)
        w_embedding = guidance_embedding(w, embedding_dim=EMBED).to(device=device, dtype=img.dtype)
        for i, t in enumerate(timesteps):
            img = img.to(cond.dtype)
            ts = torch.full((b,), t, device=device, dtype=torch.long)
            model_pred = self.model.apply_model(img, ts, cond, self.model.unet, w_cond=w_embedding)
            img, denoised = self.step(model_pred, t, img, return_dict=False)
        return denoised, img

    @torch.no_grad()
    def step(self, model_output, timestep, sample, generator=None, return_dict=True):
        if self._step_index is None:
            self._step_index = int((self.timesteps == timestep).nonzero()[0])
        prev_sample, denoised = consistency_step(self.alphas_cumprod, self.timesteps, self._step_index,
                                                 model_output, sample)
        self._step_index += 1
        return (prev_sample, denoised)


def reference(model, cond, first):
    """``sample_log`` then ``decode_first_stage``, undecorated, the latent entering step ``first`` detached."""
    timesteps = lcm_timesteps(STEPS)
    img = torch.randn(cond.shape[0], C, T)
    w_embedding = guidance_embedding(torch.tensor(5. - 1).repeat(cond.shape[0]), EMBED)
    for i, t in enumerate(timesteps):
        img = img.detach() if i == first else img
        pred = model.apply_model(img, torch.full((cond.shape[0],), t, dtype=torch.long), cond, model.unet,
                                 w_cond=w_embedding)
        img, denoised = consistency_step(model.alphas_cumprod, timesteps, i, pred, img)
    return model.first_stage_model(denoised / model.scale_factor)


@pytest.fixture
def patched():
    targets = [(LCMSampler, "sample"), (LCMSampler, "register_buffer"), (LCM_audio, "sample_log"),
               (LCM_audio, "decode_first_stage")]
    originals = {(cls, name): vars(cls)[name] for cls, name in targets}
    for (cls, name), original in originals.items():
        patch = known_patches()[f"audiolcm.{cls.__name__}.{name}"]
        module = "scheduling_lcm" if cls is LCMSampler else "lcm_audio"
        assert patch.target == f"ldm.models.diffusion.{module}:{cls.__name__}.{name}"
        setattr(cls, name, resolve(patch.fix)(original))
    yield
    for (cls, name), original in originals.items():
        setattr(cls, name, original)


def _setup():
    torch.manual_seed(0)
    model = LCM_audio().eval()
    cond = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    return model, cond


def _grads(out, model, cond):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return torch.autograd.grad((out * weight).sum(), [cond, *model.parameters()], allow_unused=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="upstream's forced-CUDA buffers run where CUDA exists")
def test_upstream_fails_on_cpu():
    model, cond = _setup()
    with pytest.raises((AssertionError, RuntimeError)):  # torch not compiled with CUDA / no CUDA device
        model.sample_log(cond, 2, True, STEPS)


def test_upstream_gives_no_graph(patched):
    model, cond = _setup()
    samples, _ = model.sample_log(cond, 2, True, STEPS)  # buffers fixed, sampling as upstream (cache=True)
    assert not model.decode_first_stage(samples).requires_grad


@pytest.mark.parametrize("entry", ["sample_log", "LCMSampler.sample"])
@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2}, {"checkpoint_steps": True}],
                         ids=["plain", "grad_steps=1", "grad_steps=2", "checkpoint_steps"])
def test_declared_fixes_give_the_hand_fixed_gradients(patched, options, entry):
    model, cond = _setup()
    torch.manual_seed(3)
    if entry == "sample_log":
        z, _ = model.sample_log(cond, 2, True, STEPS, cache=False, **options)
    else:
        z, _ = LCMSampler(model).sample(STEPS, 2, (C, T), cond, verbose=False, cache=False, **options)
    got = _grads(model.decode_first_stage(z, cache=False), model, cond)
    torch.manual_seed(3)
    first = STEPS - options["grad_steps"] if "grad_steps" in options else -1
    want = _grads(reference(model, cond, first), model, cond)
    assert_grads_close(got, want)
    if not options:
        assert all(w is not None and w.any() for w in want)
