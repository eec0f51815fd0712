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

Saved-tensor hooks compose: the caller's own around the call (``save_on_cpu``) still get every tensor
saved, and so do hooks the sampler pushes during the call; copy on write holds those tensors weakly
(:class:`Through`) and stands in, in backward, only for one that the hooks kept by reference and that
was written since (``save_on_cpu`` of a CPU tensor keeps the tensor itself).

What breaks: a write that torch does not dispatch through ``__torch_function__`` (``.data`` copies,
C++ extensions writing into a tensor they were given) is not seen; backward then raises (the saved
version differs) rather than use the new values. Tensors saved inside a checkpointed region are not
packed here (the checkpoint recomputes them); the region's inputs are (:meth:`CopyOnWrite.hold`).
Every torch call of the sampler passes through the mode during the call (a Python call each; one dict
lookup decides that a call writes nothing), and every tensor saved for backward through the pack hook
(a parameter saved again at each step is held once); the step's evaluations after its first two, where
copy on write had nothing to do, run without them (:mod:`gradpatch.sampling.generic.unwatched`).
``benchmarks/differentiable_overhead.py`` (CPU, one thread, forward + backward against the hand-written
reference) measured 1.5x for a width-64 MLP (16 Euler steps, batch 8), 1.2x at width 256, 1.04x at
width 1024, 1.23x and 1.17x on Chatterbox's and Matcha's tiny decoders, and at the sizes upstream builds
(10 steps, 100 frames) 1.06x on Chatterbox's S3Gen decoder and 0.99x on Matcha's.
"""
from __future__ import annotations

import sys
import threading
import weakref
from contextvars import ContextVar
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from gradpatch.checkpointing.compat import setitem_to_modes, top_saved_tensors_hooks
from gradpatch.errors import NotDifferentiableError
from gradpatch.sampling.generic.held import Saved, Through, storage_pointer
from gradpatch.sampling import run as sampling_run

_AUGMENTED = {"__iadd__": "__add__", "__isub__": "__sub__", "__imul__": "__mul__", "__itruediv__": "__truediv__",
              "__ifloordiv__": "__floordiv__", "__imod__": "__mod__", "__ipow__": "__pow__",
              "__imatmul__": "__matmul__", "__iand__": "__and__", "__ior__": "__or__", "__ixor__": "__xor__",
              "__ilshift__": "__lshift__", "__irshift__": "__rshift__"}
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream", "__set__", "__get__"})


class CopyOnWrite(TorchFunctionMode):
    """The mode and the pack/unpack hooks of one call (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # storage (its address; on another device, a copy too many at worst) -> what holds tensors saved
        # on it (weakly: the graph keeps them), swept as it grows
        self.saved: dict[int, list[weakref.ref[Saved | Through]]] = {}
        self.tokens: list[Any] = []
        self.noted, self.sweep_at = 0, 4096
        self.leaves: dict[int, Saved] = {}  # id -> the last hold of a leaf that requires grad (it holds it)
        self.acted = 0  # writes that copy on write changed: a copy kept, a leaf's update made out of place
        self.pushed: tuple[Any, Any] | None = None  # the (pack, unpack) pushed by hooks(), once entered

    def note(self, pointer: int, held: Saved | Through) -> None:
        refs = self.saved.get(pointer)
        if refs is None:
            self.saved[pointer] = [weakref.ref(held)]
        else:
            refs.append(weakref.ref(held))
        self.noted += 1
        if self.noted > self.sweep_at:
            self.sweep()

    def sweep(self) -> None:
        """Drop what the graphs no longer hold (in place: a note made meanwhile is kept)."""
        live = 0
        for pointer, refs in list(self.saved.items()):
            for i in range(len(refs) - 1, -1, -1):
                if refs[i]() is None:
                    del refs[i]
            if refs:
                live += len(refs)
            else:
                self.saved.pop(pointer, None)
        self.noted, self.sweep_at = live, max(4096, 2 * live)

    def hold(self, tensor: torch.Tensor) -> Saved:
        saved = Saved(tensor)
        pointer = storage_pointer(tensor)
        if pointer:
            self.note(pointer, saved)
        return saved

    def pack(self, tensor: torch.Tensor) -> Saved:
        # Held detached (same storage and version counter): a saved output held as itself would keep its
        # own node alive through the hook (a reference cycle), past the graph a checkpoint drops. A leaf
        # (a parameter, a tensor that does not require grad) has no node: held as it is. One call per
        # tensor saved: hold and note inlined.
        if not tensor.is_leaf:
            tensor = tensor.detach()
        elif tensor.requires_grad:  # a parameter, the caller's input: saved again at every step
            saved = self.leaves.get(id(tensor))
            if saved is not None and saved.tensor is tensor and saved.version == tensor._version \
                    and saved.copy is None:
                return saved
            saved = self.leaves[id(tensor)] = Saved(tensor)
            pointer = storage_pointer(tensor)
            if pointer:
                self.note(pointer, saved)
            return saved
        saved = Saved(tensor)
        try:
            pointer = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return saved
        if pointer:
            refs = self.saved.get(pointer)
            if refs is None:
                self.saved[pointer] = [weakref.ref(saved)]
            else:
                refs.append(weakref.ref(saved))
            self.noted += 1
            if self.noted > self.sweep_at:
                self.sweep()
        return saved

    def __enter__(self) -> CopyOnWrite:
        run = sampling_run.current.get()
        if run is not None:  # checkpoint_steps: recomputes restore what was written since (steps.inputs)
            run.keep = self.hold
        _compose_pushes()
        self.tokens.append(_active.set(self))
        setitem_to_modes(True)  # torch 2.1: item assignment reaches the mode through a shim
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            setitem_to_modes(False)
            _active.reset(self.tokens.pop())

    unpack = staticmethod(Saved.value)  # one call per tensor unpacked in backward

    def hooks(self) -> Any:
        """The call's saved-tensor hooks; around the caller's own (``save_on_cpu``), which still see
        every tensor saved."""
        outer = top_saved_tensors_hooks()
        pack, unpack = self.compose(*outer) if outer is not None and _foreign(*outer) else (self.pack, self.unpack)
        self.pushed = (pack, unpack)
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def compose(self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> tuple:
        """``(pack, unpack)`` passing each tensor to ``pack`` and ``unpack`` with copy on write around them."""

        def through_pack(tensor: torch.Tensor) -> tuple[Through, Any]:
            held = Through(tensor)
            if held.key is not None:
                self.note(held.key[1], held)
            return held, pack(tensor.detach())  # detached: see CopyOnWrite.pack

        def through_unpack(packed: tuple[Through, Any]) -> torch.Tensor:
            return packed[0].value(unpack(packed[1]))

        return through_pack, through_unpack

    def _protect(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        refs = self.saved.pop(storage_pointer(tensor), None)
        for ref in refs or ():
            held = ref()
            if held is not None:
                self.acted += 1
                held.protect()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Most torch calls write nothing: one dict lookup decides (func -> its kind, cached), then the call.
        try:
            kind = _KINDS[func]
        except (KeyError, TypeError):
            kind = _kind(func)
        if kind is _PLAIN and (not kwargs or kwargs.get("out") is None):
            return func(*args, **kwargs) if kwargs else func(*args)
        return self._handled(func, kind, args, kwargs or {})

    def _handled(self, func: Any, kind: str, args: tuple, kwargs: dict) -> Any:
        target = args[0] if args else None
        if kind == "numpy":
            if isinstance(target, torch.Tensor) and target.requires_grad:
                frame = sys._getframe(2)
                raise NotDifferentiableError(
                    f"gradpatch.differentiable: .numpy() at {frame.f_code.co_filename}:{frame.f_lineno} takes the "
                    "result out of torch, where gradients cannot follow. Differentiate the tensor before the "
                    "conversion (call the part of the sampler that returns it)")
        elif kind != _PLAIN and isinstance(target, torch.Tensor):  # a write into target: x[i] = v, x += v, x.add_(v)
            grad = torch.is_grad_enabled()
            if kind == "augmented" and target.is_leaf and target.requires_grad and grad:
                self.acted += 1
                return getattr(torch.Tensor, _AUGMENTED[func.__name__])(*args, **kwargs)  # x += v: rebinds x
            self._protect(target)
            if not grad and target.requires_grad and target._base is None \
                    and getattr(sampling_run.current.get(), "cut", False):
                self.acted += 1
                target.detach_()  # grad_steps: a state updated in place in an early step leaves the graph
        out = kwargs.get("out")
        if out is not None:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                self._protect(tensor)
        return func(*args, **kwargs)


_PLAIN = "plain"
_KINDS: dict[Any, str] = {}  # a torch function -> _PLAIN, "numpy", "augmented" or "write" (by its name)


def _kind(func: Any) -> str:
    name = getattr(func, "__name__", "")
    kind = "numpy" if name == "numpy" else "augmented" if name in _AUGMENTED else "write" \
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES) \
        else _PLAIN
    try:
        if len(_KINDS) < 4096:  # bounded: functions made on the fly would each add one
            _KINDS[func] = kind
    except TypeError:  # not hashable
        pass
    return kind


# Saved-tensor hooks that the sampler pushes during a call (its own ``save_on_cpu``) would hide the tensors
# saved under them from copy on write: while a call is active in this context, they are pushed composed
# (CopyOnWrite.compose). Python's saved_tensors_hooks push through this module attribute of torch's; the
# replacement passes every other push through unchanged.
_active: ContextVar[CopyOnWrite | None] = ContextVar("gradpatch_copy_on_write", default=None)
_install = threading.Lock()
_pushes: list[Callable[..., Any]] = []  # torch's push, once replaced


def _foreign(pack: Callable[..., Any], unpack: Callable[..., Any]) -> bool:
    """Hooks to compose with: not a checkpoint's own (torch's, whose tensors are recomputed and which
    finds its caller's hooks itself; gradpatch's)."""
    return not getattr(pack, "_checkpoint_internal", False) and \
        not str(getattr(unpack, "__module__", None) or "").startswith("gradpatch.")


def _push(pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
    cow = _active.get()
    # The call's own pair, pushed back after each unwatched evaluation, passes as it is.
    if cow is not None and (cow.pushed is None or pack is not cow.pushed[0]) and _foreign(pack, unpack):
        pack, unpack = cow.compose(pack, unpack)
    _pushes[0](pack, unpack)


def _compose_pushes() -> None:
    with _install:
        if not _pushes:
            _pushes.append(torch._C._autograd._push_saved_tensors_default_hooks)
            torch._C._autograd._push_saved_tensors_default_hooks = _push  # type: ignore[assignment]
