"""Differentiable native AudioLDM sampling against the real upstream (PyPI audioldm 0.1.1), on CPU.

A tiny randomly initialised real ``LatentDiffusion`` (``gradpatch.testing.audioldm_ldm``: tiny UNet and
first stage, zero-initialised layers re-initialised, no downloads). The reference for gradients is the
same upstream code with its decorators removed by hand: ``inspect.unwrap`` of each unpatched method,
bound to the instance in the test, run with grad on. Upstream's ``DDIMSampler.register_buffer`` moves
every schedule tensor to CUDA, which fails on a CPU-only machine; where upstream must run here (the
references and the bitwise ``cache=True`` comparison) the test binds a by-hand stand-in that keeps the
buffers where they are (on the model's device) - the values are the same tensors upstream would move.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("audioldm")

import gradpatch  # noqa: E402
from gradpatch.sampling import run as sampling
from gradpatch.sampling.families import ldm as ldm_sampling  # noqa: E402
from gradpatch.sampling.families.diffusers import NotDifferentiableError  # noqa: E402
from gradpatch.testing import audioldm_cond, audioldm_ldm  # noqa: E402
from support import Interleaved, assert_grads_close  # noqa: E402

from audioldm.latent_diffusion.ddim import DDIMSampler  # noqa: E402
from audioldm.ldm import LatentDiffusion  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
SHAPE = (4, 16, 16)
STEPS = 8
GRADPATCH_DIR = str(Path(gradpatch.__file__).parent)


def upstream(method):
    """``method`` as upstream defines it, under any gradpatch wrapper (GRADPATCH=1 in the environment)."""
    while getattr(getattr(method, "__code__", None), "co_filename", "").startswith(GRADPATCH_DIR):
        method = method.__wrapped__
    return method


ORIGINAL = {(cls, name): upstream(vars(cls)[name]) for cls, names in [
    (DDIMSampler, ("sample", "ddim_sampling", "p_sample_ddim", "register_buffer")),
    (LatentDiffusion, ("sample", "p_sample_loop", "p_sample", "decode_first_stage", "sample_log"))]
    for name in names}


@pytest.fixture(scope="module")
def model():
    return audioldm_ldm(seed=0)


def unet_params(model):
    return [p for p in model.model.parameters() if p.requires_grad]


def keep_buffers(self, name, attr):
    """By-hand stand-in for upstream's ``register_buffer`` (which moves tensors to CUDA)."""
    setattr(self, name, attr)


def upstream_sampler(model, unwrapped=True):
    """A ``DDIMSampler`` running upstream's own methods, bound by hand (decorators removed if asked)."""
    sampler = DDIMSampler(model)
    sampler.register_buffer = types.MethodType(keep_buffers, sampler)
    for name in ("sample", "ddim_sampling", "p_sample_ddim"):
        method = ORIGINAL[DDIMSampler, name]
        setattr(sampler, name, types.MethodType(inspect.unwrap(method) if unwrapped else method, sampler))
    return sampler


def decode(model, z):
    """Upstream's ``decode_first_stage`` with its decorator removed by hand."""
    return inspect.unwrap(ORIGINAL[LatentDiffusion, "decode_first_stage"])(model, z)


def kwargs(cond, **extra):
    return {**dict(S=STEPS, batch_size=len(cond), shape=SHAPE, conditioning=cond, verbose=False,
                   unconditional_guidance_scale=2.0, unconditional_conditioning=torch.zeros_like(cond)), **extra}


def loss_of(mel):
    return (mel * torch.linspace(-1, 1, mel.shape[-1])).square().mean()


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in unet_params(model)]


def assert_close_set(got, want, rtol=1e-5):
    """Equal to ``rtol``; entries whose true gradient is numerically zero (biases before GroupNorm) are
    compared against a floor of 1e-6 of the largest gradient of the set."""
    assert len(got) == len(want) and all(g is not None and torch.isfinite(g).all() for g in got)
    assert_grads_close(got, want, rtol)


