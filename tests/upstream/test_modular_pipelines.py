"""diffusers Modular Pipelines with ``cache=False``: real diffusers modular blocks, tiny random
components (float64), no weights, no downloads.

The pipeline is assembled from the Stable Diffusion XL modular blocks diffusers ships
(``StableDiffusionXLInputStep``, ``StableDiffusionXLBeforeDenoiseStep``, ``StableDiffusionXLDenoiseStep``:
the loop ``StableDiffusionXLDenoiseLoopWrapper`` over ``StableDiffusionXLLoopBeforeDenoiser``,
``StableDiffusionXLLoopDenoiser`` (CFG through diffusers' guider), ``StableDiffusionXLLoopAfterDenoiser``,
and ``StableDiffusionXLDecodeStep``) with ``SequentialPipelineBlocks.from_blocks_dict``, which makes a
``StableDiffusionXLModularPipeline``, plus small block classes defined here: a prompt adapter (a
``torch.nn.Module`` component set with ``update_components``) and, defined after ``apply()``, a loop
sub-block applying a pre-net to the latent inside the loop. The shipped ``StableDiffusionXLAutoBlocks``
start with the CLIP text-encoder step, whose tokenizers need vocabulary files (a download): prompt
embeddings are inputs instead. The hand reference is the same computation written as a plain loop with
grad on, on the same component objects.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import diffusers  # noqa: E402,F401  (a declared package: fail, not skip, when it is missing)
from diffusers import DDIMScheduler  # noqa: E402
from diffusers.modular_pipelines import (  # noqa: E402
    ModularPipelineBlocks)
from diffusers.modular_pipelines.modular_pipeline import LoopSequentialPipelineBlocks, ModularPipeline  # noqa: E402
from diffusers.modular_pipelines.stable_diffusion_xl import denoise  # noqa: E402

import gradpatch  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore:.*deprecated"),
              pytest.mark.usefixtures("single_thread")]
from modular_tiny import (  # noqa: E402
    SCALE, SEED, TIME_IDS, build, call_kwargs, embeds, latent_shift_block)


def hand(modules: dict, embeds: list[torch.Tensor], steps: int, detach_at: int | None = None) -> torch.Tensor:
    """The pipeline's computation written by hand, grad on; ``detach_at``: the latent entering that
    step is detached (DRaFT-K with K = steps - detach_at)."""
    unet, vae, adapter, pre = (modules.get(name) for name in ("unet", "vae", "prompt_adapter", "latent_shift"))
    scheduler = DDIMScheduler(clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    scheduler.set_timesteps(steps)
    prompt, negative = embeds[0] + adapter(embeds[0]), embeds[1] + adapter(embeds[1])
    ids = torch.tensor([TIME_IDS], dtype=torch.float64)
    latents = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(SEED), dtype=torch.float64)
    latents = latents * scheduler.init_noise_sigma
    for i, t in enumerate(scheduler.timesteps):
        if i == detach_at:
            latents = latents.detach()
        x = scheduler.scale_model_input(latents, t)
        if pre is not None:
            x = x + pre(x)
        cond = unet(x, t, encoder_hidden_states=prompt, added_cond_kwargs={"text_embeds": embeds[2], "time_ids": ids})[0]
        uncond = unet(x, t, encoder_hidden_states=negative,
                      added_cond_kwargs={"text_embeds": embeds[3], "time_ids": ids})[0]
        latents = scheduler.step(uncond + SCALE * (cond - uncond), t, latents, eta=0.0).prev_sample
    image = vae.decode(latents / vae.config.scaling_factor)[0]
    return (image / 2 + 0.5).clamp(0, 1)


def _trainable(modules: dict, embeds: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every trainable tensor: every parameter of every module but the VAE's encoder (decoding does
    not use it), and the prompt embeddings."""
    named = {f"{m}.{n}": p for m, module in modules.items() for n, p in module.named_parameters()
             if not n.startswith(("encoder.", "quant_conv.")) or m != "vae"}
    return {**named, **{f"embeds[{i}]": e for i, e in enumerate(embeds)}}


def _grads(out: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * weights).sum(), list(tensors.values()), allow_unused=True)
    return {name: torch.zeros_like(t) if g is None else g for (name, t), g in zip(tensors.items(), grads)}


def _same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-9) -> None:
    """Every gradient equal to the reference's, near-zero ones against a floor of the largest."""
    floor = rtol * max(g.abs().max().item() for g in want.values())
    assert floor > 0
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=rtol, atol=floor, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def built():
    return build()  # before apply(): the pipeline instance and block classes predate the patches


def test_upstream_gives_no_gradient(built):
    pipe, modules = built
    inputs = embeds()
    out = pipe(**call_kwargs(inputs, 2))
    assert out.grad_fn is None and not out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


def test_cache_true_is_bitwise_upstream_and_signature(built):
    pipe, modules = built
    inputs = embeds()
    before = pipe(**call_kwargs(inputs, 2))
    with gradpatch.applied("diffusers") as report:
        statuses = {r.patch: r.status for r in report}
        assert statuses["diffusers.modular_pipelines"] == gradpatch.Status.APPLIED
        assert statuses["diffusers.modular_pipelines.blocks"] == gradpatch.Status.APPLIED
        assert {"cache", "grad_steps", "checkpoint_steps", "output"} <= set(
            __import__("inspect").signature(ModularPipeline.__call__).parameters)
        after, explicit = pipe(**call_kwargs(inputs, 2)), pipe(**call_kwargs(inputs, 2), cache=True)
        with pytest.raises(ValueError, match="cache=False"):
            pipe(**call_kwargs(inputs, 2), grad_steps=1)
    assert after.grad_fn is None and explicit.grad_fn is None
    assert torch.equal(before, after) and torch.equal(before, explicit)


