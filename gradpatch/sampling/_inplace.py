"""In-place writes during a :func:`gradpatch.differentiable` call, made to give out-of-place gradients.

Samplers written for ``no_grad`` refill buffers (``x_in[:B] = x``) and update their state in place
(``x += v * dt``). With grad on, autograd refuses: a tensor saved for backward was modified. Here every
tensor saved for backward during the call is packed by reference with its version
(:func:`torch.autograd.graph.saved_tensors_hooks`), and a :class:`~torch.overrides.TorchFunctionMode`
sees every in-place torch call (``__setitem__``, ``__iadd__`` and the other augmented assignments,
``*_`` methods, ``out=``): before the write, each saved tensor that shares the written storage is
copied (copy on write), and backward reads the copy. So the gradients are those of the out-of-place
computation, and memory grows only by the tensors actually overwritten after being saved. An
augmented assignment to a leaf that requires grad (the caller's noise) becomes out of place (Python
rebinds the name), which autograd would otherwise refuse. ``.numpy()`` of a tensor that requires grad
is refused with its place (the result would leave torch). In the first N-K steps of a ``grad_steps``
call, a tensor updated in place is detached in place first, so the latent entering step N-K carries
no graph (torch would keep its old history).

What breaks: a write that torch does not dispatch through ``__torch_function__`` (``.data`` copies,
C++ extensions writing into a tensor they were given) is not seen; backward then raises (the saved
version differs) rather than use the new values. Tensors saved inside a checkpointed region are not
packed here (the checkpoint recomputes them); the region's inputs are (:meth:`CopyOnWrite.hold`).
Every torch call of the sampler and its networks passes through the mode during the call (a Python
call each): ``benchmarks/differentiable_overhead.py`` (CPU, one thread, 16 Euler steps of a 3-layer MLP,
batch 8) measured forward + backward at 2.1x the hand-written reference for width 64 and 1.09x for
width 1024.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gradpatch.errors import NotDifferentiableError
from gradpatch.sampling import runner as _sampling

_AUGMENTED = {"__iadd__": "__add__", "__isub__": "__sub__", "__imul__": "__mul__", "__itruediv__": "__truediv__",
              "__ifloordiv__": "__floordiv__", "__imod__": "__mod__", "__ipow__": "__pow__",
              "__imatmul__": "__matmul__", "__iand__": "__and__", "__ior__": "__or__", "__ixor__": "__xor__",
              "__ilshift__": "__lshift__", "__irshift__": "__rshift__"}
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream", "__set__", "__get__"})


class Saved:
    """A tensor saved for backward, by reference, until a write makes it keep a copy."""

    __slots__ = ("tensor", "version", "copy", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version, self.copy = tensor, tensor._version, None

    def value(self) -> torch.Tensor:
        if self.copy is not None:
            return self.copy
        if self.tensor._version != self.version:
            raise RuntimeError("gradpatch.differentiable: a tensor saved for backward was modified in place by "
                               "an operation that torch does not dispatch through __torch_function__ (a .data "
                               "copy, a C++ extension); its gradient cannot be computed")
        return self.tensor


def _key(tensor: torch.Tensor) -> tuple[str, int] | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    pointer = storage.data_ptr()
    return (str(tensor.device), pointer) if pointer else None


class CopyOnWrite(TorchFunctionMode):
    """The mode and the pack/unpack hooks of one call (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[tuple[str, int], weakref.WeakSet[Saved]] = {}

    def hold(self, tensor: torch.Tensor) -> Saved:
        saved = Saved(tensor)
        key = _key(tensor)
        if key is not None:
            self.saved.setdefault(key, weakref.WeakSet()).add(saved)
        return saved

    pack = hold

    def __enter__(self) -> "CopyOnWrite":
        run = _sampling._current.get()
        if run is not None:  # checkpoint_steps: recomputes restore what was written since (_step_inputs)
            run.keep = self.hold
        return super().__enter__()

    @staticmethod
    def unpack(saved: Saved) -> torch.Tensor:
        return saved.value()

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _protect(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        key = _key(tensor)
        held = self.saved.pop(key, None) if key is not None else None
        for saved in list(held or ()):
            if saved.copy is None:
                with torch.no_grad():
                    saved.copy = saved.value().detach().clone()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "numpy" and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            frame = sys._getframe(1)
            raise NotDifferentiableError(
                f"gradpatch.differentiable: .numpy() at {frame.f_code.co_filename}:{frame.f_lineno} takes the result "
                "out of torch, where gradients cannot follow. Differentiate the tensor before the conversion "
                "(call the part of the sampler that returns it)")
        if name in _AUGMENTED and args and isinstance(args[0], torch.Tensor) and args[0].is_leaf \
                and args[0].requires_grad and torch.is_grad_enabled():
            return getattr(torch.Tensor, _AUGMENTED[name])(*args, **kwargs)  # x += v: rebinds x, out of place
        if args and (name == "__setitem__" or name in _AUGMENTED
                     or (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES)):
            self._protect(args[0])
            target = args[0]
            if isinstance(target, torch.Tensor) and target.requires_grad and target._base is None \
                    and not torch.is_grad_enabled() and getattr(_sampling._current.get(), "cut", False):
                target.detach_()  # grad_steps: a state updated in place in an early step leaves the graph
        out = kwargs.get("out")
        if out is not None:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                self._protect(tensor)
        return func(*args, **kwargs)
