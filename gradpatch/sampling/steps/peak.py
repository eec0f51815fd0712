"""``checkpoint_steps="peak:<size>"``: the step's peak memory, from the sampler call's start to the end of
the backward of a loss on its output, stays at or under ``<size>`` (bytes above what was allocated when
the call began), with as many denoiser evaluations kept as that allows.

How many evaluations a call makes is not known while it runs, so the plan is learnt from earlier calls
with the same key: the sampler and the call's arguments (tensors by shape, dtype, device and whether they
require grad; integers, strings and flags by value; floats and seeds not, which may change at every call;
modules by identity; other objects by type). Each evaluation's signature (its step and the number of
steps, as :func:`~gradpatch.sampling.run.run_step` has them, and its tensors' shapes) is compared with the
record's.

* **Recorded.** The first call of a key recomputes every evaluation (as ``checkpoint_steps=True``) and
  is recorded by the block policy's recorder (:mod:`gradpatch.checkpointing.budget.timeline`: each
  storage an operator creates, and its free) from the call's start until the backward that first
  reaches its evaluations ends: the most bytes alive between each two evaluation events (a forward's
  start and end, a recompute's start in backward). The first evaluation of each signature is measured
  as ``budget:`` measures it (:func:`gradpatch.sampling.steps.checkpoint.measured`: what keeping its
  graph would add).
* **Planned.** The plan keeps the evaluations whose graphs, alive from their forward's end to
  their recompute's start, keep the predicted peak within the size (the block policy's choice,
  :func:`gradpatch.checkpointing.budget.peak_choice.choose`): the last evaluations first, whose graphs
  backward frees first. Its first call is recorded too: over the size, the plan is made again with as
  much less room as that call peaked above the prediction, up to :data:`TRIES` times, then every
  evaluation is recomputed.
* **Unreachable.** When recomputing every evaluation already peaked above the size, the next call of
  the key raises :class:`PeakUnreachable` (a ValueError) saying the smallest peak reachable.
* **Another call.** A call whose evaluations differ from the record (another number of steps, other
  shapes: a guidance scale of 0 that halves the batch) recomputes every evaluation from the first that
  differs, and the key is recorded again (as does a call with fewer evaluations). What it kept before
  stays kept: with more evaluations than recorded it may peak above the plan (an adaptive solver, whose
  step count is not its argument: use ``checkpoint_steps=True`` there).

A recording is settled when the next ``peak:`` call begins (its dispatch mode leaves the thread's stack
there). A recording whose call raised, or whose backward did not end before the next call began (two
calls in one step), is dropped; after :data:`TRIES` such recordings the key recomputes every evaluation
without recording. Kept evaluations run as ``budget:`` keeps them
(:func:`gradpatch.sampling.steps.checkpoint.kept`), the others through the call's own recompute:
gradients equal those of ``checkpoint_steps=False`` whatever is kept. :class:`StepPeak` (``run.peak``)
says what a call kept; :func:`records` what was learnt.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch
from torch.utils._pytree import tree_flatten

from gradpatch.checkpointing.budget import timeline
from gradpatch.checkpointing.budget.peak_choice import PeakUnreachable
from gradpatch.sampling.steps import checkpoint as step_checkpoint
from gradpatch.sampling.steps.peak_plan import TRIES, Record, unreachable

__all__ = ["PeakUnreachable", "StepPeak", "TRIES", "call", "evaluate", "records", "reset", "settle"]

T = TypeVar("T")

#: Keys remembered (the least recently used is forgotten).
MAX_RECORDS = 64


@dataclass
class StepPeak:
    """One ``peak:<size>`` call: its size, its phase (``"recording"``: every evaluation recomputed and
    the step recorded; ``"checking"``: the plan, recorded; ``"planned"``; ``"unplanned"``: every
    evaluation recomputed, nothing recorded), what it kept and recomputed, the plan's predicted peak
    and the smallest peak reachable (bytes, once recorded)."""

    size: int
    phase: str = "recording"
    kept: int = 0
    recomputed: int = 0
    predicted: int | None = None
    floor: int | None = None
    keep: frozenset = frozenset()  # the indices of the evaluations kept
    key: tuple = field(default=(), repr=False)
    evaluations: list = field(default_factory=list, repr=False)  # (signature, shape, bytes or None) each
    recording: Any = field(default=None, repr=False)
    record: Any = field(default=None, repr=False)
    returned: bool = field(default=False, repr=False)
    spoiled: bool = field(default=False, repr=False)
    diverged: bool = field(default=False, repr=False)


_LOCK = threading.RLock()
_RECORDS: OrderedDict[tuple, Record] = OrderedDict()
_DROPPED: dict[tuple, int] = {}  # recordings dropped per key
_ACTIVE: list[StepPeak] = []  # the call being recorded (at most one)
_LINGERING: list[Any] = []  # ended recordings not yet off their thread's stack


def records() -> dict[tuple, dict]:
    """What was learnt per key: evaluations, the smallest peak reachable and the peak with every
    evaluation kept (predicted), and per size the kept evaluations, the predicted and realised peaks."""
    with _LOCK:
        return {key: {"evaluations": len(r.signatures), "smallest_peak": r.floor, "largest_peak": r.ceiling,
                      "plans": {size: {"kept": sorted(p.keep), "predicted_peak": p.predicted,
                                       "realised_peak": p.realised} for size, p in r.plans.items()}}
                for key, r in _RECORDS.items()}


def reset() -> None:
    """Forget every record (a recording in progress is dropped)."""
    with _LOCK:
        for state in _ACTIVE:
            if not _off_stack(state.recording):
                _LINGERING.append(state.recording)
        _ACTIVE.clear()
        _LINGERING[:] = [r for r in _LINGERING if not _off_stack(r)]
        _RECORDS.clear()
        _DROPPED.clear()


def _signature(value: Any, depth: int = 0, loose: bool = False) -> Any:
    """Tensors by shape, dtype, device and whether they require grad; numbers, strings and flags by
    value (``loose``: floats by type); modules by identity; other objects by type."""
    if isinstance(value, torch.Tensor):
        return "T", tuple(value.shape), value.dtype, value.device, value.requires_grad
    if loose and isinstance(value, float):
        return "f"
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if depth < 3 and isinstance(value, (tuple, list)) and len(value) <= 64:
        return type(value).__name__, tuple(_signature(v, depth + 1, loose) for v in value)
    if depth < 3 and isinstance(value, dict) and len(value) <= 64:
        return "d", tuple((str(k), "seed" if "seed" in str(k) else _signature(v, depth + 1, loose))
                          for k, v in value.items())
    if isinstance(value, torch.nn.Module):
        return "M", type(value).__qualname__, id(value)
    return "O", type(value).__qualname__


def call(run: Any, entry: Any, args: tuple, kwargs: dict, body: Callable[[], T]) -> T:
    """The sampler call ``body()`` under ``checkpoint_steps="peak:<size>"``: ``run`` (the call's
    :class:`~gradpatch.sampling.run.SamplingRun`) gets its :class:`StepPeak` as ``run.peak``."""
    size = run.options.step_peak
    # The call's key: a seed or a float (a guidance scale) may change at every call without changing
    # what is recorded; a change they do make (another batch) shows in the evaluations' signatures.
    key = (entry, _signature(args, loose=True), _signature(kwargs, loose=True))
    with _LOCK:
        _settle()
        state = StepPeak(size, key=key)
        record = _RECORDS.get(key)
        if record is not None and not record.stale:
            _RECORDS.move_to_end(key)
            state.record, state.floor = record, record.floor
            if record.floor > size:
                raise PeakUnreachable(unreachable(size, record.floor))
            plan = record.plan(size)
            state.keep, state.predicted = plan.keep, plan.predicted
            state.phase = "planned" if plan.realised is not None else "checking"
        elif _DROPPED.get(key, 0) >= TRIES:
            state.phase = "unplanned"
        if state.phase in ("recording", "checking") and not _ACTIVE:
            state.recording = timeline.start({}, ())
            _ACTIVE.append(state)
        elif state.phase == "recording":
            state.phase = "unplanned"  # another call is being recorded (another thread)
    run.peak = state
    try:
        out = body()
    except BaseException:
        with _LOCK:
            if state.recording is not None:
                state.spoiled = True
                _settle()
        raise
    state.returned = True
    record = state.record
    if record is not None and not state.diverged and 0 < len(state.evaluations) < len(record.signatures):
        state.diverged = record.stale = True  # fewer evaluations than recorded: record the key again
    return out


def evaluate(state: StepPeak, fn: Callable[..., T], args: tuple, kwargs: dict,
             recompute: Callable[[Callable[..., T], tuple, dict], T], position: tuple = ()) -> T:
    """Run one evaluation of ``state``'s call: kept, recomputed by ``recompute`` (the call's own), or
    measured (the recorded call's first evaluation of each signature)."""
    index = len(state.evaluations)
    shape = _signature((args, kwargs))
    signature = (position, shape)  # position: (step, total steps) as run_step has them
    recording = state.recording
    if recording is not None and not recording.ended:
        fn = _Marked(fn, state, index)  # type: ignore[assignment]
    record = state.record
    if state.phase in ("checking", "planned") and not state.diverged and \
            (index >= len(record.signatures) or record.signatures[index] != signature):
        state.diverged = record.stale = True  # not the recorded call: recompute, and record the key again
    if state.phase == "recording" and all(s != shape for _, s, _ in state.evaluations):
        out, cost = step_checkpoint.measured(fn, *args, **kwargs)
        state.evaluations.append((signature, shape, cost))
        state.recomputed += 1
    elif state.phase in ("checking", "planned") and not state.diverged and index in state.keep:
        state.evaluations.append((signature, shape, None))
        state.kept += 1
        out = step_checkpoint.kept(fn, *args, **kwargs)
    else:
        state.evaluations.append((signature, shape, None))
        state.recomputed += 1
        out = recompute(fn, args, kwargs)
    if isinstance(fn, _Marked):
        fn.watch(out)
    return out


class _Marked:
    """An evaluation as the recorded call runs it: marks its forward ("F", "E") and its recompute's
    start ("R"), and notes the backward reaching it (whose end ends the recording)."""

    def __init__(self, fn: Callable[..., Any], state: StepPeak, index: int) -> None:
        self.fn, self.state, self.index, self.calls = fn, state, index, 0
        self.recording = recording = state.recording
        while len(recording.calls) <= index:  # the recorder's spans name each evaluation by its index
            recording.calls.append(len(recording.calls))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        recording = self.recording
        if self.calls == 1:
            recording.mark("F", self.index)
            try:
                return self.fn(*args, **kwargs)
            finally:
                recording.mark("E", self.index)
        if not recording.ended:
            self.in_backward()
            if not recording.ended:
                recording.mark("R", self.index)
        return self.fn(*args, **kwargs)

    def watch(self, out: Any) -> None:
        """The backward reaching a kept evaluation's output: noted too."""
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self.in_backward)
                return

    def in_backward(self, grad: Any = None) -> None:
        state, recording = self.state, self.recording
        if recording.backward or recording.ended:
            return
        if not state.returned:  # a backward inside the call (guidance): not the step this records
            state.spoiled = True
            timeline.finish(recording)
            return
        recording.backward = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: timeline.finish(recording))


