"""Run-time settings shared by the engine and the fixes.

Plain module attributes, read on every call by the fixes (one attribute lookup), written by
:func:`gradpatch.apply`, the ``GRADPATCH_*`` environment variables and :func:`set_checkpoint_policy`.
This module must never import torch.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

CHECKPOINT_POLICIES = ("respect", "always", "never")

#: How the fixed OpenAI/CompVis ``checkpoint(func, inputs, params, flag)`` treats ``flag``:
#: ``"respect"`` recomputes exactly when the caller asks, ``"always"`` recomputes even where the
#: caller passed ``flag=False``, ``"never"`` runs ``func`` directly (faster, more memory).
#: ``"budget:<size>"`` (``"budget:512MiB"``) keeps, among the blocks the caller asks to recompute,
#: those that save the most time while keeping at most ``<size>`` bytes more activations than
#: recomputing all of them (:mod:`gradpatch.fixes.checkpoint_budget`).
checkpoint_policy = "respect"

#: Raise :class:`gradpatch.GradpatchError` instead of warning (``apply(strict=True)``,
#: ``GRADPATCH_STRICT=1``). Strict mode lets a hook's failure propagate into the ``import``.
strict = False


def set_checkpoint_policy(policy: str) -> str:
    """Set the checkpoint policy (``"respect"``, ``"always"``, ``"never"`` or ``"budget:<size>"``);
    return the previous one. Takes effect on the next call. ``ValueError`` for anything else."""
    global checkpoint_policy
    if policy not in CHECKPOINT_POLICIES:
        from gradpatch.budget import check_policy

        policy = check_policy(policy, CHECKPOINT_POLICIES)
    previous, checkpoint_policy = checkpoint_policy, policy
    return previous


@contextlib.contextmanager
def checkpoint_policy_scope(policy: str) -> Iterator[None]:
    """Use ``policy`` inside the ``with`` block, then restore the previous one."""
    previous = set_checkpoint_policy(policy)
    try:
        yield
    finally:
        set_checkpoint_policy(previous)
