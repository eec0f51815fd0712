"""DiffSynth-Studio (``diffsynth`` 2.1.12) with ``cache=False``: the real pipeline classes, tiny components.

``WanVideoPipeline`` and ``ZImagePipeline`` run their own ``__call__`` bodies (scheduler, unit runner,
denoising loop, CFG, VAE call) with their units, ``model_fn``, DiT and VAE replaced by tiny float64
modules; gradients of every trainable tensor (DiT, text embedding, VAE) are compared with the same
loop written by hand with grad on. The DeepSpeed block checkpoint runs in a fresh interpreter (it
needs a process group). Not skipped when diffsynth is missing: it is a declared test dependency.
"""
from __future__ import annotations

import inspect
import json

import pytest
import torch

import gradpatch
from gradpatch.errors import NotDifferentiableError
from diffsynth_tiny import call_kwargs, model_fn, pipeline
from support import assert_grads_close, run_python

import diffsynth  # noqa: F401  (declared: fails, never skips, when missing)
from diffsynth.diffusion.base_pipeline import BasePipeline
from diffsynth.pipelines.wan_video import WanVideoPipeline
from diffsynth.pipelines.z_image import ZImagePipeline

pytestmark = pytest.mark.usefixtures("single_thread")
STEPS, CFG = 4, 2.0


def _call(pipe, video: bool, **options):
    return pipe(**call_kwargs(video, STEPS, CFG), **options)


def _params(pipe) -> list[torch.Tensor]:
    return [*pipe.dit.parameters(), *pipe.text.parameters(), *pipe.vae_decoder.parameters()]


def _reference(pipe, noise, video: bool, grad_steps: int | None = None) -> torch.Tensor:
    """The loop written by hand: CFG, the flow-matching Euler step on the pipeline's own schedule,
    the latent detached at the top of step N-K."""
    timesteps, sigmas = pipe.scheduler.timesteps, pipe.scheduler.sigmas
    posi, nega = pipe.text("a cat"), pipe.text("blurry")
    x = noise[:, :, 0] if video else noise
    for i, t in enumerate(timesteps):
        if grad_steps is not None and i == STEPS - grad_steps:
            x = x.detach()
        t = t.unsqueeze(0).double()
        v = pipe.dit(x, t, nega) + CFG * (pipe.dit(x, t, posi) - pipe.dit(x, t, nega))
        x = x + v * ((sigmas[i + 1] if i + 1 < len(timesteps) else 0) - sigmas[i])
    return pipe.vae_decoder(x)[:, :, None] if video else pipe.vae_decoder(x)


def _grads(out, params):
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return list(torch.autograd.grad((out * weights).sum(), params, allow_unused=True))


@pytest.fixture
def applied():
    with gradpatch.applied("diffsynth") as report:
        yield {r.patch: r for r in report}


def test_upstream_gives_no_graph_and_takes_no_cache():
    pipe, _ = pipeline(WanVideoPipeline, video=True)
    assert not hasattr(WanVideoPipeline.__call__, "__gradpatch_original__")
    with pytest.raises(TypeError, match="cache"):
        _call(pipe, True, cache=False)
    assert _call(pipe, True).grad_fn is None


@pytest.mark.parametrize("options", [{}, {"grad_steps": 2}, {"checkpoint_steps": True}, {"grad_steps": 1,
                                                                                         "checkpoint_steps": True}])
@pytest.mark.parametrize("cls", [WanVideoPipeline, ZImagePipeline])
def test_cache_false_gradients_equal_the_hand_written_loop(applied, cls, options):
    assert applied["diffsynth.pipelines"].status == gradpatch.Status.APPLIED
    video = cls is WanVideoPipeline
    pipe, noise = pipeline(cls, video)
    if not video:  # its body ends in vae_output_to_image (PIL): this instance keeps the tensor instead
        pipe.vae_output_to_image = lambda image, **kw: image
    params = _params(pipe)
    out = _call(pipe, video, cache=False, **options)
    assert "model_fn" not in vars(pipe) or vars(pipe)["model_fn"] is model_fn  # the shadow is gone
    got = _grads(out, params)
    want_out = _reference(pipe, noise, video, options.get("grad_steps"))
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    want = _grads(want_out, params)
    assert all(w is not None for w in want)  # DiT, text embedding and VAE all get gradients
    assert_grads_close(got, want, rtol=1e-9)


