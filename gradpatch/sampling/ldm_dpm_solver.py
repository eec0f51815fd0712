"""Deprecated: :mod:`gradpatch.sampling.families.ldm_dpm_solver` (this path goes in the next release)."""
from gradpatch.checkpointing.moved import alias

alias(__name__, "gradpatch.sampling.families.ldm_dpm_solver")
