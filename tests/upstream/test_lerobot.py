"""LeRobot 0.6.1 (``patches/lerobot.py``) against the real package, in the lerobot test environment
(``.venv-lerobot``, Python 3.13: ``make test-lerobot``); elsewhere this module skips with that reason.

Tiny random models, no weights, no network, in float32: upstream does not run in float64 (pi0 / pi05
cast to float32 in their RMSNorm and before the action output projection; the diffusion U-Net's
sinusoidal timestep embedding is float32), so the reference runs the same float32 operations and the
comparison is to rtol 1e-4, near-zero entries against a floor scaled to the largest gradient.

- pi0 / pi05: the real ``PI0Pytorch`` / ``PI05Pytorch`` (PaliGemma VLM with the Gemma action expert, its
  own attention and KV cache), built tiny by handing ``modeling_pi0.get_gemma_config`` a 2-layer width-32
  Gemma and ``CONFIG_MAPPING["paligemma"]`` a 1-layer SigLIP (upstream hard-codes the 2B / 300M sizes).
  The prefix is language tokens only (``images=[]``): the vision tower is built but not on the path, so it
  gets no gradient, upstream or here. Covered: ``sample_actions`` end to end (prefix embedding, the VLM's
  KV-cache forward, every ``denoise_step``, the Euler loop of ``common.flow_matching``).
- diffusion: the real ``DiffusionPolicy`` (1-D conditional U-Net, diffusers DDIM scheduler), observations
  of state and environment state (no image backbone): ``predict_action_chunk`` and ``conditional_sample``.

- SmolVLA: the real ``VLAFlowMatching`` (SmolVLM with its interleaved cross/self-attention expert), its
  Hub reads (config, processor) handed a 4-layer width-32 SmolVLM config; prefix of language tokens and
  state (``images=[]``); the VLM is frozen (``train_expert_only``, upstream's default). Its
  ``sample_actions`` is not decorated in 0.6.1 (the policy's ``predict_action_chunk`` is ``@torch.no_grad()``
  around it; not declared): the patch gives it the contract's options.

Each case shows upstream failing (no graph), compares the gradient of every trainable parameter and of
the differentiable inputs with the same computation written here with grad on (``grad_steps=K``: the
latent entering step N-K detached; ``checkpoint_steps``: the plain reference), and checks that
``cache=True`` (the default) is upstream's call, bitwise.
"""
from __future__ import annotations

import functools
import importlib
import types
from typing import Any

import pytest

lerobot = pytest.importorskip(
    "lerobot", reason="LeRobot 0.6.1 needs Python >= 3.12: runs in the lerobot test environment (make test-lerobot)")

import torch  # noqa: E402

import gradpatch  # noqa: E402
from support import assert_grads_close, upstream_method, weighted_grads  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
N = 3  # Euler / DDIM steps
OPTIONS = {"plain": {}, "grad_steps=1": {"grad_steps": 1}, "grad_steps=2": {"grad_steps": 2},
           "checkpoint_steps": {"checkpoint_steps": True}}


# -- pi0 / pi05 ------------------------------------------------------------------------------------------

@functools.cache
def _pi_model(name: str) -> Any:
    """A tiny ``PI0Pytorch`` (``name="pi0"``) or ``PI05Pytorch`` (``"pi05"``), built once (the 257152-token
    embeddings upstream hard-codes take seconds to initialise); the tests only read it."""
    from transformers import PaliGemmaConfig

    module = importlib.import_module(f"lerobot.policies.{name}.modeling_{name}")
    configs = importlib.import_module(f"lerobot.policies.{name}.configuration_{name}")
    gemma = module.GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16)
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=14)
    config_class = configs.PI0Config if name == "pi0" else configs.PI05Config
    config = config_class(dtype="float32", image_resolution=(28, 28), chunk_size=4, n_action_steps=4,
                          max_action_dim=6, max_state_dim=5, num_inference_steps=N)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(module, "get_gemma_config", lambda variant: gemma)
        monkeypatch.setattr(module, "CONFIG_MAPPING", {"paligemma": lambda: PaliGemmaConfig(vision_config=vision),
                                                       "gemma": module.CONFIG_MAPPING["gemma"]})
        torch.manual_seed(0)
        model = (module.PI0Pytorch if name == "pi0" else module.PI05Pytorch)(config).eval()
    with torch.no_grad():  # pi05's adaptive RMSNorm projections start at zero: no gradient to its time MLP
        for parameter in model.parameters():
            if not parameter.any():
                parameter.normal_(0, 0.05)
    return model