def test_cache_true_is_bitwise_upstream_and_the_signature(applied):
    pipe, _ = pipeline(WanVideoPipeline, video=True)
    before = WanVideoPipeline.__call__.__gradpatch_original__(pipe, **call_kwargs(True, STEPS, CFG))
    assert torch.equal(_call(pipe, True), before) and torch.equal(_call(pipe, True, cache=True), before)
    assert {"cache", "grad_steps", "checkpoint_steps", "output_type"} <= set(
        inspect.signature(WanVideoPipeline.__call__).parameters)
    with pytest.raises(ValueError, match="cache=False"):
        _call(pipe, True, grad_steps=1)


def test_pil_output_is_an_error_saying_how_to_get_the_tensor(applied):
    pipe, _ = pipeline(ZImagePipeline, video=False)
    with pytest.raises(NotDifferentiableError, match="vae_output_to_image.*lambda image"):
        _call(pipe, False, cache=False)  # the body ends in a PIL image: never returned detached
    video, _ = pipeline(WanVideoPipeline, video=True)
    with pytest.raises(ValueError, match="output_type='floatpoint'"):
        video(prompt="a cat", num_inference_steps=2, output_type="quantized", cache=False)


def test_class_defined_after_apply_and_revert(applied):
    class Mine(BasePipeline):
        @torch.no_grad()
        def __call__(self, x, steps=2, progress_bar_cmd=None):
            return self.lin(x)

    mine = Mine(device="cpu", torch_dtype=torch.float64)
    mine.lin = torch.nn.Linear(2, 2).double()
    assert mine(torch.ones(1, 2, dtype=torch.float64)).grad_fn is None
    assert mine(torch.ones(1, 2, dtype=torch.float64), cache=False).grad_fn is not None
    with pytest.raises(RuntimeError, match="had no effect"):  # no denoising loop over pipe.scheduler.timesteps
        mine.model_fn = model_fn
        mine(torch.ones(1, 2, dtype=torch.float64), cache=False, checkpoint_steps=True)
    gradpatch.revert("diffsynth")
    assert not hasattr(WanVideoPipeline.__call__, "__gradpatch_original__")
    assert not hasattr(Mine.__call__, "__gradpatch_original__")


DEEPSPEED = r"""
import json, tempfile, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/store", rank=0, world_size=1)
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
deepspeed.checkpointing.configure(mpu_=None)
import gradpatch
import diffsynth.models.wan_video_dit as dit  # imported gradient_checkpoint_forward by name

torch.manual_seed(0)
class Block(torch.nn.Module):  # a frozen linear with a trainable LoRA pair
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(6, 6).requires_grad_(False)
        self.a, self.b = torch.nn.Parameter(torch.randn(2, 6) / 3), torch.nn.Parameter(torch.randn(6, 2) / 3)
    def forward(self, x, scale=None):
        calls[self] = calls.get(self, 0) + 1
        return torch.tanh(self.base(x) + x @ self.a.T @ self.b.T * scale)
blocks = [Block() for _ in range(3)]
x0, scale = torch.randn(4, 6), torch.tensor(0.7)
params = [p for b in blocks for p in (b.a, b.b)]
calls, first_block = {}, {}  # forward calls per block; of the first block, per mode
def run(blocks, x, scale):
    for b in blocks:
        x = dit.gradient_checkpoint_forward(b, True, False, x, scale=scale)
    return x
w = torch.linspace(-1, 1, 24).view(4, 6)
got = {}
for mode in ("upstream", "patched"):
    if mode == "patched":  # applied late: dit's global gradient_checkpoint_forward is rebound
        assert {r.patch: r.status for r in gradpatch.apply("diffsynth")}[
            "diffsynth.gradient_checkpoint_forward"] == gradpatch.Status.APPLIED
    calls.clear()
    try:
        got[mode] = [g.tolist() for g in torch.autograd.grad((run(blocks, x0, scale) * w).sum(), params)]
    except RuntimeError as error:
        got[mode] = str(error)
    first_block[mode] = calls[blocks[0]]  # 2: recomputed in backward (checkpointed); 1: activations kept
import warnings
deepspeed.checkpointing.configure(mpu_=None, checkpoint_in_cpu=True)  # an option the fixed checkpoint does not apply
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run(blocks, x0, scale).sum().backward()
    run(blocks, x0, scale).sum().backward()
unapplied = [str(w.message) for w in caught if type(w.message).__name__ == "ConfigWarning"]
import copy
ref = [copy.deepcopy(b).double() for b in blocks]
out = x0.double()
for b in ref:
    out = b(out, scale=scale.double())
want = [g.tolist() for g in torch.autograd.grad((out * w.double()).sum(), [p for b in ref for p in (b.a, b.b)])]
print(json.dumps({"got": got, "want": want, "first_block": first_block, "unapplied": unapplied}))
"""


