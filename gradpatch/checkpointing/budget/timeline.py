"""One training step's memory, measured for the ``peak:<size>`` policy (:mod:`gradpatch.checkpointing.budget.peak`):
the most bytes alive between each two block events.

The step is recorded from its forward's start (:mod:`~gradpatch.checkpointing.budget.forward_start`;
else its first checkpointed block's call) to the end of its backward (an autograd callback) by a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` that counts each storage an operator creates
(not a view or an in-place result: those share an input's storage) and, through a weak reference on
the storage, when it is freed: bytes alive above the step's start, as the allocator would count them
(without its rounding), for the step's tensors whichever code holds them. The blocks run as the plan
being recorded says (every block recomputed, as under ``respect``, for the first recording); each call
marks its forward's start and end and its recompute's start. Only this step runs under the mode (a few
Python calls per operator); the user's own dispatch modes below it keep working.

A step that does not call every block (two models trained in turns, each its own steps: a GAN's
generator and discriminator) is recorded on until every block expected (:func:`start`) was called, up
to :data:`STEPS` steps: between two steps the recording pauses (the optimizer's step, the next batch's
loading are not the step's), each step counts from what was allocated when it began, and the plan
covers each kind of step.

A forward that no backward reaches before the step's own forward begins (a validation forward run
with grad on, a forward that raised) is not a step of its own: its block calls are left out of
:meth:`Recording.occurrences` (its memory stays in the levels, as it was alive), so the plan does not
count each block twice; :meth:`Recording.abandoned` says whether there was one.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradpatch.checkpointing.budget import resizes


class Recording(TorchDispatchMode):
    """The live-bytes count of one step and its marks (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.high = 0
        self.levels: list[int] = []  # the most alive in each interval between two marks
        self.marks: list[tuple[str, int]] = []  # (kind, call): "F" forward start, "E" its end, "R" recompute
        self.calls: list[Any] = []  # the block of each call
        self.tracked: dict[int, int] = {}
        self.thread = threading.get_ident()
        self.ended = self.backward = self.active = False
        self.choices: dict = {}
        self.reached: set[int] = set()  # calls a backward reached (or with nothing for one to reach)
        self.expected: set[int] = set()  # ids of the blocks to record a call of (see start)
        self.paused, self.steps = False, 0  # between two steps of the recording; steps ended

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.ended:  # until the mode leaves the stack at the next block call (see finish)
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = id(storage)
            if key in self.tracked:
                continue
            if inputs is None:
                inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0]
                          if isinstance(a, torch.Tensor) and _has_storage(a)}
            if key in inputs:  # a view or an in-place result: no new storage
                continue
            size = storage.nbytes()
            self.tracked[key] = size
            self.now += size
            self.high = max(self.high, self.now)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        counted = self.tracked.pop(key, None)
        if counted is not None:
            self.now -= counted

    def resized(self, storage: Any, old: int, new: int) -> None:
        """``storage`` resized in place from ``old`` to ``new`` bytes
        (:mod:`~gradpatch.checkpointing.budget.resizes`): what it gained counts as allocated, what it gave
        back as freed, down to what this recording counted of it. One that existed before the step and
        shrinks frees memory the step did not allocate: not counted."""
        if self.ended or self.paused:
            return
        key = id(storage)
        counted = self.tracked.get(key)
        if counted is None:
            if new <= old:
                return
            counted = self.tracked[key] = 0
            weakref.finalize(storage, _freed, weakref.ref(self), key)  # (such storages outlive recordings)
        change = max(new - old, -counted)
        self.tracked[key] = counted + change
        self.now += change
        self.high = max(self.high, self.now)

    def mark(self, kind: str, call: int) -> None:
        self.levels.append(self.high)
        self.high = self.now
        self.marks.append((kind, call))

    def occurrences(self) -> list[tuple[Any, int, int]]:
        """(block, first interval, end interval) of each call: from its forward's start to its
        recompute's start (the step's end if it was not recomputed). Level ``k`` is the interval that
        ends at mark ``k`` (:meth:`mark`; the last, after the last mark, :func:`finish`), so a call
        marked ``F`` at ``s`` and ``R`` at ``e`` is alive in levels ``s + 1`` to ``e``."""
        starts: dict[int, int] = {}
        ends: dict[int, int] = {}
        for index, (kind, call) in enumerate(self.marks):
            if kind == "F":
                starts[call] = index
            elif kind == "R" and call not in ends:
                ends[call] = index
        abandoned = self.abandoned()
        return [(self.calls[c], starts[c] + 1, ends.get(c, len(self.marks)) + 1) for c in starts if c not in abandoned]

    def abandoned(self) -> set[int]:
        """The calls of forwards that began before the step's last one and that no backward reached:
        dropped without a backward, or raised (module docstring). A second forward whose graph the one
        backward also reaches (gradient accumulation) keeps its calls."""
        if not self.calls:
            return set()
        first = self.calls[0]
        last = max(i for i, block in enumerate(self.calls) if block is first)
        return {i for i in range(last) if i not in self.reached}


