"""DiffRhythm's ``CFM.sample`` (GitHub only): the declared fix (F5-TTS's) on a replica of its sampler.

``patches/_families.py`` (``F5_SAMPLE``) recognises DiffRhythm's ``CFM.sample`` at any path (a checkout's
``model.cfm``) by fingerprints from the repository's history, with F5's fix. The replica below has the shape those versions share: a
``@torch.no_grad()`` method that calls ``self.eval()``, pastes the prompt (``torch.where`` with a fixed
span mask) around an ``odeint`` solve (the module global, torchdiffeq, Euler) of a CFG field built from
two ``self.transformer`` calls (the second with a negative style prompt), and returns the chunks and the
trajectory. The declared fix (its ``fix`` string, resolved as the engine does) is compared with the same
loop written by hand with the blockers removed; upstream's call is shown giving no graph and leaving the
model in eval mode.
"""
from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdiffeq")

from torchdiffeq import odeint  # noqa: E402  (the replica's module global, as in DiffRhythm)

from support import assert_grads_close  # noqa: E402
from gradpatch.patching import catalogue  # noqa: E402
from gradpatch.patching.activation import known_patches  # noqa: E402
from gradpatch.patching.hooks import resolve  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
STEPS, FRAMES, CH = 4, 6, 4  # 4 time points: 3 Euler steps


class Transformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(2 * CH + 1, 16)
        self.style = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.1)
        self.out = torch.nn.Linear(16, CH)

    def forward(self, x, cond, text, time, drop_audio_cond, drop_text, drop_prompt, style_prompt, start_time,
                duration):
        cond = torch.zeros_like(cond) if drop_audio_cond else cond
        h = self.inp(torch.cat([x, cond, time.expand(x.shape[:2])[..., None]], -1))
        return self.out(self.drop(torch.tanh(h + self.style(style_prompt)[:, None])))


class DiffRhythmCFM(torch.nn.Module):  # not named CFM: the F5_SAMPLE scan would take it for a copy
    def __init__(self) -> None:
        super().__init__()
        self.transformer, self.num_channels = Transformer(), CH
        self.odeint_kwargs = dict(method="euler")

    @torch.no_grad()
    def sample(self, cond, text, duration, *, style_prompt=None, negative_style_prompt=None, steps=32,
               cfg_strength=4.0, seed=None, start_time=None, latent_pred_segments=None, song_duration=None,
               batch_infer_num=1):
        self.eval()
        fixed_span_mask = torch.zeros(cond.shape[1], dtype=torch.bool)
        for start, end in latent_pred_segments:
            fixed_span_mask[start:end] = True
        fixed_span_mask = fixed_span_mask[None, :, None]
        step_cond = torch.where(fixed_span_mask, torch.zeros_like(cond), cond)

        def fn(t, x):
            pred = self.transformer(x=x, cond=step_cond, text=text, time=t, drop_audio_cond=False, drop_text=False,
                                    drop_prompt=False, style_prompt=style_prompt, start_time=start_time,
                                    duration=song_duration)
            if cfg_strength < 1e-5:
                return pred
            null_pred = self.transformer(x=x, cond=step_cond, text=text, time=t, drop_audio_cond=True, drop_text=True,
                                         drop_prompt=False, style_prompt=negative_style_prompt, start_time=start_time,
                                         duration=song_duration)
            return pred + (pred - null_pred) * cfg_strength

        if seed is not None:
            torch.manual_seed(seed)
        y0 = torch.randn(1, duration, self.num_channels)
        t = torch.linspace(0, 1, steps)
        trajectory = odeint(fn, y0, t, **self.odeint_kwargs)
        out = torch.where(fixed_span_mask, trajectory[-1], cond)
        return torch.chunk(out, batch_infer_num, dim=0), trajectory


def reference(model, first, cond, style_prompt, negative_style_prompt, cfg_strength=2.0):
    """The replica's computation with its blockers removed by hand (no decorator, no eval(), Euler
    written out); the state entering step ``first`` detached (-1: none)."""
    mask = torch.zeros(FRAMES, dtype=torch.bool)
    mask[2:] = True
    mask = mask[None, :, None]
    step_cond = torch.where(mask, torch.zeros_like(cond), cond)
    torch.manual_seed(5)
    x = torch.randn(1, FRAMES, CH)
    t = torch.linspace(0, 1, STEPS)
    for i in range(STEPS - 1):
        x = x.detach() if i == first else x
        common = dict(cond=step_cond, text=None, time=t[i], drop_prompt=False, start_time=None, duration=None)
        pred = model.transformer(x=x, drop_audio_cond=False, drop_text=False, style_prompt=style_prompt, **common)
        null = model.transformer(x=x, drop_audio_cond=True, drop_text=True, style_prompt=negative_style_prompt, **common)
        x = x + (t[i + 1] - t[i]) * (pred + (pred - null) * cfg_strength)
    return torch.where(mask, x, cond)


@pytest.fixture
def patched():
    """The fix of the ``F5_SAMPLE`` family member, which is F5's declared fix (so the scan looks for
    DiffRhythm's copies whenever F5's patch is selected)."""
    families = __import__(f"{catalogue.builtin_package().__name__}._families", fromlist=["F5_SAMPLE"])
    fix = families.F5_SAMPLE.members[0].fix
    assert fix == known_patches()["f5_tts.sample"].fix
    original = vars(DiffRhythmCFM)["sample"]
    DiffRhythmCFM.sample = resolve(fix)(original)
    yield
    DiffRhythmCFM.sample = original


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return dict(cond=torch.randn(1, FRAMES, CH, generator=generator).requires_grad_(),
                style_prompt=torch.randn(1, 8, generator=generator).requires_grad_(),
                negative_style_prompt=torch.randn(1, 8, generator=generator))


def _call(model, kw, **options):
    (out,), _ = model.sample(kw["cond"], None, FRAMES, style_prompt=kw["style_prompt"],
                             negative_style_prompt=kw["negative_style_prompt"], steps=STEPS, cfg_strength=2.0,
                             seed=5, latent_pred_segments=[(2, FRAMES)], **options)
    return out


def _grads(out, model, kw):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return torch.autograd.grad((out * weight).sum(), [kw["cond"], kw["style_prompt"], *model.parameters()])


def test_upstream_shape_gives_no_graph_and_leaves_eval_mode():
    torch.manual_seed(0)
    model, kw = DiffRhythmCFM().train(), _inputs()
    assert not _call(model, kw).requires_grad and not model.training


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2}, {"checkpoint_steps": True}],
                         ids=["plain", "grad_steps=1", "grad_steps=2", "checkpoint_steps"])
def test_declared_fix_gives_the_hand_fixed_gradients(patched, options):
    torch.manual_seed(0)
    model, kw = DiffRhythmCFM().eval(), _inputs()
    got = _grads(_call(model, kw, cache=False, **options), model, kw)
    first = STEPS - 1 - options["grad_steps"] if "grad_steps" in options else -1
    want = _grads(reference(model, first, **kw), model, kw)
    assert_grads_close(got, want)
    if not options:
        assert all(w.any() for w in want)


def test_declared_fix_keeps_the_callers_train_mode(patched):
    torch.manual_seed(0)
    model, kw = DiffRhythmCFM().train(), _inputs()
    out = _call(model, kw, cache=False)
    assert model.training and model.transformer.training and out.requires_grad
    assert inspect.signature(DiffRhythmCFM.sample).parameters["cache"].default is True
