"""Deprecated: :mod:`gradpatch.checkpointing.graph_path` (this path goes in the next release)."""
from gradpatch.checkpointing.moved import alias

alias(__name__, "gradpatch.checkpointing.graph_path")
