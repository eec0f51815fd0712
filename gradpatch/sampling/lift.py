"""Deprecated: :mod:`gradpatch.sampling.lifting.lift` (this path goes in the next release)."""
from gradpatch.checkpointing.moved import alias

alias(__name__, "gradpatch.sampling.lifting.lift")
