"""Declaring the latent-diffusion family's sampling fixes (no logic, no torch).

A target is ``(target, role, known)`` or ``(target, role, known, fixed)``: ``"module:Class.method"``,
one of the roles below (the fix factories of :mod:`gradpatch.sampling.ldm` and
:mod:`gradpatch.sampling.ldm_guards`, documented there; a fix factory of your own is named by its dotted
``"module:factory"`` path, e.g. one built with ``ldm_sampling.step_factory``),
the fingerprints of that method, each with its provenance, and optionally fingerprints of versions
already fixed upstream (left alone, reported as such). Each target becomes one :class:`~gradpatch.patching.registry.Patch` named
``"<upstream>.<Class>.<method>"`` and recognised by its own fingerprint, so an edited method is left
alone (with a warning) while its siblings are patched. ``LIFTED`` targets are recognised with
:class:`gradpatch.sampling.lift.Liftable` (the fingerprint of the source the loaded code object points at).
"""
from __future__ import annotations

from typing import Iterable, Mapping

from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.sampling.lift import Liftable
from gradpatch.patching.registry import Patch

_FIX = "gradpatch.sampling.ldm"
_GUARDS = "gradpatch.sampling.ldm_guards"

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


def ldm_sampling(upstream: str, targets: Iterable[tuple], *, requires: str | None = None) -> list[Patch]:
    """One :class:`Patch` per ``(target, role, known[, fixed])``; see the module docstring."""
    patches = []
    for target, role, known, *rest in targets:
        if role not in SUMMARIES and ":" not in role:
            raise ValueError(f"unknown role {role!r} for {target}; use one of {sorted(SUMMARIES)} "
                             "or a 'module:factory' path")
        fixed = dict(rest[0]) if rest else {}
        recognise = Liftable(dict(known), fixed) if role == LIFTED else Fingerprints(dict(known), fixed)
        qualname = target.partition(":")[2]
        fix = role if ":" in role else f"{_GUARDS if role in (REFUSE, EMA, DEVICE) else _FIX}:{role}"
        summary = SUMMARIES.get(role, f"latent-diffusion sampling fix {role.rpartition(':')[2]}")
        patches.append(Patch(f"{upstream}.{qualname}", target, fix, recognise, upstream, summary, requires))
    return patches