def _pi(name: str) -> tuple[Any, dict]:
    """The tiny model and fresh inputs."""
    model = _pi_model(name)
    generator = torch.Generator().manual_seed(1)
    kw = dict(images=[], img_masks=[], noise=torch.randn(2, 4, 6, generator=generator))
    tokens = torch.randint(0, 100, (2, 5), generator=generator)
    masks = torch.ones(2, 5, dtype=torch.bool)
    if name == "pi0":
        kw.update(lang_tokens=tokens, lang_masks=masks,
                  state=torch.randn(2, 5, generator=generator))
    else:
        kw.update(tokens=tokens, masks=masks)
    return model, kw


def pi_reference(model: Any, first: int, **kw: Any) -> Any:
    """``sample_actions`` written out with grad on: the prefix's KV cache, then N Euler steps of
    ``x <- x + dt * denoise_step(x, t)`` from t = 1 to 0."""
    module = importlib.import_module(type(model).__module__)
    pi0 = "state" in kw
    tokens, masks = (kw["lang_tokens"], kw["lang_masks"]) if pi0 else (kw["tokens"], kw["masks"])
    embs, pad, att = model.embed_prefix(kw["images"], kw["img_masks"], tokens, masks)
    att_4d = module.prepare_attention_masks_4d(module.make_att_2d_masks(pad, att))
    model.paligemma_with_expert.paligemma.model.language_model.config._attn_implementation = "eager"
    _, kv = model.paligemma_with_expert.forward(attention_mask=att_4d, position_ids=torch.cumsum(pad, dim=1) - 1,
                                                past_key_values=None, inputs_embeds=[embs, None], use_cache=True)
    x, dt = kw["noise"], -1.0 / N
    for step in range(N):
        x = x.detach() if step == first else x
        t = torch.tensor(1.0 + step * dt, dtype=torch.float32).expand(x.shape[0])
        extra = {"state": kw["state"]} if pi0 else {}
        v = model.denoise_step(prefix_pad_masks=pad, past_key_values=kv, x_t=x, timestep=t, **extra)
        x = x + dt * v
    return x


@functools.cache
def _smolvla_model() -> Any:
    """A tiny SmolVLA ``VLAFlowMatching``: its constructor reads the SmolVLM2 config and processor from the
    Hub (``AutoConfig``/``AutoProcessor.from_pretrained``), handed here a 4-layer width-32 SmolVLM config
    and a processor with the two special token ids it reads."""
    from transformers import SmolVLMConfig

    from lerobot.policies.smolvla import smolvlm_with_expert
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import VLAFlowMatching

    vlm = SmolVLMConfig(text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                         num_key_value_heads=1, num_hidden_layers=4, vocab_size=128, head_dim=16),
                        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, patch_size=14, image_size=28))
    tokenizer = types.SimpleNamespace(fake_image_token_id=1, global_image_token_id=2)
    config = SmolVLAConfig(chunk_size=4, n_action_steps=4, max_action_dim=6, max_state_dim=5, num_steps=N,
                           num_vlm_layers=4, load_vlm_weights=False)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(smolvlm_with_expert, "AutoConfig", types.SimpleNamespace(from_pretrained=lambda _: vlm))
        monkeypatch.setattr(smolvlm_with_expert, "AutoProcessor", types.SimpleNamespace(
            from_pretrained=lambda _: types.SimpleNamespace(tokenizer=tokenizer)))
        torch.manual_seed(0)
        return VLAFlowMatching(config).eval()


def _smolvla() -> tuple[Any, dict]:
    generator = torch.Generator().manual_seed(1)
    return _smolvla_model(), dict(
        images=[], img_masks=[], lang_tokens=torch.randint(3, 100, (2, 5), generator=generator),
        lang_masks=torch.ones(2, 5, dtype=torch.bool), state=torch.randn(2, 5, generator=generator),
        noise=torch.randn(2, 4, 6, generator=generator))


