"""Deprecated: :mod:`gradpatch.checkpointing.budget.compiled` (this path goes in the next release)."""
from gradpatch.checkpointing.moved import alias

alias(__name__, "gradpatch.checkpointing.budget.compiled")
