"""ComfyUI's copy of the SD2 code, ``comfy.ldm`` (GitHub comfyanonymous/ComfyUI only).

The versions read (commits 220afe33 and 01312a55) carry the V2 checkpoint unchanged. Later ComfyUI
versions may have replaced it; any other code found there is reported as unknown and left alone.
Tested through stable-diffusion-sdkit, which has the same fingerprint.
"""
from ._families import checkpoint_family

PATCHES = checkpoint_family("comfy", "comfy.ldm.modules.diffusionmodules.util", {
    "929fce4a31ca8b21": "V2 · comfyanonymous/ComfyUI@220afe33",
})
