"""AudioLDM2 (PyPI ``audioldm2``; GitHub haoheliu/AudioLDM2).

``audioldm2.latent_diffusion.modules.diffusionmodules.util`` defines the V1 checkpoint; ``modules.attention``
and ``diffusionmodules.openaimodel`` rebind it and force it on, as in AudioLDM. Tested against PyPI
audioldm2 0.1.0 (which needs ``HF_HUB_OFFLINE=1`` without network: it loads a tokenizer at import).
"""
from ._families import checkpoint_family

PATCHES = checkpoint_family("audioldm2", "audioldm2.latent_diffusion.modules.diffusionmodules.util", {
    # The repository's two versions (cd8a405b, f2987b24, 2023-08-04) differ by an unused import.
    "78fc3e61f1317c31": "V1 · audioldm2 0.1.0 = haoheliu/AudioLDM2@f2987b24",
}, requires="audioldm2<1")
