"""CosyVoice 2/3's flow decoder (GitHub FunAudioLLM/CosyVoice, no installable package with its code):
the flow-matching family's declaration, exercised on a replica of its sampler.

``patches/cosyvoice.py`` recognises ``cosyvoice.flow.flow_matching`` by the fingerprints of
``CausalConditionalCFM.forward`` + ``ConditionalCFM.solve_euler`` computed from every version in the
repository's history (``patches/_families.py``). The replica below has the shape those versions share:
an ``@torch.inference_mode()`` entry drawing fixed noise, and a solver that allocates a CFG batch of two
once and refills it in place every step (``x_in[:] = x``, ``mu_in[0] = mu``) before calling the
estimator through ``forward_estimator``. The declaration's own fix (its ``fix`` string, resolved as the
engine does) is applied to the replica and compared with the same loop building the batch with
``torch.cat``; upstream's entry gives no graph and its unwrapped body fails in backward.
"""
from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from support import assert_grads_close  # noqa: E402
from gradpatch.patching.activation import known_patches  # noqa: E402
from gradpatch.patching.hooks import resolve  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
N, FRAMES = 3, 6


class Estimator(torch.nn.Module):
    """A small stand-in for CosyVoice's ``CausalConditionalDecoder``: same arguments, 80 channels."""

    def __init__(self) -> None:
        super().__init__()
        self.time = torch.nn.Linear(1, 16)
        self.spk = torch.nn.Linear(80, 16)
        self.inp = torch.nn.Conv1d(240, 16, 3, padding=1)
        self.out = torch.nn.Conv1d(16, 80, 3, padding=1)

    def forward(self, x, mask, mu, t, spks, cond, streaming=False):
        h = self.inp(torch.cat([x, mu, cond], 1) * mask) + (self.time(t[:, None]) + self.spk(spks))[..., None]
        return self.out(torch.nn.functional.silu(h)) * mask


class ReplicaConditionalCFM(torch.nn.Module):
    def __init__(self, estimator: torch.nn.Module, inference_cfg_rate: float = 0.7) -> None:
        super().__init__()
        self.estimator, self.inference_cfg_rate, self.t_scheduler = estimator, inference_cfg_rate, "cosine"

    def solve_euler(self, x, t_span, mu, mask, spks, cond, streaming=False):
        t, _, dt = t_span[0], t_span[-1], t_span[1] - t_span[0]
        t = t.unsqueeze(dim=0)
        sol = []
        x_in = torch.zeros([2, 80, x.size(2)], device=x.device, dtype=spks.dtype)
        mask_in = torch.zeros([2, 1, x.size(2)], device=x.device, dtype=spks.dtype)
        mu_in = torch.zeros([2, 80, x.size(2)], device=x.device, dtype=spks.dtype)
        t_in = torch.zeros([2], device=x.device, dtype=spks.dtype)
        spks_in = torch.zeros([2, 80], device=x.device, dtype=spks.dtype)
        cond_in = torch.zeros([2, 80, x.size(2)], device=x.device, dtype=spks.dtype)
        for step in range(1, len(t_span)):
            x_in[:] = x
            mask_in[:] = mask
            mu_in[0] = mu
            t_in[:] = t.unsqueeze(0)
            spks_in[0] = spks
            cond_in[0] = cond
            dphi_dt = self.forward_estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, streaming)
            dphi_dt, cfg_dphi_dt = torch.split(dphi_dt, [x.size(0), x.size(0)], dim=0)
            dphi_dt = ((1.0 + self.inference_cfg_rate) * dphi_dt - self.inference_cfg_rate * cfg_dphi_dt)
            x = x + dt * dphi_dt
            t = t + dt
            sol.append(x)
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return sol[-1].float()

    def forward_estimator(self, x, mask, mu, t, spks, cond, streaming=False):
        return self.estimator(x, mask, mu, t, spks, cond, streaming=streaming)