def smolvla_reference(model: Any, first: int, **kw: Any) -> Any:
    """SmolVLA's ``sample_actions`` written out with grad on (the state is part of its prefix)."""
    module = importlib.import_module(type(model).__module__)
    embs, pad, att = model.embed_prefix(kw["images"], kw["img_masks"], kw["lang_tokens"], kw["lang_masks"],
                                        state=kw["state"])
    _, kv = model.vlm_with_expert.forward(attention_mask=module.make_att_2d_masks(pad, att),
                                          position_ids=torch.cumsum(pad, dim=1) - 1, past_key_values=None,
                                          inputs_embeds=[embs, None], use_cache=model.config.use_cache)
    x, dt = kw["noise"], -1.0 / N
    for step in range(N):
        x = x.detach() if step == first else x
        t = torch.tensor(1.0 + step * dt, dtype=torch.float32).expand(x.shape[0])
        x = x + dt * model.denoise_step(x_t=x, prefix_pad_masks=pad, past_key_values=kv, timestep=t)
    return x


# -- diffusion -------------------------------------------------------------------------------------------

def _diffusion() -> tuple[Any, dict]:
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    config = DiffusionConfig(
        input_features={"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(3,)),
                        "observation.environment_state": PolicyFeature(type=FeatureType.ENV, shape=(4,))},
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(2,))},
        n_obs_steps=2, horizon=8, n_action_steps=4, drop_n_last_frames=3, down_dims=(16, 32), kernel_size=3,
        n_groups=4, diffusion_step_embed_dim=16, noise_scheduler_type="DDIM", clip_sample=False,
        num_inference_steps=N, device="cpu")
    torch.manual_seed(0)
    policy = DiffusionPolicy(config).eval()
    generator = torch.Generator().manual_seed(1)
    batch = {"observation.state": torch.randn(2, 2, 3, generator=generator),
             "observation.environment_state": torch.randn(2, 2, 4, generator=generator)}
    return policy, dict(batch=batch, noise=torch.randn(2, 8, 2, generator=generator))


def ddim_reference(model: Any, first: int, cond: Any, noise: Any) -> Any:
    """``conditional_sample`` written out with grad on: N DDIM steps (eta 0, epsilon prediction, no
    clipping, "leading" spacing, the final alpha 1)."""
    alphas = model.noise_scheduler.alphas_cumprod
    ratio = model.config.num_train_timesteps // N
    x = noise
    for step, t in enumerate(range((N - 1) * ratio, -1, -ratio)):
        x = x.detach() if step == first else x
        eps = model.unet(x, torch.full(x.shape[:1], t, dtype=torch.long), global_cond=cond)
        a, a_prev = alphas[t], (alphas[t - ratio] if t - ratio >= 0 else torch.tensor(1.0))
        x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    return x


def diffusion_reference(policy: Any, first: int, batch: dict, noise: Any) -> Any:
    """``predict_action_chunk`` written out with grad on: the global conditioning (state and environment
    state of each observation step, flattened), the DDIM loop, then the executed actions."""
    model = policy.diffusion
    cond = torch.cat([batch["observation.state"], batch["observation.environment_state"]], -1).flatten(1)
    start = model.config.n_obs_steps - 1
    return ddim_reference(model, first, cond, noise)[:, start:start + model.config.n_action_steps]


# -- the cases -------------------------------------------------------------------------------------------

def _case(name: str) -> tuple[Any, dict, Any, str, list]:
    """(the object, its keyword arguments, the bound patched entry's name, its reference, its inputs)."""
    if name in ("pi0", "pi05"):
        model, kw = _pi(name)
        inputs = [kw["noise"]] + ([kw["state"]] if name == "pi0" else [])
        return model, kw, pi_reference, "sample_actions", inputs
    if name == "smolvla":
        model, kw = _smolvla()
        return model, kw, smolvla_reference, "sample_actions", [kw["noise"], kw["state"]]
    policy, kw = _diffusion()
    inputs = [kw["noise"]] + list(kw["batch"].values())
    return policy, kw, diffusion_reference, "predict_action_chunk", inputs


CASES = ["pi0", "pi05", "smolvla", "diffusion"]


def _grads(out: Any, model: Any, inputs: list) -> list:
    params = [p for p in model.parameters() if p.requires_grad]
    return weighted_grads(out, inputs + params)


