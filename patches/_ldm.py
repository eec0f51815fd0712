"""Declaring the latent-diffusion family's sampling fixes (no logic, no torch).

A target is ``(target, role, known)``: ``"module:Class.method"``, one of the roles below (the fix
factories of :mod:`gradpatch.fixes.ldm_sampling`, documented there) and the fingerprints of that
method, each with its provenance. Each target becomes one :class:`~gradpatch.registry.Patch` named
``"<upstream>.<Class>.<method>"`` and recognised by its own fingerprint, so an edited method is left
alone (with a warning) while its siblings are patched. ``LIFTED`` targets are recognised with
:class:`gradpatch.lift.Liftable` (the fingerprint of the source the loaded code object points at).
"""
from __future__ import annotations

from typing import Iterable, Mapping

from gradpatch.fingerprint import Fingerprints
from gradpatch.lift import Liftable
from gradpatch.registry import Patch

_FIX = "gradpatch.fixes.ldm_sampling"

ENTRY = "entry"
LIFTED = "lifted_entry"
INNER = "inner"
STEP_BY_INDEX = "step_by_index"
STEP_BY_TIMESTEP = "step_by_timestep"
REFUSE = "refuse_cache_false"
EMA = "guard_ema_scope"
DEVICE = "buffers_follow_model"

SUMMARIES = {
    ENTRY: "cache=False: gradients through the undecorated call, caller's mode kept; grad_steps, checkpoint_steps",
    LIFTED: "cache=False: gradients through a copy with its in-body no_grad lifted; grad_steps, checkpoint_steps",
    INNER: "runs undecorated inside a cache=False call",
    STEP_BY_INDEX: "runs undecorated inside a cache=False call; one sampling step (index = steps left)",
    STEP_BY_TIMESTEP: "runs undecorated inside a cache=False call; one sampling step (t = steps left)",
    REFUSE: "cache=False refused (ends in numpy, inside ema_scope); points at sample_log + decode_first_stage",
    EMA: "ema_scope refused during cache=False sampling; graphs across a weight swap raise in backward",
    DEVICE: "sampler buffers on the model's device instead of forced CUDA (works on CPU)",
}


def ldm_sampling(upstream: str, targets: Iterable[tuple[str, str, Mapping[str, str]]], *,
                 requires: str | None = None) -> list[Patch]:
    """One :class:`Patch` per ``(target, role, known)``; see the module docstring."""
    patches = []
    for target, role, known in targets:
        if role not in SUMMARIES:
            raise ValueError(f"unknown role {role!r} for {target}; use one of {sorted(SUMMARIES)}")
        recognise = Liftable(dict(known)) if role == LIFTED else Fingerprints(dict(known))
        qualname = target.partition(":")[2]
        patches.append(Patch(f"{upstream}.{qualname}", target, f"{_FIX}:{role}", recognise, upstream,
                             SUMMARIES[role], requires))
    return patches
