"""Which checkpointed calls a sharding engine manages from inside, for the checkpoint fix.

FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``) and DeepSpeed ZeRO-3 gather a module's
parameters in hooks around that module's own forward, release them after it, and tie their backward
work (gathering again, reducing the gradients, releasing) to hooks and nodes on the graph that forward
builds. A module they manage *inside* a checkpointed call therefore needs its backward to run through
the graph its forward built, in order: the fast path (:mod:`gradpatch.checkpointing.recompute`) drops that
graph and produces the gradients later, in its own node's backward, after the engine has reduced
(FSDP2: reduce-scatter ran before the recompute, leaving gradients missing and stale) or while the
parameters are released (ZeRO-3: a full-size gradient for an empty partition). Such a call takes the
graph path, torch's non-reentrant checkpoint, whose recompute runs inside the autograd graph through
saved-tensor hooks, so the engine's hooks fire as they do without checkpointing; it runs with the
parameters the engine puts in place at that moment (no rebinding to the forward's tensors, which the
engine has since released or replaced).

A call on a module that is itself an engine's unit (``fully_shard`` on the block whose method is
checkpointed) stays on the fast path: its parameters are gathered before its forward calls the
checkpoint and again, the same tensors, before its backward, and its gradients reach them before the
engine's post-backward hook runs. DDP, ZeRO-1/2 and FSDP1 units wrapping the block from outside do not
change the parameters inside the call (FSDP1's views of its flat parameter already send the call to the
graph path, as any non-leaf parameter does).

**Where modules are looked for** (:class:`Search`): everything the call is given and everything its
function holds: a bound method's module (its submodules, and the lists, tuples and dicts it keeps as
plain attributes itself), a ``functools.partial``'s function, arguments and keywords, closure cells, default
arguments, the call's own arguments, the module-level globals the function's code names (and, through
them, the functions and objects defined outside torch, gradpatch and the standard library), lists,
tuples, sets and dicts at any depth, and the attributes of other objects (a sampler's wrapper holding
its model, a ``SimpleNamespace``; not torch's own). A
module found other than as a method's owner counts itself too: calling it runs its own hooks inside
the call. Where the search cannot finish (over :data:`LIMIT` objects), the call takes the graph path:
the fast path gets no call it could not vet. Not seen: modules reached only through globals that a
submodule's own ``forward`` reads.

Cost: nothing unless ``torch.distributed`` has a process group and FSDP or DeepSpeed is imported; then
one search at each call (tens of microseconds for AudioLDM's BasicTransformerBlock, 24 modules, on
CPU), not cached, so that an engine applied after a first forward is seen.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

import torch

__all__ = ["sharded_inside", "modules_of", "engine_loaded", "Search", "LIMIT"]

#: Most objects one search visits; beyond, the call is taken as managed (the graph path).
LIMIT = 4000

_ENGINE_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp", "deepspeed")
#: Functions of these top-level packages, named by a global, are not searched (they hold no user model).
_LIBRARIES = frozenset({"torch", "gradpatch", "einops", "numpy", "typing", "typing_extensions"}
                       | set(getattr(sys, "stdlib_module_names", ())))
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, type, types.ModuleType,
          types.BuiltinFunctionType, types.BuiltinMethodType, torch.dtype, torch.device)
_MODULE_STATE = frozenset(torch.nn.Module().__dict__)  # what every module holds: searched otherwise
_NAMES: dict[types.CodeType, tuple[str, ...]] = {}  # global names a code object (and those nested) reads


def sharded_inside(func: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> str | None:
    """The engine managing a module or parameter that ``func(*args, **kwargs)`` reaches (a description
    such as ``"FSDP2 (fully_shard) on attn1"``), a description of why the search could not tell, or
    ``None``: no process group, no engine imported, or nothing managed found."""
    if not engine_loaded():
        return None
    return Search(_fsdp_classes(), "deepspeed" in sys.modules).call(func, args, kwargs)


def engine_loaded() -> bool:
    """Whether a sharding engine could be managing modules anywhere: a process group, and FSDP or
    DeepSpeed imported. For calls whose modules cannot be searched (a sampler's denoiser, reached
    through objects the sampler step builds)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return any(name in sys.modules for name in _ENGINE_MODULES)


