"""openai/guided-diffusion (V1, GitHub) and the fork PyPI ``guided-diffusion-sdk`` ships (V3).

``guided_diffusion.nn`` defines the checkpoint, rebound by ``guided_diffusion.unet``, whose
``AttentionBlock`` always checkpoints. V3 saves tensors properly and filters parameters that do not
require grad, so frozen parameters work; but it does not replay the dropout RNG or CPU autocast, fails
on ``None`` inputs, raises for a trainable parameter the block does not use, and drops second-order
terms, so it is replaced too. Tested against guided-diffusion-sdk 1.0.0.
"""
from ._families import checkpoint_family

PATCHES = checkpoint_family("guided_diffusion", "guided_diffusion.nn", {
    # The `th` alias normalises away: openai/guided-diffusion@aca3097a hashes like AudioLDM's copy.
    "78fc3e61f1317c31": "V1 · openai/guided-diffusion@aca3097a",
    "f4a39d1f50f6fc11": "V3 · guided-diffusion-sdk 1.0.0",
}, requires="guided-diffusion-sdk<2")