def test_cache_false_gradients_equal_the_hand_written_computation(built):
    pipe, modules = built
    inputs = embeds()
    modules["unet"].train()
    try:
        with gradpatch.applied("diffusers"):
            out = pipe(**call_kwargs(inputs, 3), cache=False)
        assert modules["unet"].training  # eval() was a no-op for the call
    finally:
        modules["unet"].eval()
    ref = hand(modules, inputs, 3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    tensors = _trainable(modules, inputs)
    want = _grads(ref, tensors)
    zero = sorted(name for name, g in want.items() if not g.any())
    assert not zero, zero
    _same_grads(_grads(out, tensors), want)


def test_grad_steps_and_checkpoint_steps_with_a_block_defined_after_apply():
    steps = 4
    with gradpatch.applied("diffusers"):
        shift = latent_shift_block()  # defined (and its loop wrapper) after apply()
        assert hasattr(vars(shift)["__call__"], "__gradpatch_original__")
        pipe, modules = build(shift)
        inputs = embeds()
        tensors = _trainable(modules, inputs)
        plain = pipe(**call_kwargs(inputs, steps), cache=False)
        checkpointed = pipe(**call_kwargs(inputs, steps), cache=False, checkpoint_steps=True)
        last = {k: pipe(**call_kwargs(inputs, steps), cache=False, grad_steps=k) for k in (1, 2)}
        both = pipe(**call_kwargs(inputs, steps), cache=False, grad_steps=2, checkpoint_steps=True)
        everything = pipe(**call_kwargs(inputs, steps), cache=False, grad_steps=steps)
    ref = hand(modules, inputs, steps)
    torch.testing.assert_close(plain, ref, rtol=1e-10, atol=1e-12)
    plain_grads = _grads(plain, tensors)
    _same_grads(plain_grads, _grads(ref, tensors))
    _same_grads(_grads(checkpointed, tensors), plain_grads)
    _same_grads(_grads(everything, tensors), plain_grads)
    for k, out in last.items():
        want = _grads(hand(modules, inputs, steps, detach_at=steps - k), tensors)
        assert any(g.any() for n, g in want.items() if n.startswith("latent_shift"))  # the pre-net gets its share
        got = _grads(out, tensors)
        _same_grads(got, want)
        assert not torch.allclose(got["unet.conv_in.weight"], plain_grads["unet.conv_in.weight"])  # (a cut)
    _same_grads(_grads(both, tensors), _grads(hand(modules, inputs, steps, detach_at=steps - 2), tensors))
    assert all("forward" not in vars(m) for m in modules.values())


def test_grad_steps_through_two_denoising_loops_is_an_error():
    """A block running the shipped loop twice: grad_steps cannot tell which loop's steps to count."""
    with gradpatch.applied("diffusers"):
        class TwiceDenoiseStep(denoise.StableDiffusionXLDenoiseStep):
            @torch.no_grad()
            def __call__(self, components, state):
                components, state = super().__call__(components, state)
                return super().__call__(components, state)

        pipe, modules = build(loop=TwiceDenoiseStep)
        inputs = embeds()
        assert pipe(**call_kwargs(inputs, 2), cache=False, checkpoint_steps=True).requires_grad
        with pytest.raises(RuntimeError, match="second denoising loop"):
            pipe(**call_kwargs(inputs, 2), cache=False, grad_steps=1)


def _block_classes() -> list[type]:
    found, pending = [ModularPipelineBlocks], [ModularPipelineBlocks]
    while pending:
        for cls in pending.pop().__subclasses__():
            if cls not in found:
                found.append(cls)
                pending.append(cls)
    return found


def test_revert_restores_every_class_exactly():
    import diffusers.modular_pipelines as mp

    for name in dir(mp):  # the lazy module: import every block class diffusers ships
        getattr(mp, name, None)
    snapshot = {(cls, name): vars(cls)[name] for cls in _block_classes() for name in ("__call__", "loop_step")
                if name in vars(cls)}
    call = vars(ModularPipeline)["__call__"]
    with gradpatch.applied("diffusers"):
        patched = [key for key, value in snapshot.items() if vars(key[0])[key[1]] is not value]
        late = latent_shift_block()
        assert hasattr(vars(late)["__call__"], "__gradpatch_original__")
        assert vars(ModularPipeline)["__call__"] is not call
    decorated = [key for key, value in snapshot.items() if hasattr(value, "__wrapped__") and key[1] == "__call__"]
    assert len(decorated) > 300 and set(decorated) <= set(patched), (len(decorated), len(patched))
    assert (LoopSequentialPipelineBlocks, "loop_step") in patched
    assert {key: vars(key[0])[key[1]] for key in snapshot} == snapshot
    assert all(vars(key[0])[key[1]] is value for key, value in snapshot.items())
    assert vars(ModularPipeline)["__call__"] is call and "__init_subclass__" not in vars(ModularPipelineBlocks)
    assert not hasattr(vars(late)["__call__"], "__gradpatch_original__")  # defined during apply: restored
    assert not hasattr(vars(latent_shift_block())["__call__"], "__gradpatch_original__")  # after: untouched


def test_cache_false_without_the_block_patch_is_an_error(built):
    """The pipeline's patch alone would lift its in-body no_grad while every block stays decorated."""
    pipe, modules = built
    with gradpatch.applied("diffusers", exclude=["diffusers.modular_pipelines.blocks"]):
        with pytest.raises(gradpatch.NotDifferentiableError, match="diffusers.modular_pipelines.blocks"):
            pipe(**call_kwargs(embeds(), 2), cache=False)
