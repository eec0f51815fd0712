"""The ldm-family declarations beyond AudioLDM 1 (audioldm2, audiosr, sdkit's ``ldm``, audioldm_train):
every target recognised on the installed packages, the device fix, the refusals, and the releases and
GitHub-only copies that are recognised by fingerprint.

The kagayoi-audiosr 1.0.2 check installs that wheel ``--no-deps`` from PyPI into the test cache
(``GRADPATCH_TEST_CACHE``) and runs in a fresh interpreter (it has the same package name as audiosr);
it is marked slow and skips with the reason when pip cannot reach the index.
"""
from __future__ import annotations

import importlib
import inspect
import json

import pytest

torch = pytest.importorskip("torch")

import gradpatch  # noqa: E402
from support import pypi_release, run_python  # noqa: E402
from gradpatch.patching import catalogue  # noqa: E402
from gradpatch.patching.activation import known_patches  # noqa: E402
from gradpatch.patching.fingerprint import fingerprint_source  # noqa: E402
from gradpatch.sampling.families.diffusers import NotDifferentiableError  # noqa: E402
from gradpatch.testing_ldm import LATENT, audioldm2_model, sdkit_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

MODULES = {
    "audioldm2": ("audioldm2.latent_diffusion.models", ("ddim", "plms", "ddpm")),
    "audiosr": ("audiosr.latent_diffusion.models", ("ddim", "plms", "ddpm")),
    "ldm": ("ldm.models.diffusion", ("ddim", "plms", "ddpm", "dpm_solver.sampler", "dpm_solver.dpm_solver")),
}
ALREADY_FIXED = {"ldm.DDIMSampler.register_buffer", "ldm.PLMSSampler.register_buffer",
                 "ldm.DPMSolverSampler.register_buffer"}  # sdkit's copies follow the model's device


def imported(upstream: str) -> None:
    package, names = MODULES[upstream]
    pytest.importorskip(package)
    for name in names:
        importlib.import_module(f"{package}.{name}")


@pytest.mark.parametrize("upstream", list(MODULES))
def test_every_sampling_target_is_recognised_on_the_installed_package(upstream):
    imported(upstream)
    with gradpatch.applied(upstream) as report:
        records = {r.patch: r for r in report if r.target.partition(":")[0].startswith(MODULES[upstream][0])}
    assert len(records) >= 20
    for name, record in records.items():
        want = "skipped" if name in ALREADY_FIXED else "applied"
        assert record.status == want, (name, record.status, record.reason)
        assert record.variant, name  # provenance of the matching fingerprint


def test_unpatched_plms_forces_cuda_and_the_patch_follows_the_model():
    """AudioLDM2's PLMS moves every buffer to CUDA (crashes without a GPU); DDIM defaults to device=cuda."""
    from audioldm2.latent_diffusion.models.ddim import DDIMSampler
    from audioldm2.latent_diffusion.models.plms import PLMSSampler

    if torch.cuda.is_available():
        pytest.skip("checks the behaviour on a machine without CUDA")
    model, cond, _ = audioldm2_model()
    with pytest.raises((RuntimeError, AssertionError)):
        PLMSSampler(model).sample(2, 2, LATENT, cond, verbose=False)
    with pytest.raises((RuntimeError, AssertionError)):
        DDIMSampler(model).sample(2, 2, LATENT, cond, verbose=False)
    with gradpatch.applied("audioldm2"):
        for cls in (PLMSSampler, DDIMSampler):
            sampler = cls(model)  # DDIM: upstream's default device="cuda"
            out, _ = sampler.sample(2, 2, LATENT, cond, verbose=False)
            assert out.device.type == "cpu" and sampler.alphas_cumprod.device.type == "cpu"


@pytest.mark.parametrize("package", ["audioldm2", "audiosr"])
def test_ema_scope_and_generate_refuse_cache_false(package):
    model, cond, uncond = audioldm2_model(package)
    assert model.use_ema
    with gradpatch.applied(package):
        with model.ema_scope():
            with pytest.raises(RuntimeError, match="ema_scope"):
                model.sample(cond, batch_size=2, timesteps=2, verbose=False, cache=False)
        with pytest.raises(NotDifferentiableError, match="sample_log"):
            model.generate_batch({}, ddim_steps=2, cache=False)
        out = model.sample(cond, batch_size=2, timesteps=2, verbose=False, cache=False)  # weights restored
    assert out.grad_fn is not None


def test_dpm_solver_grad_steps_needs_a_counted_method():
    from ldm.models.diffusion.dpm_solver.sampler import DPMSolverSampler

    model, cond, uncond = sdkit_model()
    with gradpatch.applied("ldm"):
        with pytest.raises(ValueError, match="adaptive"):  # upstream picks the adaptive solver for S=1
            DPMSolverSampler(model).sample(1, 2, LATENT, cond, verbose=False, cache=False, grad_steps=1)
        out, _ = DPMSolverSampler(model).sample(1, 2, LATENT, cond, verbose=False, cache=False,
                                                checkpoint_steps=True)
    assert out.grad_fn is not None


