"""Measuring one call of a block for :mod:`gradpatch.checkpointing.budget.policy`: the bytes autograd
saves in the checkpoint's own forward, and the time of that call and of the recompute in backward.

Bytes are counted once per storage (views of one tensor, a tensor saved by several ops), leaving out
the block's inputs and its module's parameters and buffers. Once the checkpoint returned and the
forward's graph is dropped, a saved storage that is freed is the block's own (``block.bytes``: what
keeping it adds for certain); one still alive is shared with the rest of the step (``block.shared``:
its output saved by its last op, a tensor computed before the call), and costs only where nothing
else keeps it, which :func:`consumers` learns from the storages later checkpointed calls take as
inputs: a block holds its inputs while it is recomputed, and while it is kept if it saves them
itself (``block.holds``).
"""
from __future__ import annotations

import os
import sys
import time
from types import FrameType
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from gradpatch.checkpointing import paths
from gradpatch.checkpointing.budget.key import size_of

_RNG_BYTES = torch.get_rng_state().nbytes  # what the checkpoint saves per call besides the inputs
_TORCH_CHECKPOINT = os.path.join("torch", "utils", "checkpoint.py")


def _clock(values: Iterable[Any]) -> Callable[[], float]:
    """Thread CPU time on one CPU thread, which other processes disturb least; otherwise wall time,
    after synchronising the inputs' CUDA devices (kernels run asynchronously)."""
    devices = {v.device for v in values if isinstance(v, Tensor) and v.is_cuda}
    if devices:
        def clock() -> float:
            for device in devices:
                torch.cuda.synchronize(device)
            return time.perf_counter()
        return clock
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


class Measured:
    """``func`` as the checkpoint sees it while a block is measured: a bound-method look-alike (the
    checkpoint remembers a module's method by ``__self__``/``__func__``). Its first call is the
    checkpoint's forward, which builds ``func``'s graph as the caller would: the bytes autograd saves
    there are counted and the call timed. Calls after the checkpoint returned are recomputes: timed.
    Any other call, and a first call made inside ``torch.utils.checkpoint`` (the graph path, which
    a block that escaped the fast path takes at once), runs untouched: torch's checkpoint needs its
    own saved-tensor hooks to take effect."""

    def __init__(self, func: Any, block: Any, clock: Callable[[], float],
                 held: set) -> None:
        self.__self__, self.__func__, self.__name__ = func.__self__, func.__func__, func.__name__
        self.func, self.block, self.clock, self.held = func, block, clock, held
        self.calls, self.returned, self.counted, self.seconds = 0, False, False, 0.0
        self.saved: dict[Any, tuple[Any, int]] = {}  # key -> (weak reference or None, bytes)
        self.holds: set[int] = set()  # shared storages it takes as input and saves itself

    def pack(self, t: Tensor) -> Tensor:
        key, size = _storage(t)
        if key in self.held:  # an input saved by the block itself: held while it is kept too
            entry = _LIVE.get(key)
            if entry is not None and not entry[0].expired():
                self.holds.add(entry[1])
        elif key not in self.saved:
            self.saved[key] = (_weak(t), size)
        # Detached: an op's output saved as itself would form a cycle with its grad_fn, kept until
        # the garbage collector runs. Its storage stays alive with the graph: keys stay unique.
        return t.detach()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.returned:
            if _LIVE:
                _at_backward()
            start = self.clock()
            try:  # torch's checkpoint may end its recompute early, by an exception
                return self.func(*args, **kwargs)
            finally:
                self.block.recompute.append(self.clock() - start)
                self.block.pending.discard(self)
        if self.calls > 1:  # the graph path's forward, after the fast path's attempt
            return self.func(*args, **kwargs)
        start = self.clock()
        if _inside_torch_checkpoint():
            out = self.func(*args, **kwargs)
        else:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, _same):
                out = self.func(*args, **kwargs)
            self.counted = True
        self.seconds = self.clock() - start
        return out


