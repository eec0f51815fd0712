"""The ``budget:<size>`` policy and torch.compile: one warning that compiled regions are not planned.

Inside a region torch.compile traces, the fixed checkpoint takes the graph path (torch's own
non-reentrant checkpoint, which the compiler understands) and the planner cannot measure or keep a
block: each checkpointed block there is recomputed, as under ``respect``. Memory there is then at most
``respect``'s, and none of the time the budget would buy is saved; blocks run eagerly are planned as
usual. So that this is not silent, the first compilation that ends while the policy is in force warns
once per process (:class:`gradpatch.errors.ConfigWarning`). A warning cannot be issued from code being
traced without breaking the graph, hence torch's compilation callbacks: registered when the planner is
first used, they cost nothing per call.
"""
from __future__ import annotations

import warnings

_state = {"registered": False, "warned": False}

MESSAGE = ("gradpatch: checkpoint policy {policy!r} is not applied inside torch.compile regions: "
           "checkpointed blocks there take torch's checkpoint and are all recomputed (memory as under "
           "'respect', at most; no block is kept, so no recompute time is saved). Blocks run outside "
           "compiled regions are planned as usual. To keep blocks in compiled code, use the 'never' "
           "policy for them (checkpoint_policy_scope('never')) or leave them uncompiled.")


def watch() -> None:
    """Register the end-of-compilation callback (once; silently nothing where torch has none)."""
    if _state["registered"]:
        return
    _state["registered"] = True
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # torch without compilation callbacks
        return
    try:
        callback_handler.register_end_callback(_compiled)
    except Exception:  # another signature: no warning rather than a failing import
        pass


def _compiled(*_args: object) -> None:
    from gradpatch import settings
    from gradpatch.errors import ConfigWarning

    policy = settings.checkpoint_policy
    if _state["warned"] or not settings.is_budget(policy):
        return
    _state["warned"] = True
    warnings.warn(MESSAGE.format(policy=policy), ConfigWarning, stacklevel=2)