@contextlib.contextmanager
def no_grad_first(model, calls):
    """Run the first ``calls`` evaluations of ``model.apply_model`` under no_grad (the reference for
    ``grad_steps``: batched CFG evaluates once per step)."""
    real, seen = model.apply_model, [0]

    def apply_model(*args, **kw):
        seen[0] += 1
        with torch.set_grad_enabled(seen[0] > calls):
            return real(*args, **kw)

    model.apply_model = apply_model
    try:
        yield seen
    finally:
        del model.apply_model


def reference_grads(model, cond, no_grad_calls=0, seed=3, **extra):
    torch.manual_seed(seed)
    with no_grad_first(model, no_grad_calls), torch.enable_grad():
        z, _ = upstream_sampler(model).sample(**kwargs(cond, **extra))
        return grads(model, loss_of(decode(model, z)))


def patched_grads(model, cond, seed=3, grad_steps=None, checkpoint_steps=False, **extra):
    torch.manual_seed(seed)
    z, _ = DDIMSampler(model).sample(**kwargs(cond, **extra), cache=False, grad_steps=grad_steps,
                                     checkpoint_steps=checkpoint_steps)
    mel = model.decode_first_stage(z, cache=False)
    assert z.grad_fn is not None and mel.grad_fn is not None
    return grads(model, loss_of(mel))


def test_report_and_signatures():
    with gradpatch.applied("audioldm") as report:
        records = {r.patch: r for r in report}
        sampling_patches = [name for name in records if name.startswith(("audioldm.DDIM", "audioldm.DDPM",
                                                                           "audioldm.LatentDiffusion"))]
        assert len(sampling_patches) == 20
        assert all(records[name].status == "applied" for name in sampling_patches), report
        for method in (DDIMSampler.sample, LatentDiffusion.sample_log, LatentDiffusion.decode_first_stage):
            params = inspect.signature(method).parameters
            assert [params[n].default for n in ("cache", "grad_steps", "checkpoint_steps")] == [True, None, False]
            assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("cache", "grad_steps"))
    assert all(vars(cls)[name] is obj for (cls, name), obj in ORIGINAL.items())


def test_upstream_cannot_differentiate_and_crashes_on_cpu(model):
    cond = audioldm_cond(1)
    sampler = upstream_sampler(model, unwrapped=False)
    z, _ = sampler.sample(**kwargs(cond))
    assert z.grad_fn is None
    z.requires_grad_(True)
    assert ORIGINAL[LatentDiffusion, "decode_first_stage"](model, z).grad_fn is None
    assert decode(model, z).grad_fn is not None  # only by hand, unwrapped
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            DDIMSampler(model).sample(**kwargs(cond))  # upstream's register_buffer: .to("cuda")


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_cache_true_is_upstream_bit_for_bit(model, eta):
    cond = audioldm_cond(1)
    torch.manual_seed(5)
    want, want_inter = upstream_sampler(model, unwrapped=False).sample(**kwargs(cond, eta=eta))
    want_mel = ORIGINAL[LatentDiffusion, "decode_first_stage"](model, want)
    torch.manual_seed(7)
    want_ancestral = ORIGINAL[LatentDiffusion, "p_sample_loop"](model, cond, (1, *SHAPE), timesteps=3, verbose=False)
    with gradpatch.applied("audioldm"):
        torch.manual_seed(5)
        got, got_inter = DDIMSampler(model).sample(**kwargs(cond, eta=eta))
        got_mel = model.decode_first_stage(got)
        torch.manual_seed(7)
        got_ancestral = model.p_sample_loop(cond, (1, *SHAPE), timesteps=3, verbose=False)
    assert torch.equal(got, want) and torch.equal(got_mel, want_mel) and torch.equal(got_ancestral, want_ancestral)
    assert all(torch.equal(a, b) for a, b in zip(got_inter["x_inter"], want_inter["x_inter"]))
    assert got.grad_fn is None and got_mel.grad_fn is None


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_gradients_equal_the_unwrapped_upstream(model, eta):
    cond = audioldm_cond(1)
    want = reference_grads(model, cond, eta=eta)
    with gradpatch.applied("audioldm"):
        got = patched_grads(model, cond, eta=eta)
    assert all(w.abs().max() > 0 for w in want[-4:])
    assert len(got) == len(unet_params(model)) == 210
    assert_close_set(got, want)


