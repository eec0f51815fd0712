"""The ``budget:<size>`` and ``peak:<size>`` policies and torch.compile: one warning where a compiled region
cannot plan a block.

Compiled regions are planned (:mod:`gradpatch.checkpointing.budget.traced`): each checkpointed block
there is traced kept or recomputed as the plan says, measured eagerly while the plan is incomplete.
Where that cannot be done (a block not measured yet under ``fullgraph=True`` or ``torch.export``, or
inside another higher-order op; dynamic shapes; see :mod:`~gradpatch.checkpointing.budget.traced`),
the block takes torch's checkpoint and is recomputed, as under ``respect``: memory at most
``respect``'s there, none of the time the budget would buy saved. So that this is not silent, the first
compilation that ends having met such a block warns once per process
(:class:`gradpatch.errors.ConfigWarning`), saying why. A warning cannot be issued from code being
traced without breaking the graph, hence torch's compilation callbacks: registered when the planner is
first used, they cost nothing per call. Torch-free at import.
"""
from __future__ import annotations

import warnings

_state: dict = {"registered": False, "warned": False, "why": None, "unrecorded": False,
               "peak": None, "peak_warned": False}

MESSAGE = ("gradpatch: checkpoint policy {policy!r} is not applied inside torch.compile regions where "
           "it cannot measure or bound a block ({why}): such checkpointed blocks take torch's checkpoint "
           "and are all recomputed (memory as under 'respect', at most; no time saved). Other blocks are "
           "planned. To have them planned, run the first steps eagerly or compile without fullgraph=True "
           "(they are measured on the first steps, then the plan is compiled in), with static shapes; "
           "to keep them, use the 'never' policy for them (checkpoint_policy_scope('never')).")


def note(why: str) -> None:
    """A block in the region being compiled is not planned, for ``why``: warned at its end."""
    if _state["why"] is None:
        _state["why"] = why


#: Under ``peak:``, once a plan is compiled in (measured on eager steps, the compiled step is not).
PEAK_MESSAGE = ("gradpatch: checkpoint policy {policy!r} is compiled into this model as planned on eager "
                "steps: the compiled step's peak is not measured, and the compiler may allocate otherwise "
                "(under inductor on CPU, the tiny AudioLDM UNet with every block recomputed peaked at 1.6x "
                "its eager peak). Check the compiled step's peak (torch.cuda.max_memory_allocated() on a "
                "GPU); for a measured bound, train the model without torch.compile.")


def compiled_peak(policy: str) -> None:
    """A ``peak:`` plan is traced into the region being compiled: warned at its end, once."""
    _state["peak"] = policy


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

    why, _state["why"] = _state["why"], None
    planned, _state["peak"] = _state["peak"], None
    if planned is not None and not _state["peak_warned"]:
        _state["peak_warned"] = True
        warnings.warn(PEAK_MESSAGE.format(policy=planned), ConfigWarning, stacklevel=2)
    policy = settings.checkpoint_policy
    if _state["warned"] or why is None or not (settings.is_budget(policy) or settings.is_peak(policy)):
        return
    _state["warned"] = True
    warnings.warn(MESSAGE.format(policy=policy, why=why), ConfigWarning, stacklevel=2)


def unrecorded(policy: str) -> None:
    """A ``peak:<size>`` step begins inside compiled code, where no step can be recorded: warned once."""
    from gradpatch.errors import ConfigWarning

    if _state["unrecorded"]:
        return
    _state["unrecorded"] = True
    warnings.warn(f"gradpatch: checkpoint policy {policy!r} cannot record a step that begins inside "
                  "compiled code (a compiled function that calls the model or its layers, or checkpointed "
                  "blocks called outside any module): they are recomputed, as under 'respect'. "
                  "Compile the model with torch.compile(model) instead, or run its first steps eagerly "
                  "(they make the plan, which is then compiled in)", ConfigWarning, stacklevel=5)