# SmolVLA refuses grad_steps (test_smolvla_grad_steps_is_refused).
@pytest.mark.parametrize(("name", "option"), [(name, option) for name in CASES for option in OPTIONS
                                              if not (name == "smolvla" and "grad_steps" in option)])
def test_lerobot_gradients_equal_the_hand_written_sampler(name: str, option: str) -> None:
    model, kw, reference, entry, inputs = _case(name)
    for tensor in inputs:
        tensor.requires_grad_()
    options = OPTIONS[option]
    upstream = upstream_method(type(model), entry)
    out = upstream.__get__(model)(**kw)
    # Upstream: @torch.no_grad(), no graph (SmolVLA's sample_actions is not decorated: its policy's
    # predict_action_chunk is, around it; called directly it differentiates, without the options).
    assert out.requires_grad is (name == "smolvla")
    with gradpatch.applied("lerobot") as report:
        assert vars(type(model))[entry] is not upstream, report
        got = _grads(getattr(model, entry)(**kw, cache=False, **options), model, inputs)
    first = N - options["grad_steps"] if "grad_steps" in options else -1  # -1: nothing detached
    want = _grads(reference(model, first, **kw), model, inputs)
    assert_grads_close(got, want, rtol=1e-4)
    if option == "plain":  # not vacuous: every input, and most parameters, get a gradient
        assert all(w is not None and bool(w.any()) for w in want[:len(inputs)])
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        reached = {n for n, w in zip(names, want[len(inputs):]) if w is not None and bool(w.any())}
        # pi0 / pi05: the action expert and the projections, and the VLM through the prefix's KV cache
        # (its token embeddings); the vision tower (no images), the language-model heads and what only the
        # VLM's own output uses do not.
        must = [n for n in names if ("paligemma." not in n or "gemma_expert" in n or "embed_tokens" in n)
                and "lm_head" not in n]
        assert set(must) <= reached, sorted(set(must) - reached)


@pytest.mark.parametrize("name", CASES)
def test_lerobot_cache_true_is_upstream_bitwise(name: str) -> None:
    model, kw, _, entry, _ = _case(name)
    upstream = upstream_method(type(model), entry)
    want = upstream.__get__(model)(**kw)
    with gradpatch.applied("lerobot") as report:
        assert vars(type(model))[entry] is not upstream, report
        got = getattr(model, entry)(**kw)
    assert torch.equal(got, want) and got.requires_grad is want.requires_grad


def test_conditional_sample_grad_steps_and_checkpoint_steps() -> None:
    """``DiffusionModel.conditional_sample`` (not decorated, reached through the policy's no_grad) takes
    the contract's options too: one U-Net call per step."""
    policy, kw = _diffusion()
    model = policy.diffusion
    cond = torch.cat(list(kw["batch"].values()), -1).flatten(1).requires_grad_()
    noise = kw["noise"].requires_grad_()
    params = [p for p in model.parameters() if p.requires_grad]
    with gradpatch.applied("lerobot"):
        got = weighted_grads(model.conditional_sample(2, global_cond=cond, noise=noise, cache=False, grad_steps=1),
                             [noise, cond] + params)
        checkpointed = weighted_grads(model.conditional_sample(2, global_cond=cond, noise=noise, cache=False,
                                                               checkpoint_steps=True), [noise, cond] + params)
    want = weighted_grads(ddim_reference(model, N - 1, cond, noise), [noise, cond] + params)
    plain = weighted_grads(ddim_reference(model, -1, cond, noise), [noise, cond] + params)
    assert want[0] is None  # the latent entering the last step is detached: no gradient to the noise
    assert_grads_close(got, want, rtol=1e-4)
    assert_grads_close(checkpointed, plain, rtol=1e-4)


def test_smolvla_grad_steps_is_refused() -> None:
    """SmolVLA's ``denoise_step`` appends to the prefix's KV cache and crops it back each step: steps run
    without grad would leave the cache without the prefix's graph (measured: the state's gradient off by
    14%), so ``grad_steps`` raises and says why."""
    model, kw = _smolvla()
    with gradpatch.applied("lerobot"):
        with pytest.raises(ValueError, match="grad_steps is not offered for SmolVLA"):
            model.sample_actions(**kw, cache=False, grad_steps=1)
