"""The callables :func:`gradpatch.differentiable` returns (:func:`make`, :class:`Differentiable`) and the
fix of a string target (:func:`patched`): each one :func:`~gradpatch.sampling.contract.sampler_entry`
whose ``cache=False`` call is :func:`gradpatch.sampling.generic.call.call`, kept away from
``torch.compile`` (the call's machinery cannot be traced; the network it runs can be compiled).
"""
from __future__ import annotations

import copy
import functools
import inspect
import sys
import types
from typing import Any, Callable, cast

import torch

from gradpatch.checkpointing.compat import is_compiling
from gradpatch.sampling import contract
from gradpatch.sampling.contract import sampler_entry
from gradpatch.sampling.generic import gradoff
from gradpatch.sampling.generic.call import FAMILY, Sampler, call
from gradpatch.sampling.options import SamplingOptions
from gradpatch.sampling.run import SamplingRun


_COMPILE = ("a gradpatch.differentiable call with cache=False cannot be traced by torch.compile (context variables, "
            "a TorchFunctionMode, frame inspection): compile the denoiser or the step module instead (the call runs "
            "them as they are), or compile without fullgraph=True (the call then runs eagerly, a graph break)")
_DISABLED: list[Callable[..., Any]] = []
_MACHINERY = frozenset({__file__, contract.__file__})  # the frames between a callable and its caller


def _caller_frame() -> Any:
    """The frame that called the differentiable callable: the first outside this module and the contract."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _MACHINERY:
        frame = frame.f_back
    return frame


def _through(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


# torch < 2.6: torch.compiler.disable takes no reason (read once: 40 us, and callables are made at import time)
_NO_REASON = "reason" not in inspect.signature(torch.compiler.disable).parameters


def _disable_ahead() -> None:
    """Where ``torch.compiler.disable`` takes no reason (torch < 2.6), make the untraced runner when a
    callable is made, not at its first eager call: torch 2.1's dynamo, tracing a first call, splits
    :func:`_eager` at its ``raise`` and runs the rest, the ``raise`` included, even without
    ``fullgraph=True``."""
    if _NO_REASON and not _DISABLED and not is_compiling():
        _DISABLED.append(torch.compiler.disable(_through))


def _eager(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, never traced: dynamo skips it (under ``fullgraph=True`` its error says
    :data:`_COMPILE`)."""
    if not _DISABLED and "torch._dynamo" in sys.modules and not is_compiling():
        try:
            _DISABLED.append(torch.compiler.disable(_through, reason=_COMPILE))
        except TypeError:  # torch < 2.6: no reason= (the graph break then names no reason)
            _DISABLED.append(torch.compiler.disable(_through))
    if _DISABLED:  # torch < 2.6 names this line under fullgraph=True, not the reason: the line says it
        return _DISABLED[0](fn, args, kwargs)  # untraceable: compile the denoiser or the step module instead
    if is_compiling():  # dynamo runs the frames up to here eagerly instead, or shows this under fullgraph=True
        raise RuntimeError(_COMPILE)
    return fn(*args, **kwargs)


def make(fn: Callable[..., Any], step: Any = None, steps: Any = None, *, cache: bool = False,
         where: str | None = None) -> Callable[..., Any]:
    """``fn`` (a function or a bound method) taking ``cache`` (default ``cache``), ``grad_steps`` and
    ``checkpoint_steps``."""
    return Differentiable(fn, step, steps, cache, where)


class Differentiable:
    """What :func:`make` returns. As a class attribute it binds like ``fn`` (a plain function), and its
    first argument is then the sampler's object even when a decorator's signature does not call it
    ``self`` (imagen's ``eval_decorator``: ``inner(model, *args, **kwargs)``). It copies and pickles like
    the bound method it wraps: a deep copy of an object holding ``differentiable(self.sample)`` (an EMA
    copy) holds one bound to the copy (``step`` through the same memo); pickle, dill and cloudpickle
    rebuild it from ``fn`` and the options, or by name where the string form installed it."""

    __qualname__: str  # fn's, set by functools.update_wrapper

    def __init__(self, fn: Callable[..., Any], step: Any = None, steps: Any = None, cache: bool = False,
                 where: str | None = None) -> None:
        _disable_ahead()
        functools.update_wrapper(self, fn)
        where = where or cast(str, getattr(fn, "__qualname__", repr(fn)))
        self._made = (fn, step, steps, cache, where)
        self._owner = owner = getattr(fn, "__self__", None)
        sampler = Sampler(fn, step, steps, where)
        sampler.user = not cache

        def this_of(args: tuple) -> Any:
            if owner is not None:
                return owner
            named_self = "self" in (sampler.signature.parameters if sampler.signature else ())
            return args[0] if args and (named_self or _method_of(self, args[0])) else None

        def run(state: SamplingRun, outer: SamplingRun | None, args: tuple, kwargs: dict) -> Any:
            if outer is not None:
                same = outer.family_state if outer.family == FAMILY else None
                routed = same is not None and same.sampler.step is not None  # the outer call counts steps
                if same is not None and (sampler.step is None or routed) and \
                        gradoff.in_sampler(_caller_frame(), same.live):
                    return fn(*args, **kwargs)  # the outer call's steps and inert constructs hold (contract, 3)
                if sampler.step is None:
                    state.options = SamplingOptions()  # the outer sampler knows its steps: only lift constructs
            return call(sampler, fn, args, kwargs, this_of(args), state)

        self._entry = sampler_entry(fn, run, family=FAMILY, describe=lambda args: f"gradpatch.differentiable({where})",
                                    default_cache=cache, owner=lambda args, kwargs: this_of(args) if args else owner,
                                    expected="step was never called")
        if hasattr(self._entry, "__signature__"):
            self.__signature__ = self._entry.__signature__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _eager(self._entry, *args, **kwargs)

    __gradpatch_differentiable__ = True  # a callable passed into another call lifts its own constructs

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)

    def __deepcopy__(self, memo: dict) -> Any:
        fn, step, steps, cache, where = self._made
        if self._owner is None:
            return self  # a function is its own copy (copy.deepcopy's rule)
        return type(self)(copy.deepcopy(fn, memo), copy.deepcopy(step, memo), steps, cache, where)

    def __reduce__(self) -> Any:
        name, found = self.__qualname__, sys.modules.get(self.__module__)
        for part in name.split("."):
            found = getattr(found, part, None)
        return name if found is self else (type(self), self._made)

    def __repr__(self) -> str:
        return f"<gradpatch.differentiable {self._made[4]}>"


def _method_of(function: Any, obj: Any) -> bool:
    """Whether ``function`` is an attribute of ``obj``'s class (called as ``obj.method(...)``)."""
    return any(any(value is function for value in vars(k).values()) for k in type(obj).__mro__)


def patched(original: Any, step: Any = None, steps: Any = None, *, where: str = "") -> Any:
    """Fix factory body for a string target: ``original`` as found in its owner's ``__dict__``
    (function, staticmethod, classmethod), ``cache=True`` by default. A new object per call."""
    if isinstance(original, (staticmethod, classmethod)):
        return type(original)(make(original.__func__, step, steps, cache=True, where=where))
    if not callable(original):
        raise TypeError(f"gradpatch.differentiable({where}): {original!r} is not callable")
    return make(original, step, steps, cache=True, where=where)
