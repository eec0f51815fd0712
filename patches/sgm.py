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
"""
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
