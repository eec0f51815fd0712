"""Deprecated: :mod:`gradpatch.sampling.families.diffusers` (this path goes in the next release)."""
from gradpatch.checkpointing.moved import alias

alias(__name__, "gradpatch.sampling.families.diffusers")
