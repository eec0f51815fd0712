"""Measuring one call of a block for :mod:`gradpatch.checkpointing.budget`: the bytes autograd
saves in the checkpoint's own forward, and the time of that call and of the recompute in backward.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from gradpatch.checkpointing._paths import run as _checkpoint

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


class _Measured:
    """``func`` as the checkpoint sees it while a block is measured: a bound-method look-alike (the
    checkpoint remembers a module's method by ``__self__``/``__func__``). Its first call is the
    checkpoint's forward, which builds ``func``'s graph as the caller would: the bytes autograd saves
    there are counted and the call timed. Calls after the checkpoint returned are recomputes: timed.
    Any other call, and a first call made inside ``torch.utils.checkpoint`` (the graph path, which
    a block that escaped the fast path takes at once), runs untouched: torch's checkpoint needs its
    own saved-tensor hooks to take effect."""

    def __init__(self, func: Callable[..., Any], block: Any, clock: Callable[[], float],
                 held: set) -> None:
        self.__self__, self.__func__, self.__name__ = func.__self__, func.__func__, func.__name__
        self.func, self.block, self.clock, self.held = func, block, clock, held
        self.calls, self.returned, self.counted, self.seconds = 0, False, False, 0.0
        self.saved: dict[Any, int] = {}

    def pack(self, t: Tensor) -> Tensor:
        key, size = _storage(t)
        if key not in self.held:
            self.saved[key] = max(self.saved.get(key, 0), size)
        # Detached: an op's output saved as itself would form a cycle with its grad_fn, kept until
        # the garbage collector runs. Its storage stays alive with the graph: keys stay unique.
        return t.detach()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.returned:
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


def measure(block: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None) -> Any:
    values = args if kwargs is None else (*args, *kwargs.values())
    owner = func.__self__
    held = {_storage(t)[0] for t in (*[v for v in values if isinstance(v, Tensor)],
                                      *owner.parameters(), *owner.buffers())}
    clock = _clock(values)
    measured = _Measured(func, block, clock, held)
    block.pending.add(measured)
    block.per_step = max(block.per_step, len(block.pending))
    start = clock()
    out = _checkpoint(measured, args, kwargs)
    elapsed = clock() - start
    measured.returned = True
    block.forward.append(measured.seconds)
    block.overhead.append(max(elapsed - measured.seconds, 0.0))
    if measured.counted:
        # Keeping the block also frees what its checkpoint holds besides the inputs: the RNG state.
        size = max(sum(measured.saved.values()) - _RNG_BYTES, 0)
        block.bytes = size if block.bytes is None else max(block.bytes, size)
    elif block.bytes is None:
        block.opaque = True
    return out


def _inside_torch_checkpoint() -> bool:
    """Whether ``torch.utils.checkpoint`` is running the caller (frames up to :func:`measure`)."""
    frame = sys._getframe(2)
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
