"""Deprecated: :mod:`gradpatch.checkpointing.budget.key` (this path goes in the next release)."""
from gradpatch.checkpointing.moved import alias

alias(__name__, "gradpatch.checkpointing.budget.key")
