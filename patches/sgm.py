"""Stability-AI/generative-models (``sgm``, SDXL and SVD era) and forks such as SUPIR (GitHub only).

Two defects. (1) ``sgm.modules.diffusionmodules.util`` carries the V2 checkpoint plus
``mixed_checkpoint`` (dict inputs; V2+M); until the SVD commit (059d8e9c, 2023-11-21) attention and
openaimodel use it. (2) From that commit on, ``sgm.modules.attention``,
``sgm.modules.diffusionmodules.openaimodel`` (and ``encoders.modules``, since the first commit) bind
``torch.utils.checkpoint.checkpoint`` and call it without ``use_reentrant``: the reentrant default gives
no parameter gradient when no input requires grad (frozen encoder, LoRA) and trips DDP. Those modules'
``checkpoint`` becomes non-reentrant; torch's own default elsewhere is unchanged. ``video_attention``
and ``spacetime_attention`` take ``checkpoint`` from ``attention`` by ``import *`` and see the fix.
No installable package carries sgm: the fixes are tested on the installable codebases sharing them.
(3) ``DiffusionEngine.sample``/``decode_first_stage``/``encode_first_stage`` are ``@torch.no_grad()``:
``cache=False`` (below). Not covered: ``GeneralConditioner`` disables grad for frozen embedders through
a manager held in a variable (set ``embedder.is_trainable = True`` for gradients to its inputs), and
``inference.helpers.do_sample`` samples inside ``ema_scope``.
"""
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch
from gradpatch.sampling.generic.any_sampler import sampler

from ._families import checkpoint_family, torch_checkpoint_default

PATCHES = checkpoint_family("sgm", "sgm.modules.diffusionmodules.util", {
    # 081e0d46 (2023-06-22), 059d8e9c (SVD), abe9ed3d (SV4D) and Fanghua-Yu/SUPIR@12b8fa4c share the
    # checkpoint, CheckpointFunction, mixed_checkpoint and MixedCheckpointFunction definitions.
    "280d31d70068a93a": "V2+M · Stability-AI/generative-models@abe9ed3d = SUPIR@12b8fa4c",
}, mixed=True) + [
    torch_checkpoint_default(f"sgm.{short}.checkpoint", "sgm", module,
                             "torch reentrant default · generative-models@059d8e9c..c3147b86")
    for short, module in [("attention", "sgm.modules.attention"),
                          ("openaimodel", "sgm.modules.diffusionmodules.openaimodel"),
                          ("encoders", "sgm.modules.encoders.modules")]
]

# DiffusionEngine's entry points, @torch.no_grad() in every version (081e0d46 2023-06-22 to 0ad7de9
# 2025-05): made differentiable by gradpatch.differentiable. `sample` calls `self.sampler(denoiser, ...)`
# (EulerEDM and the other samplers: one `self.model` call per step, CFG batched by the guider; Heun: two,
# where grad_steps then raises), `self.sampler.num_steps` steps. Tested on a replica in
# tests/upstream/test_sgm_engine_replica.py (no installable package carries sgm).
_ENGINE = "sgm.models.diffusion:DiffusionEngine"
_ENGINE_KNOWN = {
    "sample": {"4a53623cb260db92": "generative-models@081e0d46 (2023-06-22) to 0ad7de9 (2025-05)"},
    "decode_first_stage": {"3f86ec6d7ade4aec": "generative-models@081e0d46 to 4a3f0f5 (2023-07)",
                           "ef6c5665dfd4801e": "generative-models@059d8e9c (SVD, 2023-11-21) to 0ad7de9"},
    "encode_first_stage": {"e808100af550f167": "generative-models@081e0d46 to 4a3f0f5 (2023-07)",
                           "a135e993c7564d40": "generative-models@059d8e9c (SVD, 2023-11-21) to 0ad7de9"},
}
PATCHES += [
    Patch(f"sgm.DiffusionEngine.{method}", f"{_ENGINE}.{method}",
          sampler(step="model", steps="self.sampler.num_steps") if method == "sample" else sampler(),
          Fingerprints(known), "sgm", f"DiffusionEngine.{method}(cache=False): gradients flow"
          + ("; grad_steps, checkpoint_steps" if method == "sample" else ""))
    for method, known in _ENGINE_KNOWN.items()
]