def settle() -> None:
    """Use the recording of the last ``peak:`` call now if its backward ended, and take its dispatch
    mode off this thread's stack (done anyway when the next ``peak:`` call begins): before entering a
    dispatch mode of one's own (torch's ``MemTracker``) that the next call would otherwise begin in."""
    with _LOCK:
        _settle()


def _settle() -> None:
    """Take the recording in progress off its thread's stack and use it, if its step ended."""
    for recording in list(_LINGERING):
        if _off_stack(recording):
            _LINGERING.remove(recording)
    if not _ACTIVE:
        return
    state = _ACTIVE[0]
    recording = state.recording
    if threading.get_ident() != recording.thread and not recording.ended:
        return  # another thread's call, still going
    _ACTIVE.clear()
    complete = recording.ended and recording.backward and not state.spoiled
    recording.ended = True
    if not _off_stack(recording):
        _LINGERING.append(recording)
    state.recording = None
    if state.phase == "recording":
        if complete and state.evaluations:
            _RECORDS[state.key] = Record.of(state.evaluations, recording.levels, recording.occurrences())
            _RECORDS.move_to_end(state.key)
            while len(_RECORDS) > MAX_RECORDS:
                _RECORDS.popitem(last=False)
            _DROPPED.pop(state.key, None)
        else:
            _DROPPED[state.key] = _DROPPED.get(state.key, 0) + 1
    elif complete and not state.diverged:
        record = _RECORDS.get(state.key)
        if record is not None and record is state.record:
            record.check(state.size, max(recording.levels, default=0))


def _off_stack(recording: Any) -> bool:
    if threading.get_ident() != recording.thread:
        return False
    timeline.stop(recording)
    return not recording.active