def measure(block: Any, func: Any, args: tuple, kwargs: dict | None) -> Any:
    values = args if kwargs is None else (*args, *kwargs.values())
    owner = func.__self__
    held = {_storage(t)[0] for t in (*[v for v in values if isinstance(v, Tensor)],
                                      *owner.parameters(), *owner.buffers())}
    clock = _clock(values)
    measured = Measured(func, block, clock, held)
    block.pending.add(measured)
    block.per_step = max(block.per_step, len(block.pending))
    start = clock()
    out = paths.run(measured, args, kwargs)
    elapsed = clock() - start
    measured.returned = True
    block.forward.append(measured.seconds)
    block.overhead.append(max(elapsed - measured.seconds, 0.0))
    if measured.counted:
        own, shared = 0, {}
        for key, (ref, size) in measured.saved.items():
            if ref is None or ref.expired():
                own += size
            else:  # alive beyond the call: keyed by a step-independent id, see _share
                shared[_share(key, ref, size, block)] = size
        measured.saved.clear()
        # Keeping the block also frees what its checkpoint holds besides the inputs: the RNG state.
        own = max(own - _RNG_BYTES, 0)
        block.bytes = own if block.bytes is None else max(block.bytes, own)
        if shared or block.shared:  # the latest call's: each call saves storages of its own
            block.shared, block.consumers, block.anyway = shared, {}, set()
        block.holds = measured.holds
        block.largest = max(block.largest, size_of(args, kwargs))
    elif block.bytes is None:
        block.opaque = True
        block.why = paths.graph_path_reason(measured, args, kwargs)
    return out


#: Storages that measured blocks saved and that outlived their call: storage key -> (weak reference,
#: shared-storage id, producing block). Entries whose storage was freed are dropped by prune().
_LIVE: dict[Any, tuple[Any, int, Any]] = {}
_ids = [0]


def _share(key: Any, ref: Any, size: int, block: Any) -> int:
    entry = _LIVE.get(key)
    if entry is not None and not entry[0].expired():
        return entry[1]  # saved by an earlier block of this step too: the same storage
    _ids[0] += 1
    _LIVE[key] = (ref, _ids[0], block)
    _UNCHECKED.append(key)
    return _ids[0]


_UNCHECKED: list[Any] = []  # storages in _LIVE not yet seen by a backward


def measuring() -> bool:
    """Whether storages that measured blocks saved may still be alive (see :func:`consumers`)."""
    return bool(_LIVE)


def forget() -> None:
    """Forget every storage noted (:func:`gradpatch.checkpointing.budget.reset`)."""
    _LIVE.clear()
    _UNCHECKED.clear()


def _at_backward() -> None:
    """At a measured block's first recompute the forward is over and every block was checkpointed
    (as under ``respect``): a shared storage still alive that no checkpointed call took is held by
    something else (a tensor computed before the call, kept by its module) and costs nothing. (A
    backward inside ``torch.autocast`` finds its cached weight casts alive too: they are taken as
    held, and a plan keeping them may exceed its budget by their size; torch recommends the
    backward outside autocast.)"""
    while _UNCHECKED:
        entry = _LIVE.get(_UNCHECKED.pop())
        if entry is not None and not entry[0].expired() and not entry[2].consumers.get(entry[1]):
            entry[2].anyway.add(entry[1])


def consumers(block: Any, values: Iterable[Any]) -> None:
    """Note that ``block`` (checkpointed, so keeping its inputs) takes storages that measured blocks
    saved: while ``block`` is recomputed, keeping those blocks does not keep them for it."""
    for v in values:
        if isinstance(v, Tensor):
            entry = _LIVE.get(_storage(v)[0])
            if entry is not None and entry[2] is not block and not entry[0].expired():
                entry[2].consumers.setdefault(entry[1], set()).add(block)


def prune() -> None:
    """Forget the storages freed since."""
    for key in [k for k, entry in _LIVE.items() if entry[0].expired()]:
        _LIVE.pop(key, None)
    _UNCHECKED[:] = [k for k in _UNCHECKED if k in _LIVE]


def _weak(t: Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def _inside_torch_checkpoint() -> bool:
    """Whether ``torch.utils.checkpoint`` is running the caller (frames up to :func:`measure`)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code is not measure.__code__:
        if frame.f_code.co_filename.endswith(_TORCH_CHECKPOINT):
            return True
        frame = frame.f_back
    return False


def _same(t: Tensor) -> Tensor:
    return t


def _storage(t: Tensor) -> tuple[Any, int]:
    try:
        storage = t.untyped_storage()
        return (storage.data_ptr(), t.device) if storage.data_ptr() else id(t), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # no plain storage: count its elements
        return id(t), t.nelement() * t.element_size()