def modules_of(func: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> list[torch.nn.Module]:
    """The modules the call reaches (see :class:`Search`), in the order found."""
    search = Search((), False)
    search.call(func, args, kwargs)
    return search.found


class Search:
    """One search of a call for modules an engine manages: ``units`` are the engines' module classes
    (FSDP2, FSDP1), ``zero3`` whether to look for ZeRO-3's marked parameters (``ds_id``)."""

    def __init__(self, units: tuple[type, ...], zero3: bool) -> None:
        self.units, self.zero3 = units, zero3
        self.seen: set[int] = set()
        self.found: list[torch.nn.Module] = []
        self.in_globals = False  # searching what a function's globals hold: library objects skipped

    def call(self, func: Callable[..., Any], args: tuple, kwargs: dict | None) -> str | None:
        owner = getattr(func, "__self__", None)
        try:
            if isinstance(owner, torch.nn.Module) and hasattr(func, "__func__"):
                hit = self.module(owner, itself=False) or self.value(func.__func__)  # ``self._forward``
            elif isinstance(func, (torch.nn.Module, functools.partial, types.FunctionType, types.MethodType)):
                hit = self.value(func)
            else:  # a callable object of any kind: what it holds
                self._visit(func)
                hit = self.value(dict(getattr(func, "__dict__", None) or {}))
            return hit or self.value(args) or self.value(kwargs)
        except (_TooMany, RecursionError):
            return (f"a sharding engine is loaded and the call reaches more than {LIMIT} objects: "
                    "taken as managed")

    def module(self, top: torch.nn.Module, itself: bool) -> str | None:
        """``top``'s tree (``top`` itself only if ``itself``): a unit, or a ZeRO-3 parameter."""
        if itself and self.units and isinstance(top, self.units):
            return self._unit(top, top)
        stack = [top]
        while stack:  # flat, no names: under 1 us a module; names only for a hit
            module = stack.pop()
            if id(module) in self.seen:
                continue
            self._visit(module)
            self.found.append(module)
            if self.units and module is not top and isinstance(module, self.units):
                return self._unit(top, module)
            if self.zero3:
                for p in module._parameters.values():
                    if p is not None and "ds_id" in p.__dict__:
                        return f"DeepSpeed ZeRO-3 on {_name(top, module) or type(top).__name__}"
            if module is top:  # the plain lists and dicts of modules it keeps
                for key, value in module.__dict__.items():
                    if type(value) in (list, tuple, dict) and key not in _MODULE_STATE and \
                            (hit := self.value(value)):
                        return hit
            stack += [child for child in module._modules.values() if child is not None]
        return None

    def _unit(self, top: torch.nn.Module, module: torch.nn.Module) -> str:
        engine = next(label for cls, label in _FSDP_LABELS if isinstance(module, cls))
        return f"{engine} on {_name(top, module) or type(module).__name__}"

    def value(self, obj: Any) -> str | None:
        if isinstance(obj, _PLAIN) or id(obj) in self.seen:
            return None
        if isinstance(obj, torch.nn.Module):
            return self.module(obj, itself=True)
        self._visit(obj)
        if isinstance(obj, (list, tuple, set, frozenset)):
            return next((hit for v in obj if (hit := self.value(v))), None)
        if isinstance(obj, dict):
            return next((hit for v in obj.values() if (hit := self.value(v))), None)
        if isinstance(obj, functools.partial):
            return self.value(obj.func) or self.value(obj.args) or self.value(obj.keywords)
        if isinstance(obj, types.MethodType):
            owner = obj.__self__
            if isinstance(owner, torch.nn.Module):  # its forward called directly: no hooks of its own
                return self.module(owner, itself=False) or self.value(obj.__func__)
            return self.value(owner) or self.value(obj.__func__)
        if isinstance(obj, types.FunctionType):
            return self.function(obj)
        attributes = getattr(obj, "__dict__", None)  # another object: what it holds (not torch's; from
        if not isinstance(attributes, dict) or _library(type(obj), self.in_globals):  # globals, not
            return None  # a library's either: a global logger or cache leads everywhere)
        return self.value(dict(attributes))

    def function(self, func: types.FunctionType) -> str | None:
        cells = []
        for cell in func.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        hit = self.value(cells) or self.value(func.__defaults__) or self.value(func.__kwdefaults__)
        if hit:
            return hit
        scope, outer = func.__globals__, self.in_globals
        self.in_globals = True
        try:
            for name in _global_names(func.__code__):
                value = scope.get(name)
                if value is None or isinstance(value, _PLAIN):
                    continue
                if isinstance(value, types.FunctionType) and _library(value, True):
                    continue
                if hit := self.value(value):
                    return hit
            return None
        finally:
            self.in_globals = outer

    def _visit(self, obj: Any) -> None:
        self.seen.add(id(obj))
        if len(self.seen) > LIMIT:
            raise _TooMany


class _TooMany(Exception):
    pass


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    names = _NAMES.get(code)
    if names is None:
        found: set[str] = set()
        stack = [code]
        while stack:
            c = stack.pop()
            found.update(c.co_names)
            stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        names = _NAMES[code] = tuple(sorted(found))
    return names


def _library(obj: Any, any_library: bool) -> bool:
    """Whether a function or class comes from torch, or (``any_library``) from any of :data:`_LIBRARIES`."""
    package = (getattr(obj, "__module__", None) or "").partition(".")[0]
    return package in _LIBRARIES if any_library else package == "torch"


def _name(owner: torch.nn.Module, module: torch.nn.Module) -> str:
    return next((n for n, m in owner.named_modules() if m is module), "")


def _fsdp_classes() -> tuple[type, ...]:
    """FSDP2's ``FSDPModule`` and FSDP1's ``FullyShardedDataParallel``, those this torch has, from the
    modules already imported: a unit exists only once its engine's module was imported."""
    key = tuple(name in sys.modules for name in _ENGINE_MODULES[:2])
    if key != _LOADED[0]:
        _LOADED[0] = key
        _FSDP_LABELS[:] = _classes()
    return tuple(cls for cls, _ in _FSDP_LABELS)


def _classes() -> list[tuple[type, str]]:
    found: list[tuple[type, str]] = []
    for name in _ENGINE_MODULES[:2]:
        module = sys.modules.get(name)
        fsdp2 = getattr(module, "FSDPModule", None)
        if fsdp2 is not None and all(fsdp2 is not c for c, _ in found):
            found.append((fsdp2, "FSDP2 (fully_shard)"))
    fsdp1 = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    if fsdp1 is not None:
        found.append((fsdp1, "FSDP1 (FullyShardedDataParallel)"))
    return found


_LOADED: list[Any] = [None]
_FSDP_LABELS: list[tuple[type, str]] = []  # filled by _fsdp_classes
