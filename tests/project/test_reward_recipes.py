"""The reward recipes of ``examples/reward_*.py`` run on tiny random models, each with a rising reward,
and the AlignProp recipe's gradients equal trl 0.23.1's AlignProp for the same truncation.

trl 0.23.1 (the last release with ``AlignPropTrainer``; removed in 0.24) is installed (pinned in
requirements/upstream.txt): its ``trl.models.modeling_sd_base.pipeline_step_with_grad`` is the
AlignProp pipeline step, and ``AlignPropTrainer.calculate_loss`` its loss. Recipes run in this process
(their ``main(argv)``), a few training steps each, so the suite stays fast.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from support import ROOT

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def recipe(name: str):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))


def assert_rose(rewards: list[float]) -> None:
    quarter = max(1, len(rewards) // 4)
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last > first, rewards


def test_alignprop_recipe_reward_rises(capsys):
    rewards = recipe("reward_alignprop").main(["--steps", "8"])
    out = capsys.readouterr().out
    assert len(rewards) == 8 and "reward: first quarter" in out
    assert_rose(rewards)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "trl-gradient-checkpoint"])
def test_alignprop_gradients_equal_trl_0_23_1(checkpointed):
    """For every K of a 3-step DDIM run with guidance: the recipe's step (``pipe(..., cache=False,
    grad_steps=K)``, its reward and loss) gives the LoRA the gradients of trl 0.23.1's
    ``pipeline_step_with_grad`` with fixed truncation at ``truncated_backprop_timestep = N - K`` (trl
    detaches the noise prediction of steps ``i < N - K``), float64."""
    import trl
    from trl.models.modeling_sd_base import pipeline_step_with_grad
    from trl.trainer.alignprop_trainer import AlignPropTrainer

    import gradpatch
    from gradpatch.testing import add_lora, stable_diffusion_pipeline

    assert trl.__version__ == "0.23.1"
    alignprop = recipe("reward_alignprop")
    pipe, (embeds, negative) = stable_diffusion_pipeline()
    lora = add_lora(pipe.unet)
    pipe.to(torch.float64)
    reward = alignprop.reward_model().double()
    steps = 3
    kwargs = dict(alignprop.SAMPLING, num_inference_steps=steps)

    def gradients(loss):
        return torch.autograd.grad(loss, lora, allow_unused=True)

    by_k = []
    for k in (1, 2, 3):
        images = pipeline_step_with_grad(pipe, **kwargs, prompt_embeds=embeds.double(),
                                         negative_prompt_embeds=negative.double(), generator=torch.Generator().manual_seed(0),
                                         truncated_backprop=True, truncated_backprop_rand=False,
                                         truncated_backprop_timestep=steps - k, gradient_checkpoint=checkpointed).images
        want = gradients(AlignPropTrainer.calculate_loss(None, reward(images)))
        with gradpatch.applied("diffusers"):
            ours = alignprop.sample(pipe, (embeds.double(), negative.double()),
                                    torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
                                    * pipe.scheduler.init_noise_sigma, k, **kwargs)
        got = gradients(alignprop.loss_of(reward(ours)))
        torch.testing.assert_close(ours, images, rtol=1e-12, atol=1e-12)
        assert all(w is not None for w in want)
        floor = 1e-9 * max(w.abs().max().item() for w in want)
        assert floor > 0
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=floor)
        by_k.append(torch.cat([w.flatten() for w in want]))
    assert not any(torch.allclose(a, b) for i, a in enumerate(by_k) for b in by_k[i + 1:])  # K matters


def test_audioldm_clap_recipe_reward_rises(capsys):
    rewards = recipe("reward_audioldm_clap").main(["--steps", "6"])
    assert "reward: first quarter" in capsys.readouterr().out
    assert_rose(rewards)


def test_f5_tts_vocos_recipe_reward_rises(capsys):
    rewards = recipe("reward_f5_tts").main(["--steps", "6"])
    assert "reward: first quarter" in capsys.readouterr().out
    assert_rose(rewards)


def test_f5_recipe_vocoder_and_no_grad_scorer_gradients():
    """``gradpatch.differentiable`` around Vocos' ``@torch.inference_mode()`` ``decode`` and the recipe's
    ``@torch.no_grad()`` scorer: the gradient reaching the mel equals that of the same functions with
    their decorators removed by hand (float64), and the plain calls still give no graph."""
    import inspect

    import gradpatch

    f5 = recipe("reward_f5_tts")
    vocoder, scorer = f5.tiny_vocos().double(), f5.WaveformScorer().double()
    mel = torch.randn(2, 16, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert scorer.score(vocoder.decode(mel.detach())).grad_fn is None
    undecorated = inspect.unwrap(type(scorer).score)(scorer, inspect.unwrap(type(vocoder).decode)(vocoder, mel))
    (want,) = torch.autograd.grad(undecorated.sum(), mel)
    got = gradpatch.differentiable(scorer.score)(gradpatch.differentiable(vocoder.decode)(mel))
    (got,) = torch.autograd.grad(got.sum(), mel)
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12 * want.abs().max().item())