def test_checkpoint_steps_equal_plain_in_train_mode():
    model = audioldm_ldm(seed=1, dropout=0.2).train()  # dropout on: the recompute must replay the RNG
    cond = audioldm_cond(1)
    with gradpatch.applied("audioldm"):
        plain = patched_grads(model, cond, S=4)
        checkpointed = patched_grads(model, cond, S=4, checkpoint_steps=True)
        different_seed = patched_grads(model, cond, S=4, seed=4)
    assert model.training and all(m.training for m in model.model.modules())
    assert_close_set(checkpointed, plain)
    assert any(not torch.allclose(a, b) for a, b in zip(plain, different_seed))  # dropout is really on


@pytest.mark.parametrize("k", [1, 3])
def test_grad_steps_equal_a_reference_whose_earlier_steps_run_without_grad(model, k):
    cond = audioldm_cond(1)
    # make_ddim_timesteps(uniform, 8 of 1000) gives range(0, 1000, 125): 8 steps, one evaluation each.
    want = reference_grads(model, cond, no_grad_calls=STEPS - k)
    full = reference_grads(model, cond)
    with gradpatch.applied("audioldm"):
        got = patched_grads(model, cond, grad_steps=k)
        both = patched_grads(model, cond, grad_steps=k, checkpoint_steps=True)
    assert_close_set(got, want)
    assert_close_set(both, want)
    assert any(not torch.allclose(g, f) for g, f in zip(got, full))


def test_steps_are_counted_as_taken(model):
    """S=6 of 1000 gives upstream's uniform schedule 7 steps (range(0, 1000, 166)): grad_steps=7 is the
    full graph, grad_steps=1 keeps only the last of the 7 evaluations in the graph."""
    cond = audioldm_cond(1)
    evaluations = []
    with gradpatch.applied("audioldm"):
        for k in (1, 7):
            torch.manual_seed(0)
            z, _ = DDIMSampler(model).sample(**dict(kwargs(cond), S=6), cache=False, grad_steps=k)
            evaluations.append(grads(model, z.square().mean()))
    torch.manual_seed(0)
    with no_grad_first(model, 6) as seen, torch.enable_grad():
        z, _ = upstream_sampler(model).sample(**dict(kwargs(cond), S=6))
        last_only = grads(model, z.square().mean())
    assert seen[0] == 7
    assert_close_set(evaluations[0], last_only)
    torch.manual_seed(0)
    with torch.enable_grad():
        z, _ = upstream_sampler(model).sample(**dict(kwargs(cond), S=6))
        assert_close_set(evaluations[1], grads(model, z.square().mean()))


def test_ancestral_sampling_and_sample_log(model):
    """``LatentDiffusion.sample`` (ancestral, a step = one ``p_sample``, ``t`` = steps left) and
    ``sample_log`` (which builds a DDIMSampler and calls its sample without ``cache``)."""
    cond = audioldm_cond(1)
    lds = {name: inspect.unwrap(ORIGINAL[LatentDiffusion, name]) for name in ("p_sample_loop", "p_sample")}

    def reference(no_grad_calls):
        torch.manual_seed(2)
        with no_grad_first(model, no_grad_calls), torch.enable_grad():
            model.p_sample = types.MethodType(lds["p_sample"], model)
            try:
                z = lds["p_sample_loop"](model, cond, (1, *SHAPE), timesteps=4, verbose=False)
            finally:
                del model.p_sample
            return grads(model, loss_of(decode(model, z)))

    with gradpatch.applied("audioldm"):
        torch.manual_seed(2)
        z = model.sample(cond, batch_size=1, timesteps=4, verbose=False, cache=False, grad_steps=2)
        got = grads(model, loss_of(model.decode_first_stage(z, cache=False)))
        torch.manual_seed(3)
        z_log, _ = model.sample_log(cond, 1, ddim=True, ddim_steps=STEPS, eta=0.0, unconditional_guidance_scale=2.0,
                                    unconditional_conditioning=torch.zeros_like(cond), cache=False, grad_steps=3,
                                    checkpoint_steps=True)
        got_log = grads(model, loss_of(model.decode_first_stage(z_log, cache=False)))
    assert_close_set(got, reference(2))
    assert_close_set(got_log, reference_grads(model, cond, no_grad_calls=STEPS - 3))