def test_deepspeed_checkpoint_path_trains_frozen_input_blocks():
    done = run_python(DEEPSPEED, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Upstream: DeepSpeed's reentrant checkpoint, which torch.autograd.grad cannot go through; and the first
    # block (its input does not require grad) runs without checkpoint, all its activations kept.
    assert isinstance(result["got"]["upstream"], str) and "not compatible with .grad()" in result["got"]["upstream"]
    assert_grads_close([torch.tensor(g, dtype=torch.float64) for g in result["got"]["patched"]],
                       [torch.tensor(g, dtype=torch.float64) for g in result["want"]], rtol=1e-4)
    assert result["first_block"] == {"upstream": 1, "patched": 2}  # the frozen-input block is checkpointed now
    # DeepSpeed's cpu_checkpointing does not apply to the fixed checkpoint: said once, with what to use instead.
    assert len(result["unapplied"]) == 1 and "cpu_checkpointing" in result["unapplied"][0]
    assert "save_on_cpu" in result["unapplied"][0]


def test_animate_motion_encoder_parameters_get_gradients():
    """``Generator.get_motion`` (Wan-Animate's motion encoder) checkpoints ``enc_motion`` reentrantly on face
    frames that never require grad: upstream, the encoder gets no gradient at all."""
    import copy

    from diffsynth.models.wan_video_animate_adapter import Generator

    torch.manual_seed(0)
    gen = Generator(size=8, style_dim=512, motion_dim=4).double()
    faces = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    encoder = list(gen.enc.parameters())
    with pytest.warns(UserWarning, match="requires_grad"):
        upstream = gen.get_motion(faces)
    assert _grads(upstream, encoder) == [None] * len(encoder)
    with gradpatch.applied("diffsynth") as report:
        assert {r.patch: r.status for r in report}["diffsynth.Generator.get_motion"] == gradpatch.Status.APPLIED
        out = gen.get_motion(faces)
    assert torch.equal(out, upstream)
    ref = copy.deepcopy(gen)
    want = _grads(ref.dec.direction(ref.enc.enc_motion(faces)), list(ref.parameters()))
    got = _grads(out, list(gen.parameters()))
    assert [g is None for g in want] == [g is None for g in got]
    assert any(g is not None for g in got[:len(encoder)])  # the encoder trains now
    assert_grads_close([g for g in got if g is not None], [w for w in want if w is not None], rtol=1e-9)


def test_apply_before_import_patches_every_pipeline_and_the_checkpoint():
    done = run_python("""
        import json, gradpatch
        gradpatch.apply("diffsynth")
        import torch
        from diffsynth.diffusion.base_pipeline import BasePipeline
        from diffsynth.pipelines.wan_video import WanVideoPipeline
        import diffsynth.models.wan_video_dit as dit
        from diffsynth.core.gradient import gradient_checkpoint as gc
        def classes(base):
            for cls in base.__subclasses__():
                yield cls
                yield from classes(cls)
        own = [c for c in classes(BasePipeline) if "__call__" in vars(c)]
        print(json.dumps({"pipelines": len(own),
                          "patched": sum(hasattr(c.__call__, "__gradpatch_original__") for c in own),
                          "wan": "cache" in str(__import__("inspect").signature(WanVideoPipeline.__call__)),
                          "checkpoint": dit.gradient_checkpoint_forward is gc.gradient_checkpoint_forward,
                          "status": {r.patch: str(r.status) for r in gradpatch.report() if r.upstream == "diffsynth"}}))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["pipelines"] >= 1 and result["patched"] == result["pipelines"] and result["wan"], result
    assert result["checkpoint"] and result["status"]["diffsynth.gradient_checkpoint_forward"] == "applied", result
