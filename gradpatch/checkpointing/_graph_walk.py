"""Deprecated: :mod:`gradpatch.checkpointing.graph_walk` (this path goes in the next release)."""
from gradpatch.checkpointing.moved import alias

alias(__name__, "gradpatch.checkpointing.graph_walk")