def test_caller_modes_kept_and_state_restored(model):
    cond = audioldm_cond(1)
    with gradpatch.applied("audioldm"):
        model.train()
        with torch.no_grad():
            z, _ = DDIMSampler(model).sample(**kwargs(cond), cache=False, checkpoint_steps=True)
            assert not torch.is_grad_enabled()
        assert z.grad_fn is not None and model.training and model.model.training
        assert not model.first_stage_model.training  # upstream keeps the first stage in eval
        assert not {"eval", "apply_model"} & vars(model).keys()
        assert sampling.active_options() is None and not ldm_sampling.sampling_models
        with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
            DDIMSampler(model).sample(**kwargs(cond), cache=False)
    model.eval()


def test_bad_options_are_refused(model):
    cond = audioldm_cond(1)
    with gradpatch.applied("audioldm"):
        with pytest.raises(ValueError, match="cache=False"):
            DDIMSampler(model).sample(**kwargs(cond), grad_steps=2)
        with pytest.raises(ValueError, match="positive"):
            DDIMSampler(model).sample(**kwargs(cond), cache=False, grad_steps=0)
        with pytest.raises(RuntimeError, match="no effect"):
            model.decode_first_stage(torch.zeros(1, *SHAPE), cache=False, checkpoint_steps=True)
        with pytest.raises(TypeError, match="True or False"):  # "False" is truthy: never read as True
            DDIMSampler(model).sample(**kwargs(cond), cache="False")
        with pytest.warns(gradpatch.ConfigWarning, match="did you mean grad_steps="):
            # DDIMSampler.sample's **kwargs would swallow the misspelt option silently
            DDIMSampler(model).sample(**{**kwargs(cond), "S": 1}, cache=False, grad_step=1)
        for method in (model.generate_sample, model.generate_sample_masked):
            with pytest.raises(NotDifferentiableError, match="sample_log.*decode_first_stage"):
                method([], cache=False)
        assert "apply_model" not in vars(model)


def perturbed_ema(seed=2):
    """A model whose EMA weights differ from its live weights."""
    model = audioldm_ldm(seed=seed)
    with torch.no_grad():
        for p in unet_params(model):
            p.add_(torch.randn_like(p) * 0.05)
    return model


def live_weights(model):
    return [p.detach().clone() for p in unet_params(model)]


def test_ema_scope_silently_corrupts_gradients_upstream():
    """What the guard prevents: a graph built inside ema_scope and backpropagated after it exits."""
    model, cond = perturbed_ema(), audioldm_cond(1)
    ema_copy = copy.deepcopy(model)
    ema_copy.model_ema.copy_to(ema_copy.model)
    correct = reference_grads(ema_copy, cond)
    torch.manual_seed(3)
    with torch.enable_grad():
        with model.ema_scope():
            z, _ = upstream_sampler(model).sample(**kwargs(cond))
            loss = loss_of(decode(model, z))
        wrong = grads(model, loss)  # no error upstream
    errors = [((w - c).norm() / c.norm()).item() for w, c in zip(wrong, correct) if c.norm() > 0]
    assert max(errors) > 0.1, errors


def test_ema_scope_and_cache_false_refuse_each_other():
    model, cond = perturbed_ema(), audioldm_cond(1)
    before = live_weights(model)
    with gradpatch.applied("audioldm"):
        with pytest.raises(RuntimeError, match="ema_scope"):
            with model.ema_scope():
                DDIMSampler(model).sample(**kwargs(cond), cache=False)
        assert all(torch.equal(a, b) for a, b in zip(live_weights(model), before))  # live weights restored

        def enter_ema(*args):
            with model.ema_scope():
                pass

        with pytest.raises(RuntimeError, match="ema_scope"):
            DDIMSampler(model).sample(**kwargs(cond, img_callback=enter_ema), cache=False)
        assert all(torch.equal(a, b) for a, b in zip(live_weights(model), before))

        # A graph built outside, then an EMA swap (e.g. logging EMA samples), then backward: an error.
        z, _ = DDIMSampler(model).sample(**kwargs(cond), cache=False)
        with model.ema_scope():
            pass
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.square().mean().backward()
        # Graphs entirely on one side of a scope are unaffected.
        z, _ = DDIMSampler(model).sample(**kwargs(cond), cache=False)
        z.square().mean().backward()
        assert not ldm_sampling.ema_models and not ldm_sampling.sampling_models


