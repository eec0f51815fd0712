"""The moment ``grad_steps`` resumes recording: between the last evaluation of step N-K-1 and the first
of step N-K (see :func:`gradpatch.sampling.run.run_step`).

DRaFT-K by hand is the sampler's loop with ``x = x.detach()`` at the top of the loop body before step
N-K: what the sampler computes after step N-K-1's evaluation in that iteration (its post-processing,
the state update ``x = x + dt * v``) gets no gradient, and what it computes at the top of the next
iteration before calling step N-K (a pre-net ``x = pre(x)``, ``c_in = torch.cat([uc, c])``) is recorded,
the latent a constant. Grad comes back on when step N-K-1's last evaluation returns, and until step N-K
starts a :class:`~torch.overrides.TorchFunctionMode` sorts the operations that read the cut steps'
outputs (tainted: those outputs and everything computed from them) by where the sampler's code is:

* Still in the iteration of step N-K-1: the position in the frames that called step N-K-1 (the
  sampler's loop, a per-step method) is after that call. The operation runs under ``no_grad`` (a tensor
  it updates in place is detached in place first) and its outputs are tainted: the latent has no graph
  (the initial noise gets no gradient).
* Back at the top of the loop: some frame that called step N-K-1 is at an earlier position than that
  call, or is calling it again through a new frame (a per-step method called anew). From there until
  step N-K starts, everything runs as written: the tainted tensors carry no graph, so a pre-net applied
  to the latent gets its parameters' share of step N-K and nothing before.

Operations that read no tainted tensor (conditioning prepared from the prompt) always run as written.
Where step N-K is called without the code going back first (a last step written after the loop), a
trainable parameter applied to the tainted latent in between could belong to either step: that raises
(:meth:`Window.check`) rather than guess.
"""
from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from gradpatch.checkpointing.compat import sequence_nr

from gradpatch.sampling.values import tensors as _all_tensors


_DEPTH = 64  # frames read up from the one that called step N-K-1
_IN_PLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__"})


class Window(TorchFunctionMode):
    """Entered when grad resumes, exited when step N-K starts (or the call ends). ``caller``: the frame
    that called step N-K-1's evaluation (its callers are read up from it)."""

    def __init__(self, tainted: Any, caller: FrameType | None = None, since: int | None = None) -> None:
        super().__init__()
        self.tainted: dict[int, weakref.ref] = {}
        self.taint(tainted)
        # Guidance recorded step N-K-1 inside its own enable_grad(): what that block computed from then
        # until now (autograd nodes numbered in [since, until)) is tainted too.
        self.since, self.until = (since, sequence_nr()) if since is not None else (0, 0)
        # id -> (frame, its position when it called step N-K-1, the frame it was calling then)
        self.frames: dict[int, tuple[FrameType, int, FrameType | None]] = {}
        child = None
        while caller is not None and len(self.frames) < _DEPTH:
            self.frames[id(caller)] = (caller, caller.f_lasti, child)
            child, caller = caller, caller.f_back
        self.top = False  # the sampler's code went back to the top of its loop: nothing is cut any more
        self.ambiguous: str | None = None  # a trainable parameter applied to the tainted latent, cut

    def close(self) -> None:
        self.frames.clear()  # the frames (and their locals) are not held past the window

    def check(self, where: str) -> None:
        """Called when step N-K starts: raise if a cut could have belonged to step N-K."""
        if self.ambiguous is not None and not self.top and not self._at_top():  # (step N-K's call, from a loop?)
            raise RuntimeError(
                f"{where}: grad_steps: between step N-K-1 and step N-K, {self.ambiguous} applied a trainable "
                "parameter to the latent, and the sampler's code did not go back to the top of its loop "
                "before calling step N-K (it calls it from another place): whether that belongs to step N-K-1 "
                "(cut, as the latent DRaFT-K detaches) or to step N-K (recorded) cannot be told. Pass as step "
                "what includes it, or use checkpoint_steps")

    def _at_top(self) -> bool:
        """Whether the code is back at the top of the loop that called step N-K-1 (module docstring)."""
        frame: FrameType | None
        child, frame = None, sys._getframe(2)
        for _ in range(4 * _DEPTH):
            if frame is None:
                return False
            entry = self.frames.get(id(frame))
            if entry is not None and entry[0] is frame:
                return frame.f_lasti < entry[1] or (frame.f_lasti == entry[1] and child is not entry[2])
            child, frame = frame, frame.f_back
        return False

    def taint(self, obj: Any) -> None:
        for tensor in _all_tensors(obj, modules=False):
            self.tainted[id(tensor)] = weakref.ref(tensor)

    def _is_tainted(self, tensor: torch.Tensor) -> bool:
        ref = self.tainted.get(id(tensor))
        if ref is not None and ref() is tensor:
            return True
        node = tensor.grad_fn if self.until else None
        return node is not None and self.since <= node._sequence_nr() < self.until

    def _constant(self, value: Any) -> Any:
        """``value`` without the graph of the cut steps, if it is a tainted tensor that has one (guidance
        recorded them): detached in place where it can be (the sampler's own variable then holds the
        constant latent), else a detached copy."""
        if not (isinstance(value, torch.Tensor) and value.requires_grad and self._is_tainted(value)):
            return value
        if value._base is None and not value.is_leaf:
            value.detach_()
            return value
        return value.detach()

    def detached(self, values: Any) -> Any:
        """``values`` (step N-K's arguments) with the tainted tensors among them constant."""
        return tree_map(self._constant, values)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = list(_all_tensors((args, kwargs), -1, modules=False))
        if not any(self._is_tainted(t) for t in inputs):
            return func(*args, **kwargs)
        self.top = self.top or self._at_top()
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and target.requires_grad and target._base is None and (
                name in _IN_PLACE or (name.endswith("_") and not name.startswith("_"))):
            target.detach_()  # a buffer refilled with the latent: its earlier graph must not reach step N-K
        if self.top:  # step N-K's iteration: recorded, the latent a constant
            args, kwargs = self.detached((args, kwargs))
            return func(*args, **kwargs)
        if self.ambiguous is None and any(isinstance(t, torch.nn.Parameter) and t.requires_grad for t in inputs):
            self.ambiguous = f"torch.{getattr(func, '__name__', func)}"
        with torch.no_grad():
            out = func(*args, **kwargs)
        self.taint(out)
        if name == "__setitem__" and isinstance(target, torch.Tensor):
            self.taint(target)
        return out
