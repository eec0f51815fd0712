"""openai/improved-diffusion (GitHub only): ``improved_diffusion.nn`` holds the V1 checkpoint (same
bytes as guided-diffusion's), rebound by ``improved_diffusion.unet``. Tested through audioldm, which has
the same fingerprint."""
from ._families import checkpoint_family

PATCHES = checkpoint_family("improved_diffusion", "improved_diffusion.nn", {
    "78fc3e61f1317c31": "V1 · openai/improved-diffusion@6051920c",
})