def test_sampler_buffers_follow_the_model(model):
    with gradpatch.applied("audioldm"):
        sampler = DDIMSampler(model)
        sampler.make_schedule(STEPS, verbose=False)
    assert sampler.betas.device == sampler.alphas_cumprod.device == model.betas.device


def test_catalogue_knows_the_git_variants():
    """AudioLDM's unreleased git HEAD moved register_buffer to the model's device (fixed upstream);
    tango's ddim_sampling only adds ``leave=False`` to tqdm (known). Rebuilt here from the 0.1.1 source."""
    from audioldm.latent_diffusion import ddim
    from gradpatch.patching.activation import known_patches
    from gradpatch.patching.fingerprint import fingerprint_source

    source = inspect.getsource(ddim)
    cuda = 'if attr.device != torch.device("cuda"):\n                attr = attr.to(torch.device("cuda"))'
    head = source.replace(cuda,
                          "if attr.device != self.model.device:\n"
                          "                attr = attr.to(self.model.device)")
    tango = source.replace('iterator = tqdm(time_range, desc="DDIM Sampler", total=total_steps)',
                           'iterator = tqdm(time_range, desc="DDIM Sampler", total=total_steps, leave=False)')
    assert head != source and tango != source
    patches = known_patches()
    assert fingerprint_source(head, ["DDIMSampler.register_buffer"]) in \
        patches["audioldm.DDIMSampler.register_buffer"].recognise.fixed
    assert "tango" in patches["audioldm.DDIMSampler.ddim_sampling"].recognise.known[
        fingerprint_source(tango, ["DDIMSampler.ddim_sampling"])]


def test_img2img_path_and_first_stage_encode(model):
    """``stochastic_encode`` + ``DDIMSampler.decode`` (img2img; a step = one ``p_sample_ddim``) and
    ``encode_first_stage``, against upstream's bodies bound by hand."""
    D = DDIMSampler
    cond = audioldm_cond(1)
    mel = torch.randn(1, 1, 32, 32, generator=torch.Generator().manual_seed(4))
    raw = {name: inspect.unwrap(vars(D)[name]) for name in ("stochastic_encode", "decode")}
    encode = inspect.unwrap(vars(LatentDiffusion)["encode_first_stage"])  # outside applied(): upstream's

    def reference(no_grad_calls):
        sampler = upstream_sampler(model)
        sampler.make_schedule(STEPS, verbose=False)
        x = mel.clone().requires_grad_(True)
        torch.manual_seed(6)
        with no_grad_first(model, no_grad_calls), torch.enable_grad():
            z0 = encode(model, x).mode()
            zt = raw["stochastic_encode"](sampler, z0, torch.tensor([4]))
            out = raw["decode"](sampler, zt, cond, 5, unconditional_guidance_scale=2.0,
                                unconditional_conditioning=torch.zeros_like(cond))
            return _with_input_grad(model, loss_of(out), x)

    with gradpatch.applied("audioldm"):
        sampler = DDIMSampler(model)
        sampler.make_schedule(STEPS, verbose=False)
        x = mel.clone().requires_grad_(True)
        torch.manual_seed(6)
        z0 = model.encode_first_stage(x, cache=False).mode()
        zt = sampler.stochastic_encode(z0, torch.tensor([4]), cache=False)
        out = sampler.decode(zt, cond, 5, unconditional_guidance_scale=2.0,
                             unconditional_conditioning=torch.zeros_like(cond), cache=False, grad_steps=2)
        got = _with_input_grad(model, loss_of(out), x)
        assert model.encode_first_stage(mel).mode().grad_fn is None  # cache=True: upstream's no_grad
    want = reference(no_grad_calls=3)
    # grad_steps=2 of 5: the latent entering step 3 is detached, so the input mel (reached only through
    # the initial latent) gets no gradient; the reference's early no_grad calls leave it a path.
    assert got[-1] is None and want[-1] is not None
    assert_close_set(got[:-1], want[:-1])


