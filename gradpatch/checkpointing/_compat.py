"""Deprecated: :mod:`gradpatch.checkpointing.compat` (this path goes in the next release)."""
from gradpatch.checkpointing.moved import alias

alias(__name__, "gradpatch.checkpointing.compat")
