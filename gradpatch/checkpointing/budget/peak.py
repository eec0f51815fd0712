"""The ``peak:<size>`` checkpoint policy: the training step's peak memory, from the start of the forward
that calls its checkpointed blocks to the end of its backward, stays at or under ``<size>``, with as
little recompute as that allows (the start: the call of the outermost module whose forward runs the
step's first block, :mod:`~gradpatch.checkpointing.budget.forward_start`). The plan leaves :data:`HEADROOM` (3%) of
the size free for what its recording does not see.

It shares the ``budget:<size>`` policy's blocks and their measurement
(:mod:`gradpatch.checkpointing.budget`): during the first :data:`TIMING_CALLS` steps every block is
recomputed and measured (the bytes keeping it keeps, the seconds recomputing it costs). The next step
is recorded, still with every block recomputed (:mod:`gradpatch.checkpointing.budget.timeline`): the
most bytes alive between each two block events, and per block what keeping only its expensive ops'
outputs keeps and saves. From these the plan (:mod:`gradpatch.checkpointing.budget.peak_choice`)
chooses per block:

* **keep**: run directly, as under ``never`` (up to the input sizes measured);
* **recompute**: the fixed checkpoint, as under ``respect``.

Keeping only a block's matmul, convolution and attention outputs (torch's selective checkpoint) is not
among the choices: on CPU its policy, a Python call per operator, takes back most of what it saves,
and the bytes it keeps save more as whole blocks (``benchmarks/peak_plan.py``, medium UNet: every block
selective 87.0 MiB at 1.35x ``never``; ``peak:85MiB`` 81.5 MiB at 1.11x).

A kept block's activations are alive from its forward to its backward, where a recomputed block holds
the same activations again: keeping the last blocks of the forward costs little or no peak, keeping
the first ones costs it through the whole backward. The plan takes this into account, which a bound
on the kept bytes (``budget:``) cannot. :func:`gradpatch.checkpoint_plan` reports each block's choice,
the predicted peak, the smallest peak reachable (every block recomputed) and the peak with every block
kept. When even recomputing every block peaks above ``<size>``, the next checkpointed call raises
:class:`PeakUnreachable` saying the smallest peak reachable. New blocks (new shapes) are measured and
the step recorded again. Offloading to the CPU is not among the choices: use
``torch.autograd.graph.save_on_cpu`` around the step, which the fixed checkpoint composes with.

Under torch.compile (``model.compile()`` too: :mod:`~gradpatch.checkpointing.budget.forward_start`) the
plan's steps run eagerly, then it is compiled in, the compiled step unmeasured (one warning). A compiled
function that calls the model (or its layers) has no step recorded: every block recomputed, one warning.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

from gradpatch import settings
from gradpatch.checkpointing import paths
from gradpatch.checkpointing.budget import compiled, forward_start, knapsack, measure, resizes, timeline
from gradpatch.checkpointing.budget.key import signature, size_of, state
from gradpatch.checkpointing.budget.peak_choice import KEEP, RECOMPUTE, Occurrence, Option, PeakUnreachable, \
    choose, predict, unreachable_message
from gradpatch.checkpointing.budget.planner import PLANNER, TIMING_CALLS, Block, items_of

__all__ = ["KEEP", "PeakUnreachable", "TIMING_CALLS", "UNRECORDED", "run", "solved", "PEAK"]


class PeakPlan:
    """The step recorded and the choices made over it (one per process: :data:`PEAK`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        recording = getattr(self, "recording", None)
        if recording is not None:  # (budget.reset() during a recorded step)
            timeline.stop(recording)
        self.epoch = -1  # the planner's epoch the recording belongs to
        self.recording: timeline.Recording | None = None  # in progress
        self.recorded: timeline.Recording | None = None  # ended
        self.solved_for: int | None = None
        self.choices: weakref.WeakKeyDictionary[Block, str] = weakref.WeakKeyDictionary()
        self.predicted = self.floor = self.ceiling = None  # type: int | None
        self.unreachable: int | None = None
        self.realised: int | None = None  # the plan's peak as recorded in its first step
        self.margin, self.tries = 0, 0  # what recorded plans peaked above their predictions, summed; plans tried
        self.options: weakref.WeakKeyDictionary[Block, list[Option]] = weakref.WeakKeyDictionary()
        self.plans: dict[int, tuple] = {}  # size -> the plan's state (_STATE), for sizes that alternate
        self.dropped = False  # a recording with an abandoned forward was dropped (see settle)
        self.unrecorded = False  # a step began inside compiled code: none can be recorded (_cannot_record)

    def solve(self, size: int, again: bool = False) -> None:
        """Choose the kept blocks for ``size`` (the plan made for it before, unless ``again``)."""
        if not again and size in self.plans:
            for name, value in zip(_STATE, self.plans[size]):
                setattr(self, name, value)
            self.solved_for = size
            return
        if not again:
            self.margin, self.tries = 0, 0
        blocks = [b for _, b in PLANNER.live()]
        index = {id(b): i for i, b in enumerate(blocks)}
        items, shared = items_of(blocks)
        alone = knapsack.alone_bytes(items, shared)
        recorded = self.recorded
        assert recorded is not None
        occurrences = [Occurrence(index[id(block)], start, end)
                       for block, start, end in recorded.occurrences() if id(block) in index]
        options: list[list[Option]] = []
        for i, b in enumerate(blocks):
            opts = [Option(RECOMPUTE, 0, 0.0)]
            if not b.opaque and b.measured:
                opts.append(Option(KEEP, alone[i] // max(b.per_step, 1), b.seconds))
            options.append(opts)
        levels = recorded.levels
        self.floor = max(levels, default=0)
        self.ceiling = predict(levels, occurrences, [o[-1].bytes for o in options])
        self.choices = weakref.WeakKeyDictionary()
        self.realised = None
        if self.floor > size:
            self.unreachable, self.predicted, self.solved_for = size, None, size
            self.keep()
            return
        self.unreachable = None
        try:
            chosen, self.predicted = choose(levels, occurrences, options, size - headroom(size) - self.margin)
        except PeakUnreachable:  # recorded plans ran over: recompute every block
            chosen, self.predicted = [0] * len(blocks), self.floor
        self.options = weakref.WeakKeyDictionary(zip(blocks, options))
        for b, opts, j in zip(blocks, options, chosen):
            self.choices[b] = opts[j].kind
        if not any(chosen):  # every block recomputed: the step recorded is this plan's, nothing to check
            self.realised = self.floor
        self.solved_for = size
        self.keep()
        measure.prune()

    def keep(self) -> None:
        """Remember the current plan's state for its size."""
        if self.solved_for is not None:
            self.plans[self.solved_for] = tuple(getattr(self, name) for name in _STATE)

    def check(self, recording: timeline.Recording) -> None:
        """The plan's first step, recorded: its peak. Over the size (what the model of the step does
        not see: two blocks' memory interacting), the plan is made again with as much less room as the
        step peaked above its prediction (a plan at the size's edge would run over again by the missed
        amount) and recorded again, up to :data:`TRIES` times; then every block is recomputed."""
        realised = max(recording.levels, default=0)
        size = self.solved_for or 0
        limit = size - headroom(size)
        self.tries += 1
        if realised <= limit:
            self.realised = realised
            self.keep()
            return
        self.margin += realised - min(self.predicted or limit, limit)
        if self.tries >= TRIES:
            self.margin = size  # nothing fits: the next solve recomputes every block
        self.solve(size, again=True)


#: What a plan is, per size: restored when the size comes back (two peak: policies alternating).
_STATE = ("choices", "options", "predicted", "realised", "margin", "tries", "unreachable")

#: Plans recorded over their size before every block is recomputed.
TRIES = 3

#: The share of the size a plan leaves free: what the recording does not see (buffers an operator
#: allocates and frees inside itself, a tensor's storage rounded up by the allocator). Measured above
#: the recording: up to 1.3% at the allocator and 2.4% by torch's ``MemTracker`` on the medium UNet
#: (``benchmarks/peak_plan.py``).
HEADROOM = 0.03


def headroom(size: int) -> int:
    return int(size * HEADROOM)

#: The process's plan.
PEAK = PeakPlan()


def run(func: Callable[..., Any], args: tuple, kwargs: dict | None, policy: str,
        inside_compiled: bool = False) -> Any:
    """``checkpoint``'s work under ``policy = "peak:<size>"``, called with ``flag=True`` in grad mode
    (``inside_compiled``: by a compiled region's graph break, :mod:`~gradpatch.checkpointing.budget.traced`)."""
    owner = getattr(func, "__self__", None)
    function = getattr(func, "__func__", None)
    if not isinstance(owner, torch.nn.Module) or function is None:
        return paths.run(func, args, kwargs)
    block = PLANNER.block(owner, (function, state(owner), signature(args, kwargs)))
    if measure.measuring():
        measure.consumers(block, args if kwargs is None else (*args, *kwargs.values()))
    with PEAK.lock:
        # Until the plan's step is recorded: storages resized in place (FSDP's parameters) are watched, and
        # a recording begins at the step's forward's start (taken by its first block, or dropped).
        planning = (PEAK.recorded is None or PEAK.realised is None or PEAK.epoch != PLANNER.epoch) \
            and not PEAK.unrecorded
        resizes.planning(planning)
        forward_start.planning(planning, _measured)
        # (the blocks sorted: once a call while planning, never once planned; every use below is planning's)
        first = planning and block is _first()
        early = forward_start.take(first) if planning else None
        recording = PEAK.recording
        if recording is not None:
            if not recording.ended and not (recording.backward and first):
                # (a recording is under way: this step's own forward began in it)
                forward_start.release(early)
                return timeline.run(recording, block, _runner(recording.choices.get(block, RECOMPUTE), block),
                                    func, args, kwargs)
            settle()  # ended, or a new step began before the backward ended
        if not block.measured:
            forward_start.release(early)
            return measure.measure(block, func, args, kwargs)
        if PEAK.epoch != PLANNER.epoch:  # new blocks since the recording: measure and record again
            PEAK.reset()
            PEAK.epoch = PLANNER.epoch
        recordable = first and _recordable(policy, early, inside_compiled)
        if PEAK.recorded is None:
            if recordable and _measured():
                PEAK.recording = timeline.start({}, _values(args, kwargs), [b for _, b in PLANNER.live()], early)
                return timeline.run(PEAK.recording, block, paths.run, func, args, kwargs)
            forward_start.release(early)
            return paths.run(func, args, kwargs)
        size = settings.peak_bytes(policy)
        if PEAK.solved_for != size:
            PEAK.solve(size)
        if PEAK.unreachable is not None:
            forward_start.release(early)
            raise PeakUnreachable(unreachable_message(policy, size, PEAK.floor or 0))
        choice = PEAK.choices.get(block, RECOMPUTE)
        if PEAK.realised is None and recordable:
            # The plan's first step is recorded too: its peak measured, not only predicted.
            PEAK.recording = timeline.start(dict(PEAK.choices), _values(args, kwargs),
                                            [b for _, b in PLANNER.live()], early)
            return timeline.run(PEAK.recording, block, _runner(choice, block), func, args, kwargs)
        forward_start.release(early)
    return _runner(choice, block)(func, args, kwargs)


def solved(policy: str) -> weakref.WeakKeyDictionary[Block, str] | None:
    """The blocks' choices once the plan for ``policy``'s size is made and its step recorded (what
    compiled code is traced with: :mod:`gradpatch.checkpointing.budget.traced`); :data:`UNRECORDED`
    where compiled code cannot record a step; None until then."""
    if PEAK.recorded is None or PEAK.realised is None or PEAK.epoch != PLANNER.epoch \
            or PEAK.solved_for != settings.peak_bytes(policy) or PEAK.unreachable is not None:
        return UNRECORDED if PEAK.unrecorded else None
    return PEAK.choices


#: The plan where no step can be recorded: every block recomputed.
UNRECORDED: weakref.WeakKeyDictionary[Block, str] = weakref.WeakKeyDictionary()


def settle() -> None:
    """Take the recording in progress off the stack and, if its step ended, use it."""
    recording = PEAK.recording
    if recording is None:
        return
    complete = recording.ended
    timeline.stop(recording, pop=not forward_start.inside_compiled_call())  # (else its root's next call)
    PEAK.recording = None
    if complete and PEAK.epoch == PLANNER.epoch:
        # A forward dropped without backward before the step's own (a validation forward with grad on, one
        # that raised) may have been alive through the step: the next step is recorded instead, once. One
        # every step is part of the step: used, its calls left out (timeline.Recording.abandoned).
        if recording.abandoned() and not PEAK.dropped:
            PEAK.dropped = True
            return
        PEAK.dropped = False
        if recording.choices:
            PEAK.check(recording)
        else:
            PEAK.recorded, PEAK.solved_for = recording, None
            PEAK.plans.clear()


def _runner(choice: str, block: Block) -> Callable[[Callable[..., Any], tuple, dict | None], Any]:
    """How a block runs under its choice: ``runner(func, args, kwargs)``."""
    if choice == KEEP:
        def keep(func: Callable[..., Any], args: tuple, kwargs: dict | None) -> Any:
            if size_of(args, kwargs) <= block.largest:
                return func(*args, **(kwargs or {}))
            return paths.run(func, args, kwargs)  # larger than measured: it may keep more
        return keep
    return paths.run


def _measured() -> bool:
    """Whether every block is measured: the next step is recorded, from its forward's start."""
    return all(b.measured for _, b in PLANNER.live())


def _recordable(policy: str, early: timeline.Recording | None, inside_compiled: bool) -> bool:
    """Whether the step can be recorded from this, its first block's call. Not from inside compiled
    code (a recording's dispatch mode begun there would be left with the Python key off): recorded from
    the next step's start, where the root runs outside, else never (every block recomputed)."""
    if forward_start.unrecordable(inside_compiled):
        PEAK.unrecorded = True  # compiled anew with every block recomputed (traced.solved)
        forward_start.planning(False)
        compiled.unrecorded(policy)
        return False
    return early is not None or not inside_compiled


def _first() -> Block | None:
    live = PLANNER.live()
    return live[0][1] if live else None


def _values(args: tuple, kwargs: dict | None) -> tuple:
    return args if not kwargs else (*args, *kwargs.values())
