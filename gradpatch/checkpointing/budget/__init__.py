"""The ``budget:<size>`` checkpoint policy: measure each checkpointed block, then keep the ones that
save the most time within the budget.

Modules: :mod:`~gradpatch.checkpointing.budget.policy` (each call, :func:`checkpoint_plan`,
:func:`reset`), :mod:`~gradpatch.checkpointing.budget.planner` (the blocks and the plans over them),
:mod:`~gradpatch.checkpointing.budget.key` (what a block is keyed by),
:mod:`~gradpatch.checkpointing.budget.measure` (measuring a call),
:mod:`~gradpatch.checkpointing.budget.knapsack` (choosing, torch-free),
:mod:`~gradpatch.checkpointing.budget.report` (:class:`Plan`, torch-free),
:mod:`~gradpatch.checkpointing.budget.traced` (the plan inside torch.compile regions) and
:mod:`~gradpatch.checkpointing.budget.compiled` (the warning where a compiled region cannot plan). This package's own import
is torch-free: the run-time names load :mod:`~gradpatch.checkpointing.budget.policy` on first use.

A block is a module's method passed to :func:`gradpatch.checkpointing.checkpoint.checkpoint` with
``flag=True`` (upstream's ``checkpoint(self._forward, inputs, self.parameters(), flag)``), at given
input shape buckets (each dimension rounded up to a power of two), dtypes, devices and autocast state,
and in a given state of its module: training mode, which of its parameters require grad, their dtype,
and its submodules' settings (flags, probabilities, modes: a dropout's ``p``, a submodule's
``training``). A change of any of these (gradual unfreezing, ``train()`` after ``eval()``, autocast
turned on, ``half()``, another dropout probability) makes a new block, measured again: what a block
keeps follows them. The module's state is one key per call (its parameters' flags and the settings'
names read from lists kept per module, walked again only after a parameter or submodule was
registered anywhere). Blocks the caller does not ask to checkpoint (``flag=False``) run directly, as
under ``respect``; so do all blocks under ``no_grad``.

**Measurement** (each block's first :data:`TIMING_CALLS` calls in a new bucket). The block is
checkpointed as under ``respect``. The checkpoint's forward runs ``func`` as the caller would,
building its graph before dropping it; during it, :class:`torch.autograd.graph.saved_tensors_hooks`
count, once per storage, the bytes of the tensors autograd saves, leaving out the storages of the
inputs and of the module's parameters and buffers (kept anyway) and less the CPU RNG state the
checkpoint keeps: what keeping the block keeps. A saved storage still alive after the call (its
output saved by its last op, as ``sigmoid`` does) is shared: the next checkpointed block takes it as
input and holds it anyway while recomputed, so it costs only where every block taking it is kept,
and once however many blocks keep it (:mod:`~gradpatch.checkpointing.budget.measure`). No extra run
and no extra memory: gradients and the step's peak are ``respect``'s. Timed (thread CPU time on one
CPU thread, wall time after a device synchronisation otherwise): the recompute in backward, and the
checkpoint's forward call beyond ``func`` itself; their sum, fastest of the measured calls each, is
what keeping the block saves.

**Plan.** A block is a knapsack item per input signature. Once every block called since the last
new one appeared has been measured (normally after the first :data:`TIMING_CALLS` training steps),
a 0/1 knapsack (:func:`gradpatch.checkpointing.budget.knapsack.choose`) picks the blocks to keep (run
without recompute): the most seconds saved with at most ``<size>`` bytes kept, shared storages
counted once and only where they cost (:func:`~gradpatch.checkpointing.budget.knapsack.choose_shared`).
Kept blocks run ``func(*inputs)`` directly, exactly as under ``never``, at input sizes up to the
largest measured in their bucket; a larger call (a longer sequence in the same bucket) is
checkpointed and measured again, and the plan solved anew. New buckets (batch size, resolution, a
length past a power of two) make new blocks, which are checkpointed and measured; blocks not called
since drop out of the next plan, solved once the new ones are measured. Meanwhile kept blocks at
unchanged shapes stay kept, so the kept total never exceeds the last plan's.

A block called several times per step (shared weights), or measured again before an earlier call's
backward, counts as many times as its calls' graphs were alive at once. Limits: only module methods
are planned (other functions are always checkpointed); blocks inside torch.compile regions are
planned too, measured eagerly on the first steps and the plan then compiled in
(:mod:`~gradpatch.checkpointing.budget.traced`), except where no graph break is allowed before they
are measured (``fullgraph=True``), or with dynamic shapes: those take torch's checkpoint and are
recomputed (one ``ConfigWarning`` says so); blocks whose first call goes to torch's own
checkpoint (the graph path at once: a sharding engine's modules inside, a DataParallel replica) cannot
be counted and are always recomputed, which the plan's summary says, with why; a few buckets that
alternate from step to step are planned together, as if all were alive in one step (within the
budget, keeping less than a plan per bucket would). The figures are estimates from the measured
calls: see :func:`checkpoint_plan`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradpatch.checkpointing.budget.report import Plan, PlanEntry

__all__ = ["checkpoint_plan", "Plan", "PlanEntry", "reset", "run", "TIMING_CALLS"]

if TYPE_CHECKING:
    from gradpatch.checkpointing.budget.policy import TIMING_CALLS, checkpoint_plan, reset, run

_RUN_TIME = frozenset({"checkpoint_plan", "reset", "run", "TIMING_CALLS"})


def __getattr__(name: str) -> Any:
    if name not in _RUN_TIME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from gradpatch.checkpointing.budget import policy

    value = getattr(policy, name)
    globals()[name] = value
    return value
