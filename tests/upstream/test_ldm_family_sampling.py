"""Differentiable native sampling in the ldm family beyond AudioLDM 1: AudioLDM2 (audioldm2 0.1.0),
AudioSR (audiosr 0.0.7, an AudioLDM2 clone) and the SD2/ControlNet code of stable-diffusion-sdkit 2.1.5
(package ``ldm``), against the real packages, on the CPU.

Models are tiny and random (:mod:`gradpatch.testing_ldm`): the real ``LatentDiffusion``, UNet and
``AutoencoderKL``, zero-initialised layers re-initialised. For AudioLDM2/AudioSR a stand-in replaces the
CLAP audio encoder that ``DDPM.__init__`` builds (its constructor loads a tokenizer from the hub) while
the model is constructed; sampling never calls it.

Per codebase and sampler (DDIM, PLMS, ldm's DPM-Solver, and the ancestral ``LatentDiffusion.sample``),
8 steps with classifier-free guidance (PLMS on AudioLDM2/AudioSR without: upstream's PLMS concatenates
the conditioning with ``torch.cat``, which fails on their dict conditionings):

* ``cache=True`` is upstream bit for bit (same seed), and builds no graph even under ``enable_grad``.
  Where upstream forces CUDA buffers (AudioLDM2/AudioSR ``PLMSSampler.register_buffer``), the unpatched
  run has its buffers moved to the CPU by hand (:func:`ldm_reference.cpu_buffers`).
* ``cache=False`` then ``decode_first_stage(..., cache=False)``: the gradient of a loss on the decoded
  output, over every parameter of the UNet, equals the reference (the same upstream code with its
  decorators removed by hand, its in-body ``no_grad`` edited out of the source text) to 1e-5 relative.
* ``checkpoint_steps=True`` gives the plain ``cache=False`` gradients; ``grad_steps=K`` gives those of the
  reference whose first ``8 - K`` steps (calls of ``p_sample_ddim`` / ``p_sample_plms`` / ``p_sample`` /
  the DPM-Solver model function) run under ``no_grad``.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import gradpatch  # noqa: E402
from gradpatch.testing_ldm import LATENT, audioldm2_model, sdkit_model  # noqa: E402
from ldm_reference import (assert_grads_close, cpu_buffers, first_calls_without_grad, replaced,  # noqa: E402
                           text_edited, undecorated)

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS, BATCH, SCALE = 8, 2, 3.0


class Codebase:
    """What the tests need to know about one codebase: its modules and which methods block gradients."""

    def __init__(self, upstream: str, package: str, build: Callable[[], tuple], samplers: tuple[str, ...],
                 plms_guidance: bool, inline_first_stage: bool, cuda_plms: bool) -> None:
        self.upstream, self.package, self.build = upstream, package, build
        self.samplers, self.plms_guidance = samplers, plms_guidance
        self.inline_first_stage, self.cuda_plms = inline_first_stage, cuda_plms

    def module(self, name: str) -> Any:
        import importlib

        return importlib.import_module(f"{self.package}.{name}")

    def decorated(self, sampler: str) -> list[tuple[type, str]]:
        ld = self.module("ddpm").LatentDiffusion
        methods = [(ld, "sample"), (ld, "p_sample_loop"), (ld, "p_sample")]
        if sampler == "ddim":
            cls = self.module("ddim").DDIMSampler
            methods += [(cls, "sample"), (cls, "ddim_sampling"), (cls, "p_sample_ddim")]
        elif sampler == "plms":
            cls = self.module("plms").PLMSSampler
            methods += [(cls, "sample"), (cls, "plms_sampling"), (cls, "p_sample_plms")]
        elif sampler == "dpm":
            methods += [(self.module("dpm_solver.sampler").DPMSolverSampler, "sample")]
        if not self.inline_first_stage:
            methods += [(ld, "decode_first_stage")]
        return methods

    def step_method(self, sampler: str) -> tuple[type, str]:
        if sampler == "ddim":
            return self.module("ddim").DDIMSampler, "p_sample_ddim"
        if sampler == "plms":
            return self.module("plms").PLMSSampler, "p_sample_plms"
        if sampler == "dpm":
            return self.module("dpm_solver.dpm_solver").DPM_Solver, "model_fn"
        return self.module("ddpm").LatentDiffusion, "p_sample"


CODEBASES = {
    "audioldm2": Codebase("audioldm2", "audioldm2.latent_diffusion.models", lambda: audioldm2_model("audioldm2"),
                          ("ddim", "plms", "ancestral"), False, True, True),
    "audiosr": Codebase("audiosr", "audiosr.latent_diffusion.models", lambda: audioldm2_model("audiosr"),
                        ("ddim", "plms", "ancestral"), False, True, True),
    "sdkit": Codebase("ldm", "ldm.models.diffusion", sdkit_model, ("ddim", "plms", "dpm", "ancestral"),
                      True, False, False),
}
CASES = [(name, sampler) for name, codebase in CODEBASES.items() for sampler in codebase.samplers]


@pytest.fixture(params=list(CODEBASES))
def codebase(request):
    pytest.importorskip(CODEBASES[request.param].package)
    return CODEBASES[request.param]


def codebase_case(name: str) -> Codebase:
    codebase = CODEBASES[name]
    pytest.importorskip(codebase.package)
    return codebase


def run_sampler(codebase: Codebase, sampler: str, model, cond, uncond, *, reference: bool = False, **options):
    """8 steps from a fixed start; returns the final latent. ``options`` go to the sampler's entry point."""
    x_t = torch.randn((BATCH, *LATENT), generator=torch.Generator().manual_seed(11))
    torch.manual_seed(5)  # the samplers' own noise (DDIM eta, ancestral steps)
    guidance = dict(unconditional_guidance_scale=SCALE, unconditional_conditioning=uncond)
    if sampler == "ancestral":
        return model.sample(cond, batch_size=BATCH, x_T=x_t, timesteps=STEPS, verbose=False, **options)
    if sampler == "dpm":
        instance = codebase.module("dpm_solver.sampler").DPMSolverSampler(model)
        return instance.sample(STEPS, BATCH, LATENT, cond, x_T=x_t, verbose=False, **guidance, **options)[0]
    if sampler == "ddim":
        kw = {"device": torch.device("cpu")} if codebase.upstream != "ldm" else {}
        instance = codebase.module("ddim").DDIMSampler(model, **kw)
        return instance.sample(STEPS, BATCH, LATENT, cond, x_T=x_t, eta=0.5, verbose=False, **guidance, **options)[0]
    instance = codebase.module("plms").PLMSSampler(model)
    guidance = guidance if codebase.plms_guidance else {}
    with cpu_buffers(instance) if reference and codebase.cuda_plms else contextlib.nullcontext():
        return instance.sample(STEPS, BATCH, LATENT, cond, x_T=x_t, verbose=False, **guidance, **options)[0]


