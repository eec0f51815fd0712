"""Codebases that ship the package ``ldm``: CompVis latent-diffusion and stable-diffusion (SD1),
Make-An-Audio and Make-An-Audio-2 (V1); Stability-AI/stablediffusion (SD2), ControlNet and PyPI
``stable-diffusion-sdkit`` (V2: V1 plus CUDA-autocast replay).

The name ``ldm`` is shared, so only the fingerprint tells them apart. ``ldm.modules.attention`` and
``ldm.modules.diffusionmodules.openaimodel`` rebind ``checkpoint``; SD1's ``BasicTransformerBlock`` always
checkpoints, and ``AttentionBlock`` passes ``True`` everywhere. Tested against stable-diffusion-sdkit
2.1.5 (V2); V1 is tested through audioldm, which has the same fingerprint.
"""
from ._families import checkpoint_family

PATCHES = checkpoint_family("ldm", "ldm.modules.diffusionmodules.util", {
    # CompVis/latent-diffusion and CompVis/stable-diffusion share history (e66308c7, 171cf29f; LF);
    # Text-to-Audio/Make-An-Audio@42de53e9 and bytedance/Make-An-Audio-2@b1570562 are CRLF copies.
    "78fc3e61f1317c31": "V1 · CompVis/latent-diffusion@171cf29f = CompVis/stable-diffusion@171cf29f "
                        "= Make-An-Audio@42de53e9",
    # Stability-AI/stablediffusion ca86da3a, 8ec7903d, cddd65d5 (comment-only differences),
    # lllyasviel/ControlNet@e38d22aa, PyPI stable-diffusion-sdkit 2.1.5.
    "929fce4a31ca8b21": "V2 · Stability-AI/stablediffusion@cddd65d5 = ControlNet@e38d22aa "
                        "= stable-diffusion-sdkit 2.1.5",
}, requires="stable-diffusion-sdkit<3")
