"""The inputs of a checkpointed denoiser evaluation as they were in its forward (``checkpoint_steps``).

A checkpointed evaluation is recomputed in backward, after the sampler went on. Samplers written for
``no_grad`` refill their buffers in place (CFG batches: ``x_in[:B] = x``); a buffer the step reads
is then, in backward, the last step's. The fast path's node saves the step's tensor arguments (torch
checks their versions), but not tensors inside a dict, a list, a tuple or a dataclass passed to the
step, tensor attributes of the modules it reaches (``self.cond = buf``), buffers of their submodules,
or tensor attributes of the objects whose method it is; torch's checkpoint does not either.

:class:`AsWas` notes those tensors (and the step's tensor arguments, for the per-tensor path, which
holds them by reference) when the forward returns: their versions and, where the call has copy on
write (:func:`gradpatch.differentiable`: :mod:`gradpatch.sampling.generic.copy_on_write`), a hold that keeps a copy
if the sampler writes into one afterwards. A recompute finds what changed since (another version, an
attribute reassigned) and runs on the values of the forward: containers are rebuilt around the copies,
attributes set to them for the duration of the recompute. Without copy on write (a sampler fix without
``differentiable``), a tensor written in place after the forward makes the recompute raise, naming it:
it cannot be restored. Nothing changed (the usual case): the recompute runs on the arguments as given.
What the forward itself writes or reassigns (a KV cache it fills) is left to it, as torch's checkpoint
leaves it: its recompute writes it again. The submodules holding buffers are found at a call's first
evaluation (a buffer registered on a module that had none, during the call, is not seen).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

_ATOMS = (str, bytes, int, float, bool, complex, type, type(None), torch.dtype, torch.device)
_LEAVES = (torch.Tensor, *_ATOMS)  # what pytree leaves as it is


class _Held:
    """One tensor the step reached, where (``holder``, ``key``, ``kind``), and how it was."""

    __slots__ = ("tensor", "version", "requires_grad", "kept", "holder", "key", "kind")

    def __init__(self, holder: Any, key: Any, kind: str, tensor: torch.Tensor) -> None:
        self.tensor, self.version, self.requires_grad = tensor, tensor._version, tensor.requires_grad
        self.holder, self.key, self.kind, self.kept = holder, key, kind, None

    @property
    def where(self) -> str:
        if self.kind == "arg":
            return "a tensor passed to the step"
        if self.kind == "cell":
            return f"a tensor closed over by the step ({self.key!r})"
        return f"{'buffer' if self.kind == 'buffer' else 'attribute'} {self.key!r} of a {type(self.holder).__name__}"

    def current(self) -> Any:
        if self.kind == "buffer":
            return self.holder._buffers.get(self.key)
        if self.kind == "cell":
            return self.holder.cell_contents
        return getattr(self.holder, self.key, None) if self.kind in ("attr", "field") else self.tensor

    def changed(self) -> bool:
        return self.tensor._version != self.version or self.current() is not self.tensor

    def value(self) -> torch.Tensor:
        """The tensor as the forward read it (a detached copy with its ``requires_grad`` where it was
        written since), or raise where that cannot be had."""
        tensor = self.tensor
        if tensor._version == self.version:
            return tensor  # an attribute reassigned: the forward's tensor is still as it was
        if self.kept is None:
            raise RuntimeError(
                f"checkpoint_steps: {self.where}, which a checkpointed denoiser evaluation read, was modified in "
                f"place after that evaluation (version {self.version}, now {tensor._version}); its recompute in "
                "backward would read the new values. Fill a new tensor per step instead of writing into this "
                "one, sample through gradpatch.differentiable (copy on write), or use checkpoint_steps=False")
        if self.requires_grad and tensor.is_leaf:
            raise RuntimeError(f"checkpoint_steps: {self.where} requires grad and was modified in place after a "
                               "checkpointed denoiser evaluation read it; its gradient cannot be recomputed. Use "
                               "checkpoint_steps=False")
        return self.kept.value().detach().requires_grad_(self.requires_grad)


class AsWas:
    """``fn`` whose calls after :meth:`mark` (the recomputes) see what the forward saw (module docstring).
    What the step reaches is found before the forward, and kept if the forward left it as it was."""

    __slots__ = ("fn", "keep", "held", "marked", "known", "__weakref__")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict,
                 keep: Callable[[torch.Tensor], Any] | None, known: dict[Any, tuple[Any, list]]) -> None:
        self.fn, self.keep, self.marked = fn, keep, False
        self.known = known  # the call's notes, shared with steps.generators
        found: dict[tuple[int, int, Any], _Held] = {}
        for holder, key, kind, tensor in _reached(fn, args, kwargs, known):
            found.setdefault((id(holder), id(tensor), key), _Held(holder, key, kind, tensor))
        self.held = list(found.values())

    def mark(self) -> None:
        """The forward is over: from now on, calls are recomputes."""
        self.held = [h for h in self.held if not h.changed()]
        if self.keep is not None:
            for h in self.held:
                h.kept = self.keep(h.tensor)
        self.marked = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        changed = [h for h in self.held if h.changed()] if self.marked else None
        if not changed:
            return self.fn(*args, **kwargs)
        given = {id(v) for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)}
        values = {id(h.tensor): h.value() for h in changed if h.kind == "arg" and id(h.tensor) in given}
        swaps = [(h, h.value()) for h in changed if h.kind != "arg"]
        if values:
            args, kwargs = tree_map(lambda v: values.get(id(v), v) if isinstance(v, torch.Tensor) else v,
                                    (args, kwargs))
        now = [(h, h.current()) for h, _ in swaps]
        try:
            for h, value in swaps:
                _set(h, value)
            return self.fn(*args, **kwargs)
        finally:
            for h, value in reversed(now):
                _set(h, value)


def _set(h: _Held, value: Any) -> None:
    if h.kind == "buffer":
        h.holder._buffers[h.key] = value
    elif h.kind == "cell":
        h.holder.cell_contents = value
    else:  # an attribute, or a dataclass field
        object.__setattr__(h.holder, h.key, value)


def _reached(fn: Callable[..., Any], args: tuple, kwargs: dict,
             known: dict[int, tuple[Any, list]]) -> Iterator[tuple[Any, Any, str, torch.Tensor]]:
    """``(holder, key, kind, tensor)`` for each tensor the step can read: in its arguments (``kind``
    "arg", containers walked with pytree), fields of dataclasses among them ("field"), tensor attributes
    ("attr") of the modules and objects reached from the arguments and from ``fn`` (bound methods,
    partials, closures), buffers of those modules and of their submodules ("buffer"), closed-over tensors
    ("cell"). ``known``: per module, its submodules holding buffers (found once per ``cache=False`` call)."""
    objects: list[tuple[Any, int]] = []
    flat = not kwargs and all(isinstance(a, _LEAVES) for a in args)
    leaves = args if flat else tree_flatten((args, kwargs))[0]  # pytree: 8 us a call
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            yield None, i, "arg", leaf
        elif not isinstance(leaf, _ATOMS):
            objects.append((leaf, 0))
    objects.append((fn, 0))
    seen: set[int] = set()
    while objects:
        obj, depth = objects.pop()
        if id(obj) in seen or depth > 5 or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for key, value in vars(obj).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                    yield obj, key, "attr", value
            entry = known.get(id(obj))
            if entry is None or entry[0] is not obj:
                entry = known[id(obj)] = (obj, [m for m in obj.modules() if m._buffers])
            for module in entry[1]:
                for key, tensor in module._buffers.items():
                    if tensor is not None:
                        yield module, key, "buffer", tensor
        elif isinstance(obj, functools.partial):
            objects += [(obj.func, depth + 1), *((v, depth + 1) for v in (*obj.args, *obj.keywords.values()))]
        elif hasattr(obj, "__self__") and hasattr(obj, "__func__"):  # a bound method
            objects += [(obj.__self__, depth + 1), (obj.__func__, depth + 1)]
        elif callable(obj) and hasattr(obj, "__code__"):  # a function: what it closes over
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(value, torch.Tensor):
                    yield cell, name, "cell", value
                elif callable(value) or isinstance(value, torch.nn.Module):
                    objects.append((value, depth + 1))
        elif hasattr(obj, "fn") and type(obj).__module__.startswith("gradpatch."):  # a wrapper of gradpatch's
            objects.append((getattr(obj, "fn"), depth + 1))
        elif dataclasses.is_dataclass(obj) or (hasattr(obj, "__dict__")
                                               and not type(obj).__module__.startswith("gradpatch.")):
            field = dataclasses.is_dataclass(obj)
            items = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)] if field else \
                list(vars(obj).items())
            for key, value in items:
                if isinstance(value, torch.Tensor):
                    yield obj, key, "field" if field else "attr", value
                elif isinstance(value, torch.nn.Module) or (field and not isinstance(value, _ATOMS)):
                    objects.append((value, depth + 1))