def loss_of(image: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1.0, 1.0, image.shape[-1])
    return (image * weights).square().mean()


def unet_grads(model, loss: torch.Tensor) -> list[torch.Tensor]:
    params = list(model.model.parameters())
    model.zero_grad(set_to_none=True)
    loss.backward()
    missing = [name for name, p in model.model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing[:5]}"
    return [p.grad.clone() for p in params]


def reference_grads(codebase: Codebase, sampler: str, model, cond, uncond, no_grad_steps: int = 0):
    """Unpatched upstream with its gradient blockers removed by hand (see :mod:`ldm_reference`)."""
    ld = codebase.module("ddpm").LatentDiffusion
    with contextlib.ExitStack() as stack:
        stack.enter_context(undecorated(codebase.decorated(sampler)))
        if codebase.inline_first_stage:
            stack.enter_context(replaced(ld, "decode_first_stage", text_edited(ld, "decode_first_stage")))
        if sampler == "dpm":
            solver = codebase.module("dpm_solver.dpm_solver").DPM_Solver
            stack.enter_context(replaced(solver, "sample", text_edited(solver, "sample")))
        cls, name = codebase.step_method(sampler)
        step = first_calls_without_grad(vars(cls)[name], no_grad_steps)
        stack.enter_context(replaced(cls, name, step))
        stack.enter_context(torch.enable_grad())
        latent = run_sampler(codebase, sampler, model, cond, uncond, reference=True)
        grads = unet_grads(model, loss_of(model.decode_first_stage(latent)))
    assert step.calls[0] == STEPS  # one call per step (DPM-Solver multistep: one model call per step)
    return grads


