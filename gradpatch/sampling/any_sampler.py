"""Deprecated: :mod:`gradpatch.sampling.generic.any_sampler` (this path goes in the next release)."""
from gradpatch.checkpointing.moved import alias

alias(__name__, "gradpatch.sampling.generic.any_sampler")