def test_tango_vendored_ddim_sampling_is_declared():
    """declare-lab/tango@34ecd38 vendors audioldm 0.1.1 three times (audioldm/, mustango/audioldm/,
    tango2/audioldm/); ``ddim.py`` differs only by ``tqdm(..., leave=False)`` in ``ddim_sampling``, its
    ``ddpm.py`` and ``ldm.py`` are byte-identical. The tango hash equals that edit of the installed file."""
    ddim = pytest.importorskip("audioldm.latent_diffusion.ddim")
    source = inspect.getsource(ddim)
    edited = source.replace('desc="DDIM Sampler", total=total_steps)',
                            'desc="DDIM Sampler", total=total_steps, leave=False)')
    assert edited != source
    digest = fingerprint_source(edited, ["DDIMSampler.ddim_sampling"])
    assert "tango" in known_patches()["audioldm.DDIMSampler.ddim_sampling"].recognise.known[digest]


KAGAYOI = """
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
import importlib
import gradpatch, audiosr
assert audiosr.__file__.startswith(sys.argv[1]), audiosr.__file__
for name in ("ddim", "plms", "ddpm"):
    importlib.import_module("audiosr.latent_diffusion.models." + name)
with warnings.catch_warnings():
    warnings.simplefilter("error", gradpatch.UnknownCodeWarning)
    report = gradpatch.apply("audiosr")
print(json.dumps({r.patch: [str(r.status), r.variant] for r in report}))
"""


@pytest.mark.slow
def test_kagayoi_audiosr_is_recognised():
    root = pypi_release("kagayoi-audiosr==1.0.2")
    if isinstance(root, str):
        pytest.skip(root)
    done = run_python(KAGAYOI.replace("sys.argv[1]", repr(str(root))), env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(done.stdout.strip().splitlines()[-1])
    # Declared patches only: this process may have adopted copies the scan found elsewhere.
    assert len(records) == len([p for p in catalogue.load().values() if p.upstream == "audiosr"])
    for name, (status, variant) in records.items():
        assert status == "applied" and "kagayoi" in variant, (name, status, variant)


@pytest.mark.parametrize("package,plms", [("audioldm2", False), ("audioldm2", True), ("sdkit", False)])
def test_sample_log_continues_the_graph_of_its_sampler(package, plms):
    """``sample_log(cache=False)`` builds its own sampler and calls ``sample`` without ``cache=``: that call
    continues the same graph with the same options, and equals the sampler called directly. (sdkit's
    ``sample_log`` has no PLMS branch.) Backward runs while the patches are applied: the UNet's
    checkpoint calls are patched too, and a recompute must see the same code as the forward."""
    if package == "sdkit":
        from ldm.models.diffusion.ddim import DDIMSampler
        from ldm.models.diffusion.plms import PLMSSampler

        model, cond, uncond = sdkit_model()
        guidance, upstream = dict(unconditional_guidance_scale=3.0, unconditional_conditioning=uncond), "ldm"
    else:
        from audioldm2.latent_diffusion.models.ddim import DDIMSampler
        from audioldm2.latent_diffusion.models.plms import PLMSSampler

        model, cond, uncond = audioldm2_model()
        guidance, upstream = ({} if plms else dict(unconditional_guidance_scale=3.0, unconditional_conditioning=uncond),
                              "audioldm2")
    x_t = torch.randn((2, *LATENT), generator=torch.Generator().manual_seed(3))
    extra = {"use_plms": True} if plms else {}
    with gradpatch.applied(upstream):
        logged, _ = model.sample_log(cond, 2, True, 4, x_T=x_t, cache=False, checkpoint_steps=True, **guidance, **extra)
        direct, _ = (PLMSSampler if plms else DDIMSampler)(model).sample(4, 2, LATENT, cond, x_T=x_t, verbose=False,
                                                                         cache=False, **guidance)
        assert logged.grad_fn is not None
        torch.testing.assert_close(logged, direct, rtol=0, atol=0)
        logged.square().mean().backward()
    assert all(p.grad is not None for p in model.model.parameters())


@pytest.mark.parametrize("package", ["audioldm2", "audiosr"])
def test_encode_first_stage_cache_false_lifts_its_no_grad(package):
    model, _, _ = audioldm2_model(package)
    mel = torch.randn(1, 1, 16, 16, requires_grad=True)
    with gradpatch.applied(package):
        assert model.encode_first_stage(mel).mean.grad_fn is None  # upstream's in-body no_grad
        posterior = model.encode_first_stage(mel, cache=False)
    posterior.mean.square().sum().backward()
    assert mel.grad is not None and mel.grad.abs().sum() > 0


@pytest.mark.parametrize("upstream", list(MODULES))
def test_no_decorated_method_of_the_model_is_left_unpatched(upstream):
    """The first ``cache=False`` call names every ``@torch.no_grad()`` method of the model's class that no
    patch replaced (Lightning's export helpers aside): here there is none."""
    import warnings

    from gradpatch.sampling.families import ldm_uncovered as uncovered

    model, cond, _ = sdkit_model() if upstream == "ldm" else audioldm2_model(upstream)
    uncovered._checked.discard(type(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradpatch.applied(upstream):
            model.sample(cond, batch_size=2, timesteps=2, verbose=False, cache=False)
    assert type(model) in uncovered._checked
    assert not [str(w.message) for w in caught if "not patched" in str(w.message)]