def patched_grads(sampler: str, codebase: Codebase, model, cond, uncond, **options):
    latent = run_sampler(codebase, sampler, model, cond, uncond, cache=False, **options)
    assert latent.grad_fn is not None
    return unet_grads(model, loss_of(model.decode_first_stage(latent, cache=False)))


def functions_called(fn: Callable[[], Any]) -> set[str]:
    """Names of the Python functions called while ``fn`` runs (CPU autograd runs backward, and so every
    checkpoint recompute, in the calling thread)."""
    names: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            names.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


SAMPLER_STATE = {"p_sample_ddim", "p_sample_plms", "plms_sampling", "ddim_sampling", "get_x_prev_and_pred_x0",
                 "make_schedule", "register_buffer", "multistep_dpm_solver_update", "p_sample", "p_mean_variance",
                 "model_wrapper", "noise_pred_fn", "data_prediction_fn"}
"""Sampler code that must not run again in backward: updates of ``x``, PLMS's ``old_eps`` history,
DPM-Solver's multistep history, guidance combination, schedules."""


@pytest.mark.parametrize("name,sampler", CASES)
def test_cache_true_is_upstream_bit_for_bit(name, sampler):
    codebase = codebase_case(name)
    model, cond, uncond = codebase.build()
    with torch.enable_grad():
        want = run_sampler(codebase, sampler, model, cond, uncond, reference=True)
        want_image = model.decode_first_stage(want)
        with gradpatch.applied(codebase.upstream):
            got = run_sampler(codebase, sampler, model, cond, uncond)
            got_image = model.decode_first_stage(got)
    assert torch.equal(got, want) and torch.equal(got_image, want_image)
    assert got.grad_fn is None and got_image.grad_fn is None  # what the fix is for


@pytest.mark.parametrize("name,sampler", CASES)
def test_gradients_equal_the_hand_undecorated_upstream(name, sampler):
    """Plain ``cache=False`` and ``checkpoint_steps=True`` against the reference; the recompute in
    backward re-runs the network only, never the sampler's own code."""
    codebase = codebase_case(name)
    model, cond, uncond = codebase.build()
    want = reference_grads(codebase, sampler, model, cond, uncond)
    with gradpatch.applied(codebase.upstream):
        got = patched_grads(sampler, codebase, model, cond, uncond)
        latent = run_sampler(codebase, sampler, model, cond, uncond, cache=False, checkpoint_steps=True)
        loss = loss_of(model.decode_first_stage(latent, cache=False))
        params = list(model.model.parameters())
        model.zero_grad(set_to_none=True)
        recomputed = functions_called(lambda: torch.autograd.backward(loss, inputs=params))
        checkpointed = [p.grad.clone() for p in params]
    assert_grads_close(got, want)
    assert_grads_close(checkpointed, want)
    assert "apply_model" in recomputed and "forward" in recomputed  # the network was recomputed ...
    assert not SAMPLER_STATE & recomputed, SAMPLER_STATE & recomputed  # ... and nothing around it
    assert not model.training and not any(m.training for m in model.model.modules())


@pytest.mark.slow
@pytest.mark.parametrize("name,sampler", CASES)
def test_grad_steps_equals_truncated_reference(name, sampler):
    k = 3
    codebase = codebase_case(name)
    model, cond, uncond = codebase.build()
    want = reference_grads(codebase, sampler, model, cond, uncond, no_grad_steps=STEPS - k)
    with gradpatch.applied(codebase.upstream):
        got = patched_grads(sampler, codebase, model, cond, uncond, grad_steps=k)
        both = patched_grads(sampler, codebase, model, cond, uncond, grad_steps=k, checkpoint_steps=True)
    assert_grads_close(got, want)
    assert_grads_close(both, want)