class Marked:
    """``func`` as the checkpoint sees it during the recorded step: a bound-method look-alike (the
    checkpoint remembers a module's method by ``__self__``/``__func__``) that marks its calls."""

    def __init__(self, func: Any, recording: Recording, call: int) -> None:
        self.__self__, self.__func__, self.__name__ = func.__self__, func.__func__, func.__name__
        self.func, self.recording, self.call, self.calls = func, recording, call, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        recording = self.recording
        if self.calls == 1:  # the block's forward
            recording.mark("F", self.call)
            try:
                out = self.func(*args, **kwargs)
            finally:
                recording.mark("E", self.call)
            for t in tree_flatten(out)[0]:  # a kept block's backward: note the backward's end there
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._in_backward)
                    break
            else:  # nothing of it for a backward to reach
                recording.reached.add(self.call)
            return out
        if not recording.ended:
            self._in_backward(None)
            recording.mark("R", self.call)
        return self.func(*args, **kwargs)

    def _in_backward(self, grad: Any) -> None:
        recording = self.recording
        recording.reached.add(self.call)
        if not (recording.backward or recording.ended or recording.paused):  # the backward's first block: note its end
            recording.backward = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: finish(recording))


#: The most steps one recording spans while blocks it expects have not been called.
STEPS = 8


def start(choices: dict, inputs: tuple = (), expected: Any = (), early: Recording | None = None) -> Recording:
    """Record the step beginning now, at its first block's call with ``inputs``; ``choices``: the plan
    it runs (block -> choice), empty: every block recomputed; ``expected``: the blocks it records steps
    until it has seen (module docstring). The inputs computed in this forward count from the start.
    ``early``: a recording begun at the step's forward's start
    (:mod:`~gradpatch.checkpointing.budget.forward_start`), which becomes this one."""
    if early is not None:
        early.choices, early.expected = choices, {id(block) for block in expected}
        return early
    recording = Recording()
    recording.choices = choices
    recording.expected = {id(block) for block in expected}
    recording.__enter__()
    for t in inputs:  # computed since the forward began (an input convolution's output): alive already
        if isinstance(t, torch.Tensor) and t.grad_fn is not None and _has_storage(t):
            storage = t.untyped_storage()
            if id(storage) not in recording.tracked:
                recording.tracked[id(storage)] = storage.nbytes()
                recording.now += storage.nbytes()
                weakref.finalize(storage, recording._free, id(storage))
    for storage, size in resizes.grown():  # grown in place before the step's first block (FSDP's root
        key = id(storage)  # parameters, all-gathered as its forward began), still grown: alive already
        if key not in recording.tracked:
            recording.tracked[key] = size
            recording.now += size
            weakref.finalize(storage, _freed, weakref.ref(recording), key)
    recording.high = recording.now
    recording.active = True
    resizes.follow(recording)
    return recording


def run(recording: Recording, block: Any, runner: Callable[..., Any], func: Callable[..., Any], args: tuple,
        kwargs: dict | None) -> Any:
    """One block call of the recorded step, run by ``runner(func, args, kwargs)`` (``paths.run``:
    recomputed as under ``respect``)."""
    if recording.paused:  # the next step begins: it counts from what is allocated now, as a step of its own
        recording.paused = False
        recording.tracked.clear()
        recording.now = recording.high = 0
        recording.mark("B", -1)
    recording.calls.append(block)
    return runner(Marked(func, recording, len(recording.calls) - 1), args, kwargs)


def finish(recording: Recording) -> None:
    """The backward ended: the last interval. The mode stays on the stack, passing every op through:
    the autograd engine runs this callback with a copy of the thread's modes, which it puts back
    afterwards, so the mode can only leave from the thread itself (:func:`stop`)."""
    if recording.ended or recording.paused:
        return
    recording.steps += 1
    if recording.steps < STEPS and recording.expected - {id(block) for block in recording.calls}:
        recording.mark("S", -1)  # blocks not called yet: another kind of step to come
        recording.paused, recording.backward = True, False
        return
    recording.levels.append(recording.high)
    recording.ended = True


def stop(recording: Recording, pop: bool = True) -> None:
    """Take the mode off this thread's stack if it is on top there, called from the thread that
    recorded (the next block call, :func:`gradpatch.checkpoint_plan`); it stops counting anyway
    (``pop=False``: only that, the mode left on the stack to pass ops through)."""
    recording.ended = True
    resizes.leave(recording)
    if not pop or not recording.active or threading.get_ident() != recording.thread:
        return
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is recording:
        recording.active = False
        recording.__exit__(None, None, None)


def unwind() -> None:
    """Take ended recordings off the top of this thread's dispatch stack (before another is pushed)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    while isinstance(mode, Recording) and mode.ended and mode.active and mode.thread == threading.get_ident():
        mode.active = False
        mode.__exit__(None, None, None)
        mode = _get_current_dispatch_mode()


def _freed(recording: Any, key: int) -> None:
    alive = recording()
    if alive is not None:
        alive._free(key)


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
        return True
    except (RuntimeError, NotImplementedError):
        return False
