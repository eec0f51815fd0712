"""Foreign sampler code, one class per pattern that blocks gradients in the wild (issue 21's table), for
tests/sampling/test_differentiable.py. Written the way upstream writes it: no gradpatch here."""
from __future__ import annotations

import contextlib

import torch
import torch as th
from torch import nn


class Net(nn.Module):
    """A denoiser: ``v = tanh(W x + mu + t)``, with dropout."""

    def __init__(self, dim: int = 4, p: float = 0.0) -> None:
        super().__init__()
        self.l, self.drop = nn.Linear(dim, dim), nn.Dropout(p)
        self.modes: list[bool] = []

    def forward(self, x, mu, t=0.0):
        self.modes.append(self.training)
        return torch.tanh(self.drop(self.l(x)) + mu + t)


class EveryLevel(nn.Module):
    """denoising-diffusion-pytorch: every level decorated, a ``self.eval()``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    @torch.inference_mode()
    def p_sample(self, x, mu, i, steps):
        return x + self.model(x, mu, i / steps) / steps

    @torch.no_grad()
    def p_sample_loop(self, x, mu, steps):
        for i in range(steps):
            x = self.p_sample(x, mu, i, steps)
        return x

    @torch.inference_mode()
    def sample(self, x, mu, steps=3):
        self.eval()
        return self.p_sample_loop(x, mu, steps)


def eval_decorator(fn):
    """imagen-pytorch's: not functools.wraps-based."""
    def inner(model, *args, **kwargs):
        was_training = model.training
        model.eval()
        out = fn(model, *args, **kwargs)
        model.train(was_training)
        return out
    return inner


class Imagen(EveryLevel):
    @torch.no_grad()
    @eval_decorator
    def sample(self, x, mu, steps=3):
        return self.p_sample_loop(x, mu, steps)


class InBody(nn.Module):
    """An in-body ``with th.no_grad():`` around the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def sample(self, x, mu, steps=3):
        with th.no_grad():
            for i in range(steps):
                x = x + self.model(x, mu, i / steps) / steps
        return x


class Progressive(nn.Module):
    """guided-diffusion: ``with th.no_grad():`` around a ``yield``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def p_sample_loop_progressive(self, x, mu, steps=3):
        for i in range(steps):
            with th.no_grad():
                x = x + self.model(x, mu, i / steps) / steps
                yield x

    def p_sample_loop(self, x, mu, steps=3):
        final = None
        for sample in self.p_sample_loop_progressive(x, mu, steps):
            final = sample
        return final


class StopGradNet(Net):
    """A network with deliberate stop-gradients: they stay."""

    @torch.no_grad()
    def stats(self, x):
        return x.norm(dim=-1, keepdim=True) + 1.0

    def forward(self, x, mu, t=0.0):
        with torch.no_grad():
            scale = self.l(x).abs().mean() + 1.0
        return torch.tanh(self.l(x) / scale + mu + t) / self.stats(x)


class WithStopGrad(InBody):
    def __init__(self) -> None:
        super().__init__()
        self.model = StopGradNet()


class Buffers(nn.Module):
    """Chatterbox/CosyVoice ``solve_euler``: CFG buffers refilled in place, ``estimator.forward`` called
    directly, the state updated in place (DiffSinger's ``x += v * dt``)."""

    def __init__(self) -> None:
        super().__init__()
        self.estimator = Net()

    @torch.inference_mode()
    def forward(self, mu, noise, n_timesteps=4, cfg=0.5):
        return self.solve_euler(noise.clone(), mu, n_timesteps, cfg)

    def solve_euler(self, x, mu, n, cfg):
        B = x.shape[0]
        x_in, mu_in = torch.zeros(2 * B, x.shape[1]), torch.zeros(2 * B, x.shape[1])
        for i in range(n):
            x_in[:B] = x_in[B:] = x
            mu_in[:B] = mu
            v = self.estimator.forward(x_in, mu_in, i / n)
            v, u = torch.split(v, [B, B], dim=0)
            x += ((1.0 + cfg) * v - cfg * u) / n
        return x


class Ema(InBody):
    """LDM: samples under ``with self.ema_scope():`` (weights swapped through ``.data``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shadow = [p.detach().clone() for p in self.model.parameters()]

    @contextlib.contextmanager
    def ema_scope(self):
        stored = [p.detach().clone() for p in self.model.parameters()]
        for p, s in zip(self.model.parameters(), self.shadow):
            p.data.copy_(s)
        try:
            yield
        finally:
            for p, s in zip(self.model.parameters(), stored):
                p.data.copy_(s)

    @torch.no_grad()
    def log_images(self, x, mu, steps=3):
        with self.ema_scope():
            return InBody.sample(self, x, mu, steps)


class ToNumpy(InBody):
    @torch.no_grad()
    def sample_numpy(self, x, mu, steps=3):
        return InBody.sample(self, x, mu, steps).cpu().numpy()

    @torch.no_grad()
    def sample_detached(self, x, mu, steps=3):
        return InBody.sample(self, x, mu, steps).detach().cpu().numpy()


class HeldManager(InBody):
    def sample(self, x, mu, steps=3):
        ctx = torch.no_grad()
        with ctx:
            return x + self.model(x, mu)


class Meter(nn.Module):
    def forward(self, x):
        with torch.inference_mode():
            return x.detach().abs().mean()


class Leaky(InBody):
    """MMAudio: inference_mode helpers hand back inference tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.meter = Meter()

    @torch.inference_mode()
    def sample(self, x, mu, steps=3):
        x = InBody.sample(self, x, mu, steps)
        return x, self.meter(x)


try:
    from torchdiffeq import odeint
except ImportError:  # the ODE pattern's test is skipped then
    odeint = None


class OdeCFM(nn.Module):
    """F5-TTS/DiffRhythm ``CFM.sample``: decorated, ``self.eval()``, a module-level ``odeint`` whose
    function calls the transformer twice (CFG)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = Net()

    @torch.no_grad()
    def sample(self, cond, steps=4, cfg_strength=2.0):
        self.eval()

        def fn(t, x):
            pred = self.transformer(x, cond, t)
            null = self.transformer(x, torch.zeros_like(cond), t)
            return pred + (pred - null) * cfg_strength

        y0 = cond * 0.5
        return odeint(fn, y0, torch.linspace(0, 1, steps + 1), method="euler")[-1]
