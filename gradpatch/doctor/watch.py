"""What the grad-flow doctor observes while a step runs, so that it reports causes, not guesses.

* **Which gradients the backward wrote.** A snapshot of each parameter's ``.grad`` (the tensor and its
  version counter) before the backward; a parameter is reached if its ``.grad`` was created, replaced
  or accumulated into, whatever the values: a gradient that is exactly zero because of a
  zero-initialised partner (LoRA's ``lora_B``, a zero output layer) is reached. Without a snapshot,
  only ``grad is None`` counts as not reached.
* **Reentrant torch checkpoints**, however they are called (the bare name, an alias, an attribute path,
  ``checkpoint_sequential``, a library's ``gradient_checkpointing_enable``): every call of
  ``torch.utils.checkpoint.CheckpointFunction.apply`` is noted with the module it checkpoints (the
  function itself, its ``__self__``, a module in its closure or ``functools.partial``, else the module
  whose ``forward`` called it) and the caller's file and line.
* **Patched samplers run with** ``cache=True`` (their default) under grad mode: their output carries
  no graph (:data:`gradpatch.sampling.options.cached_call_observers`).

Nothing is observed outside :func:`watching`; the wrapper it installs is removed on exit.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Iterator

import torch
import torch.utils.checkpoint

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass
class Reentrant:
    module: Any  # weakref to the checkpointed module, or None
    caller: Any  # weakref to the module whose forward called the checkpoint, or None
    where: str  # file:line of the call in user or library code
    inputs_require_grad: bool


@dataclass
class Watch:
    reentrant: list[Reentrant] = field(default_factory=list)
    cached: list[tuple[str, Any]] = field(default_factory=list)  # (sampler name, weakref or None)
    grads: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self, models: Any) -> None:
        """Note each parameter's ``.grad`` before a backward."""
        for model in models:
            for p in model.parameters():
                g = p.grad
                self.grads[id(p)] = (p, g, -1 if g is None else g._version)

    def missing(self, parameter: torch.Tensor) -> bool:
        """Requires grad, and the last backward wrote no gradient for it."""
        if not parameter.requires_grad:
            return False
        g = parameter.grad
        if g is None:
            return True
        before = self.grads.get(id(parameter))
        return before is not None and before[0] is parameter and before[1] is g and g._version == before[2]

    def reentrant_modules(self) -> dict[torch.nn.Module, Reentrant]:
        found: dict[torch.nn.Module, Reentrant] = {}
        for call in self.reentrant:
            module = call.module() if call.module is not None else None
            if module is not None and (module not in found or not call.inputs_require_grad):
                found[module] = call
        return found

    def cached_owners(self) -> list[tuple[str, Any]]:
        return [(name, ref() if ref is not None else None) for name, ref in self.cached]


def _module_of(function: Any) -> torch.nn.Module | None:
    seen = 0
    while seen < 4:
        seen += 1
        if isinstance(function, torch.nn.Module):
            return function
        owner = getattr(function, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return owner
        if isinstance(function, functools.partial):
            for value in (function.func, *function.args, *function.keywords.values()):
                if isinstance(value, torch.nn.Module):
                    return value
            function = function.func
            continue
        for cell in getattr(function, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, torch.nn.Module):
                return value
        return None
    return None


def _caller() -> tuple[str, torch.nn.Module | None]:
    """The first frame outside torch and this module: its ``file:line`` and its ``self`` module."""
    frame: FrameType | None = sys._getframe(1)
    where, module = "?", None
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__:
            if where == "?":
                where = f"{path}:{frame.f_lineno}"
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, torch.nn.Module):
                module = candidate
                break
        frame = frame.f_back
    return where, module


@contextlib.contextmanager
def watching() -> Iterator[Watch]:
    """Observe reentrant checkpoints and cached sampler calls for the duration."""
    from gradpatch.sampling import options

    watch = Watch()
    cls = torch.utils.checkpoint.CheckpointFunction
    had_own = "apply" in cls.__dict__
    original = cls.__dict__["apply"] if had_own else None
    inner = cls.apply  # bound to cls

    def apply(_cls: type, function: Any, preserve: Any, *args: Any) -> Any:
        where, caller = _caller()
        module = _module_of(function) or caller
        needs = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        with watch.lock:
            watch.reentrant.append(Reentrant(weakref.ref(module) if module is not None else None,
                                             weakref.ref(caller) if caller is not None else None, where, needs))
        return inner(function, preserve, *args)

    def cached(name: str, owner: Any) -> None:
        try:
            ref = weakref.ref(owner) if owner is not None else None
        except TypeError:
            ref = None
        with watch.lock:
            watch.cached.append((name, ref))

    ours: Any = classmethod(apply)
    cls.apply = ours
    options.cached_call_observers.append(cached)
    try:
        yield watch
    finally:
        options.cached_call_observers.remove(cached)
        if cls.__dict__.get("apply") is ours:
            if had_own:
                cls.apply = original
            else:
                del cls.apply
