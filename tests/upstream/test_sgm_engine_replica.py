"""sgm's ``DiffusionEngine`` (Stability-AI/generative-models, GitHub only): the declared fixes on a replica.

``patches/sgm.py`` recognises ``sgm.models.diffusion:DiffusionEngine.sample`` / ``decode_first_stage`` /
``encode_first_stage`` by fingerprints from the repository's history and declares
:func:`gradpatch.differentiable` for them. The replica has their shape: ``@torch.no_grad()`` methods;
``sample`` draws noise and hands a ``denoiser`` closure over ``self.denoiser(self.model, ...)`` to
``self.sampler`` (an EDM Euler loop over ``num_steps`` sigmas, classifier-free guidance batched in one
``self.model`` call); ``decode_first_stage`` rescales and decodes in chunks under ``torch.autocast("cuda")``.
The fixes are compared with the same computation written by hand without the decorators.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradpatch.patching.activation import known_patches  # noqa: E402
from gradpatch.patching.hooks import resolve  # noqa: E402
from support import assert_grads_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
C, H = 2, 4


class Network(torch.nn.Module):  # the DiffusionWrapper around a UNet: model(x, t, c)
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(C + 1, 8, 3, padding=1)
        self.out = torch.nn.Conv2d(8, C, 3, padding=1)

    def forward(self, x, t, c):
        h = self.conv(torch.cat([x, c["crossattn"].expand(-1, 1, H, H)], 1)) + t[:, None, None, None]
        return self.out(torch.nn.functional.silu(h))


class Denoiser(torch.nn.Module):  # sgm's EDM scalings
    def forward(self, network, input, sigma, cond):
        sigma = sigma.reshape(-1, 1, 1, 1)
        c_skip, c_out, c_in = 1 / (sigma ** 2 + 1), sigma / (sigma ** 2 + 1) ** 0.5, 1 / (sigma ** 2 + 1) ** 0.5
        return network(input * c_in, 0.25 * sigma.log().flatten(), cond) * c_out + input * c_skip


class EulerEDMSampler:  # one CFG-batched denoiser call per step, as sgm's EulerEDMSampler + VanillaCFG
    def __init__(self, num_steps, scale=2.0) -> None:
        self.num_steps, self.scale = num_steps, scale

    def __call__(self, denoiser, x, cond, uc=None, num_steps=None):
        sigmas = torch.linspace(2.0, 0.1, self.num_steps + 1)
        x = x * sigmas[0]
        for i in range(self.num_steps):
            c = {k: torch.cat([uc[k], cond[k]]) for k in cond}
            x_u, x_c = denoiser(torch.cat([x, x]), torch.cat([sigmas[i:i + 1]] * 2 * x.shape[0]), c).chunk(2)
            denoised = x_u + self.scale * (x_c - x_u)
            x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
        return x


class FirstStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = torch.nn.Conv2d(C, 3, 3, padding=1)
        self.encoder = torch.nn.Conv2d(3, C, 3, padding=1)

    def decode(self, z):
        return self.decoder(z)

    def encode(self, x):
        return self.encoder(x)


class DiffusionEngine(torch.nn.Module):
    def __init__(self, num_steps=3) -> None:
        super().__init__()
        self.model, self.denoiser, self.first_stage_model = Network(), Denoiser(), FirstStage()
        self.sampler, self.scale_factor, self.device = EulerEDMSampler(num_steps), 0.5, "cpu"
        self.en_and_decode_n_samples_a_time, self.disable_first_stage_autocast = 1, False

    @torch.no_grad()
    def decode_first_stage(self, z):
        z = 1.0 / self.scale_factor * z
        n_samples = self.en_and_decode_n_samples_a_time or z.shape[0]
        n_rounds = -(-z.shape[0] // n_samples)
        all_out = []
        with torch.autocast("cuda", enabled=not self.disable_first_stage_autocast):
            for n in range(n_rounds):
                all_out.append(self.first_stage_model.decode(z[n * n_samples:(n + 1) * n_samples]))
        return torch.cat(all_out, dim=0)

    @torch.no_grad()
    def sample(self, cond, uc=None, batch_size=16, shape=None, **kwargs):
        randn = torch.randn(batch_size, *shape).to(self.device)
        denoiser = lambda input, sigma, c: self.denoiser(self.model, input, sigma, c, **kwargs)  # noqa: E731
        return self.sampler(denoiser, randn, cond, uc=uc)


def reference(engine, cond, uc, first):
    """``sample`` then ``decode_first_stage``, undecorated, the latent entering step ``first`` detached."""
    sampler, x = engine.sampler, torch.randn(2, C, H, H)
    sigmas = torch.linspace(2.0, 0.1, sampler.num_steps + 1)
    x = x * sigmas[0]
    for i in range(sampler.num_steps):
        x = x.detach() if i == first else x
        c = {k: torch.cat([uc[k], cond[k]]) for k in cond}
        x_u, x_c = engine.denoiser(engine.model, torch.cat([x, x]), torch.cat([sigmas[i:i + 1]] * 4), c).chunk(2)
        x = x + (x - (x_u + sampler.scale * (x_c - x_u))) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return engine.first_stage_model.decode(x / engine.scale_factor)


@pytest.fixture
def patched():
    originals = {name: vars(DiffusionEngine)[name] for name in ("sample", "decode_first_stage")}
    for name, original in originals.items():
        patch = known_patches()[f"sgm.DiffusionEngine.{name}"]
        assert patch.target == f"sgm.models.diffusion:DiffusionEngine.{name}"
        setattr(DiffusionEngine, name, resolve(patch.fix)(original))
    yield
    for name, original in originals.items():
        setattr(DiffusionEngine, name, original)


def _setup():
    torch.manual_seed(0)
    engine = DiffusionEngine()
    generator = torch.Generator().manual_seed(1)
    cond = {"crossattn": torch.randn(2, 1, 1, 1, generator=generator).requires_grad_()}
    return engine, cond, {"crossattn": torch.zeros(2, 1, 1, 1)}


def _grads(out, engine, cond):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return torch.autograd.grad((out * weight).sum(), [cond["crossattn"], *engine.parameters()], allow_unused=True)


def test_upstream_gives_no_graph():
    engine, cond, uc = _setup()
    assert not engine.decode_first_stage(engine.sample(cond, uc, batch_size=2, shape=(C, H, H))).requires_grad


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2}, {"checkpoint_steps": True}],
                         ids=["plain", "grad_steps=1", "grad_steps=2", "checkpoint_steps"])
def test_declared_fixes_give_the_hand_fixed_gradients(patched, options):
    engine, cond, uc = _setup()
    torch.manual_seed(3)
    z = engine.sample(cond, uc, batch_size=2, shape=(C, H, H), cache=False, **options)
    got = _grads(engine.decode_first_stage(z, cache=False), engine, cond)
    torch.manual_seed(3)
    first = engine.sampler.num_steps - options["grad_steps"] if "grad_steps" in options else -1
    want = _grads(reference(engine, cond, uc, first), engine, cond)
    assert_grads_close(got, want)
    if not options:
        assert all(w.any() for w in want if w is not None) and want[0] is not None