class ReplicaCausalConditionalCFM(ReplicaConditionalCFM):
    def __init__(self, estimator: torch.nn.Module) -> None:
        super().__init__(estimator)
        self.rand_noise = torch.randn([1, 80, 50], generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def forward(self, mu, mask, n_timesteps, temperature=1.0, spks=None, cond=None, streaming=False):
        z = self.rand_noise[:, :, :mu.size(2)].to(mu.device).to(mu.dtype) * temperature
        t_span = torch.linspace(0, 1, n_timesteps + 1, device=mu.device, dtype=mu.dtype)
        if self.t_scheduler == 'cosine':
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        return self.solve_euler(z, t_span=t_span, mu=mu, mask=mask, spks=spks, cond=cond, streaming=streaming), None


def reference(model, first, mu, mask, spks, cond):
    """The replica's loop with its blockers removed by hand: no decorator, the batch built with cat."""
    x, rate = model.rand_noise[:, :, :mu.size(2)], model.inference_cfg_rate
    t_span = 1 - torch.cos(torch.linspace(0, 1, N + 1) * 0.5 * torch.pi)
    t, dt = t_span[0][None], t_span[1] - t_span[0]
    for step in range(1, N + 1):
        x = x.detach() if step - 1 == first else x
        out = model.estimator(torch.cat([x, x]), torch.cat([mask, mask]), torch.cat([mu, torch.zeros_like(mu)]),
                              torch.cat([t, t]), torch.cat([spks, torch.zeros_like(spks)]),
                              torch.cat([cond, torch.zeros_like(cond)]))
        v, v_uncond = out.chunk(2)
        x = x + dt * ((1 + rate) * v - rate * v_uncond)
        t = t + dt
        if step < N:
            dt = t_span[step + 1] - t
    return x


@pytest.fixture
def patched():
    """The replica's ``forward`` replaced by the declared patch's fix (the replica's classes have names
    of their own, so that the family's scan does not take this module for a copy)."""
    patch = known_patches()["cosyvoice.CausalConditionalCFM.forward"]
    assert patch.target == "cosyvoice.flow.flow_matching:CausalConditionalCFM.forward"
    assert patch.fix.endswith("._families:flow_matching_sampler")  # differentiable(step="estimator", steps="n_timesteps")
    original = vars(ReplicaCausalConditionalCFM)["forward"]
    ReplicaCausalConditionalCFM.forward = resolve(patch.fix)(original)
    yield
    ReplicaCausalConditionalCFM.forward = original


def _model_and_inputs():
    torch.manual_seed(0)
    model = ReplicaCausalConditionalCFM(Estimator()).eval()
    generator = torch.Generator().manual_seed(1)
    kw = dict(mu=torch.randn(1, 80, FRAMES, generator=generator), mask=torch.ones(1, 1, FRAMES),
              spks=torch.randn(1, 80, generator=generator), cond=torch.randn(1, 80, FRAMES, generator=generator))
    for name in ("mu", "spks", "cond"):
        kw[name].requires_grad_()
    return model, kw


def _grads(out, model, kw):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return torch.autograd.grad((out * weight).sum(), [kw["mu"], kw["spks"], kw["cond"], *model.parameters()])


def test_upstream_shape_fails_even_unwrapped():
    model, kw = _model_and_inputs()
    out, _ = model(**kw, n_timesteps=N)
    assert out.is_inference() and not out.requires_grad
    out, _ = inspect.unwrap(ReplicaCausalConditionalCFM.forward)(model, **kw, n_timesteps=N)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2}, {"checkpoint_steps": True}],
                         ids=["plain", "grad_steps=1", "grad_steps=2", "checkpoint_steps"])
def test_declared_fix_gives_the_out_of_place_gradients(patched, options):
    model, kw = _model_and_inputs()
    out, cache = model(**kw, n_timesteps=N, cache=False, **options)
    assert cache is None
    got = _grads(out, model, kw)
    want = _grads(reference(model, N - options.get("grad_steps", N), **kw), model, kw)
    assert_grads_close(got, want)
    if not options:
        assert all(w.any() for w in want)


def test_declared_fix_cache_true_is_upstream(patched):
    model, kw = _model_and_inputs()
    out, _ = model(**kw, n_timesteps=N)
    want, _ = inspect.unwrap(ReplicaCausalConditionalCFM.forward)(model, **{k: v.detach() for k, v in kw.items()},
                                                           n_timesteps=N)
    assert out.is_inference() and torch.equal(out, want)
