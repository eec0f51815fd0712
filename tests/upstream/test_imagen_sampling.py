"""imagen-pytorch 2.1.0: ``Imagen.sample`` (decorated at every level, ``eval_decorator`` not ``wraps``-based).

A tiny random one-stage ``Imagen`` (8x8, three steps) with text embeddings passed in: no T5 runs and no
weights are read. ``import imagen_pytorch`` reads ``T5Config.from_pretrained("google/t5-v1_1-base")``
at import, so the import below is served from a temporary Hugging Face cache holding only that model's
``config.json`` (offline; a configuration, not weights). The reference is the same code with its
blockers removed by hand: ``sample`` replaced by the function under ``no_grad`` and ``eval_decorator``
(reached through the decorator's closure), ``p_sample_loop`` and ``p_sample`` by their ``__wrapped__``
bodies, and for ``grad_steps=K`` the image entering step N-K detached. Upstream is shown giving no
graph in the same test. Marked ``upstream_wave``.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
T5 = "google/t5-v1_1-base"


def _import_offline() -> Any:
    """``imagen_pytorch``, its import-time T5 config read from a temporary cache (offline)."""
    import huggingface_hub.constants as hub

    saved = hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE
    with tempfile.TemporaryDirectory() as cache:
        repo = os.path.join(cache, "models--" + T5.replace("/", "--"))
        os.makedirs(os.path.join(repo, "snapshots", "0" * 40))
        os.makedirs(os.path.join(repo, "refs"))
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write("0" * 40)
        with open(os.path.join(repo, "snapshots", "0" * 40, "config.json"), "w") as f:
            json.dump({"model_type": "t5", "d_model": 768, "num_heads": 12, "num_layers": 12, "d_ff": 2048,
                       "feed_forward_proj": "gated-gelu", "vocab_size": 32128}, f)
        hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE = cache, True
        try:
            return pytest.importorskip("imagen_pytorch")
        finally:
            hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE = saved


imagen_pytorch = _import_offline()

import gradpatch  # noqa: E402
from support import assert_grads_close, upstream_method, weighted_grads  # noqa: E402
from gradpatch.testing import reinit_zero_weights  # noqa: E402

pytestmark = [pytest.mark.upstream_wave, pytest.mark.usefixtures("single_thread")]
STEPS, EMBED = 3, 16


def _model() -> Any:
    from imagen_pytorch import Imagen, Unet

    torch.manual_seed(0)
    unet = Unet(dim=16, text_embed_dim=EMBED, cond_dim=16, dim_mults=(1, 2), num_resnet_blocks=1,
                layer_attns=(False, True), layer_cross_attns=(False, True), attn_heads=2, attn_dim_head=8,
                channels=3, attn_pool_num_latents=4, max_text_len=4)
    imagen = Imagen(unets=(unet,), image_sizes=(8,), timesteps=STEPS, text_embed_dim=EMBED, cond_drop_prob=0.5)
    return reinit_zero_weights(imagen, std=0.05).eval()


def _embeds() -> Any:
    return torch.randn(1, 4, EMBED, generator=torch.Generator().manual_seed(5))


@contextlib.contextmanager
def _hand_fixed(first: int) -> Iterator[None]:
    """``sample``, ``p_sample_loop``, ``p_sample`` undecorated; the image entering step ``first`` detached."""
    from imagen_pytorch import Imagen

    originals = {name: vars(Imagen)[name] for name in ("sample", "p_sample_loop", "p_sample")}
    inner = upstream_method(Imagen, "sample").__wrapped__  # eval_decorator's inner: the function in its closure
    raw = {"sample": dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__)))["fn"],
           "p_sample_loop": upstream_method(Imagen, "p_sample_loop").__wrapped__,
           "p_sample": upstream_method(Imagen, "p_sample").__wrapped__}
    count = [0]

    def p_sample(self, unet, x, *args, **kwargs):
        count[0] += 1
        return raw["p_sample"](self, unet, x.detach() if count[0] - 1 == first else x, *args, **kwargs)

    for name, method in {**raw, "p_sample": p_sample}.items():
        setattr(Imagen, name, method)
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(Imagen, name, method)


def _grads(out: Any, model: Any) -> list[Any]:
    return weighted_grads(out, model.parameters())


def _stage(model: Any, **options: Any) -> Any:
    """One stage through ``p_sample_loop``, as ``sample`` calls it."""
    embeds = _embeds()
    return model.p_sample_loop(model.unets[0], (1, 3, 8, 8), noise_scheduler=model.noise_schedulers[0],
                               text_embeds=embeds, text_mask=torch.ones(1, 4, dtype=torch.bool), cond_scale=2.0,
                               use_tqdm=False, **options)


@pytest.mark.parametrize("cond_scale", [1.0, 2.0], ids=["no-cfg", "cfg"])
def test_sample_gradients_equal_the_hand_fixed_code(cond_scale: float) -> None:
    model = _model()
    from imagen_pytorch import Imagen

    upstream = upstream_method(Imagen, "sample").__get__(model)(text_embeds=_embeds(), cond_scale=cond_scale,
                                                                use_tqdm=False)
    assert not upstream.requires_grad
    with gradpatch.applied("imagen_pytorch"):
        torch.manual_seed(0)
        got = _grads(model.sample(text_embeds=_embeds(), cond_scale=cond_scale, use_tqdm=False, cache=False), model)
    torch.manual_seed(0)
    with _hand_fixed(-1):
        want = _grads(model.sample(text_embeds=_embeds(), cond_scale=cond_scale, use_tqdm=False), model)
    assert_grads_close(got, want)
    assert sum(w is not None and bool(w.any()) for w in want) > 0.7 * len(want)


@pytest.mark.parametrize("options", [{}, {"grad_steps": 1}, {"grad_steps": 2}, {"checkpoint_steps": True}],
                         ids=["plain", "grad_steps=1", "grad_steps=2", "checkpoint_steps"])
def test_stage_gradients_equal_the_hand_fixed_code(options: dict) -> None:
    model = _model()
    with gradpatch.applied("imagen_pytorch"):
        torch.manual_seed(0)
        got = _grads(_stage(model, cache=False, **options), model)
    torch.manual_seed(0)
    with _hand_fixed(STEPS - options.get("grad_steps", STEPS)):
        want = _grads(_stage(model), model)
    assert_grads_close(got, want)
    if not options:
        assert sum(w is not None and bool(w.any()) for w in want) > 0.7 * len(want)


def test_step_options_are_per_stage_and_a_changed_count_raises() -> None:
    model = _model()
    with gradpatch.applied("imagen_pytorch"):
        with pytest.raises(ValueError, match=r"Imagen\.sample\): grad_steps and checkpoint_steps need step="):
            model.sample(text_embeds=_embeds(), use_tqdm=False, cache=False, grad_steps=1)
        with pytest.raises(RuntimeError, match="step was called 2 times, but steps says 3"):
            _stage(model, cache=False, grad_steps=1, skip_steps=1)
        assert _stage(model, cache=False, checkpoint_steps=True, skip_steps=1).requires_grad


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_the_callers_mode_holds(training: bool) -> None:
    model = _model().train(training)
    with gradpatch.applied("imagen_pytorch"):
        seen, unet = [], model.unets[0]
        forward = unet.forward  # called as self.forward() by forward_with_cond_scale: hooks do not see it
        unet.forward = lambda *a, **k: (seen.append(unet.training), forward(*a, **k))[1]
        out = model.sample(text_embeds=_embeds(), use_tqdm=False, cache=False)
        del unet.forward
    assert out.requires_grad and seen == [training] * STEPS
    assert all(m.training == training for m in model.modules())


def test_cache_true_is_upstream_bitwise() -> None:
    model = _model()
    from imagen_pytorch import Imagen

    torch.manual_seed(0)
    want = upstream_method(Imagen, "sample").__get__(model)(text_embeds=_embeds(), use_tqdm=False)
    with gradpatch.applied("imagen_pytorch") as records:
        assert {r.patch: r.status.value for r in records} == {"imagen_pytorch.sample": "applied",
                                                               "imagen_pytorch.p_sample_loop": "applied"}
        torch.manual_seed(0)
        got = model.sample(text_embeds=_embeds(), use_tqdm=False)
    assert torch.equal(got, want) and not got.requires_grad