def _with_input_grad(model, loss, x):
    model.zero_grad(set_to_none=True)
    x.grad = None
    loss.backward()
    return [p.grad.clone() for p in unet_params(model)] + [None if x.grad is None else x.grad.clone()]


def test_pixel_space_ddpm_loop():
    """``DDPM.p_sample_loop`` (no ``apply_model``: the network is ``model.model``), a 4-step schedule."""
    from audioldm.latent_diffusion.ddpm import DDPM
    from gradpatch.testing import AUDIOLDM_TINY, reinit_zero_weights

    unet = {**{k: v for k, v in AUDIOLDM_TINY.items() if not k.startswith("extra_film")},
            "use_spatial_transformer": False}
    torch.manual_seed(0)
    ddpm = DDPM({"target": "audioldm.latent_diffusion.openaimodel.UNetModel", "params": unet}, timesteps=4,
                channels=4, latent_t_size=16, latent_f_size=16, use_ema=False, monitor=None)
    reinit_zero_weights(ddpm.model, seed=0)
    loop, step = (inspect.unwrap(vars(DDPM)[n]) for n in ("p_sample_loop", "p_sample"))
    torch.manual_seed(1)
    with torch.enable_grad():
        ddpm.p_sample = types.MethodType(step, ddpm)
        calls = [0]

        def pre(module, args):
            calls[0] += 1
            torch.set_grad_enabled(calls[0] > 2)

        def post(*args):
            torch.set_grad_enabled(True)

        handles = [ddpm.model.register_forward_pre_hook(pre), ddpm.model.register_forward_hook(post)]
        want = grads(ddpm, loop(ddpm, (1, *SHAPE)).square().mean())
        for h in handles:
            h.remove()
        del ddpm.p_sample
    with gradpatch.applied("audioldm"):
        torch.manual_seed(1)
        got = grads(ddpm, ddpm.p_sample_loop((1, *SHAPE), cache=False, grad_steps=2).square().mean())
        assert "forward" not in vars(ddpm.model)
    assert calls[0] == 4
    assert_close_set(got, want)


def test_a_concurrent_cache_true_call_is_unaffected(model):
    """Thread A (cache=False, checkpoint_steps, grad_steps) holds its shadows on the model while thread
    B samples the same model with cache=True: B gets upstream's output bit for bit, A the reference."""
    cond = audioldm_cond(1)
    torch.manual_seed(9)
    want_b, _ = upstream_sampler(model, unwrapped=False).sample(**kwargs(cond))
    want_a = reference_grads(model, cond, no_grad_calls=STEPS - 2)
    order, got = Interleaved(), {}

    def run_a():
        got["a"] = patched_grads(model, cond, grad_steps=2, checkpoint_steps=True)

    def run_b():
        torch.manual_seed(9)  # the generator is global: A is paused, so B alone draws from it
        got["b"], _ = DDIMSampler(model).sample(**kwargs(cond))

    handle = model.model.register_forward_pre_hook(order.pause)
    try:
        with gradpatch.applied("audioldm"):
            order.run(run_a, run_b)
    finally:
        handle.remove()
    assert torch.equal(got["b"], want_b) and got["b"].grad_fn is None
    assert_close_set(got["a"], want_a)
    assert not {"eval", "apply_model"} & vars(model).keys()


def test_a_decorated_method_no_patch_covers_is_named(model):
    """Every decorated method of AudioLDM's classes is declared (no warning); a subclass's own one is
    named once, at its class's first cache=False call."""
    import warnings

    class MySampler(DDIMSampler):
        @torch.no_grad()
        def my_helper(self):
            return None

    cond = audioldm_cond(1)
    with gradpatch.applied("audioldm"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DDIMSampler(model).sample(**kwargs(cond, S=2), cache=False)
        assert not [w for w in caught if "not patched" in str(w.message)]
        MySampler(model).sample(**kwargs(cond, S=2), cache=False)
        MySampler(model).sample(**kwargs(cond, S=2), cache=False)
    named = [str(w.message) for w in caught if "not patched" in str(w.message)]
    assert len(named) == 1 and "MySampler.my_helper" in named[0], named
