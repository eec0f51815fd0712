"""What goes into and comes out of a :func:`gradpatch.differentiable` call: the target's code objects,
the code objects of the callables passed in (the caller's), the tensors in arguments and results,
inference tensors cloned, a result described for a message."""
from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Iterator

import torch


def codes(fn: object) -> frozenset[types.CodeType]:
    """The code objects of ``fn`` and of every function it wraps (``__wrapped__`` or closure cells)."""
    found, todo, seen = set(), [fn], set()
    while todo:
        obj = todo.pop()
        obj = getattr(obj, "__func__", obj)
        if id(obj) in seen or not callable(obj):
            continue
        seen.add(id(obj))
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType):
            found.add(code)
        todo += [getattr(obj, "__wrapped__", None)] + [c.cell_contents for c in getattr(obj, "__closure__", None) or ()
                                                        if filled(c) and isinstance(c.cell_contents, types.FunctionType)]
    return frozenset(found)


def filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def clean(out: Any) -> Any:
    """``out`` with inference tensors (also inside tuples, lists, dicts) cloned into normal tensors."""
    if isinstance(out, torch.Tensor):
        return out.clone() if out.is_inference() else out
    if isinstance(out, (tuple, list)) and any(isinstance(o, (torch.Tensor, tuple, list, dict)) for o in out):
        cleaned = [clean(o) for o in out]
        return type(out)(*cleaned) if hasattr(out, "_fields") else type(out)(cleaned)
    if isinstance(out, dict):
        return type(out)({k: clean(v) for k, v in out.items()}) if type(out) is dict else out
    return out


def tensors(obj: Any, depth: int = 0, *, modules: bool = True) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` and its tuples, lists and dicts (three levels down), and with ``modules``
    the parameters of the modules among them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif modules and isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors(item, depth + 1, modules=modules)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from tensors(item, depth + 1, modules=modules)


def describe(out: Any) -> str:
    if out is None:
        return "None (does it write its result to a file?)"
    kinds = {type(o).__module__.partition(".")[0] + "." + type(o).__name__ for o in (out if isinstance(out, (tuple, list)) else [out])}
    if any(k.startswith("numpy.") for k in kinds):
        return f"{', '.join(sorted(kinds))}: the result left torch (.cpu().numpy())"
    return f"{', '.join(sorted(kinds))} with no tensor that carries a graph (detached, or converted)"


def cut_by_callbacks(where: str, out: Any, honoured: list[str]) -> str:
    """The message for a result with no graph after grad-off blocks of code passed in were honoured."""
    return (f"gradpatch.differentiable({where}) returned {describe(out)}: grad-off blocks of code passed in as an "
            f"argument (yours: honoured, as without gradpatch) cut it, at {', '.join(honoured[:3])}. Drop that "
            "no_grad from the callback, or pass a callable whose no_grad must be lifted through "
            "gradpatch.differentiable itself")


def user_codes(values: Any, owner: Any, depth: int = 0) -> frozenset[types.CodeType]:
    """The code objects of the callables passed in ``values`` (arguments: also inside tuples, lists,
    dicts and ``functools.partial``, three levels down), through ``__wrapped__``: the caller's code
    (callbacks, ``denoised_fn``, ``cond_fn``), whose grad-off constructs a call honours. Not code: an
    ``nn.Module`` (its ``forward`` is a network, run as written), a class, torch's or gradpatch's own
    functions, the sampler object's own methods, a :func:`gradpatch.differentiable` callable (a sampler
    whose constructs its own call lifts)."""
    found: set[types.CodeType] = set()
    if depth > 3:
        return frozenset()
    if isinstance(values, (tuple, list)):
        for value in values:
            found |= user_codes(value, owner, depth + 1)
    elif isinstance(values, dict):
        for value in values.values():
            found |= user_codes(value, owner, depth + 1)
    elif isinstance(values, functools.partial):
        found |= user_codes(values.func, owner, depth) | user_codes([*values.args, *values.keywords.values()], owner, depth)
    elif callable(values) and not isinstance(values, (type, torch.nn.Module)):
        fn = values
        if inspect.ismethod(fn):
            if fn.__self__ is owner or (owner is not None and fn.__self__ is type(owner)):
                return frozenset()  # the sampler's own method
            fn = fn.__func__
        elif not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
            fn = getattr(type(fn), "__call__", None)  # a callable object: its class's __call__
        for _ in range(8):
            if fn is None or getattr(fn, "__gradpatch_differentiable__", False):
                break
            fn = getattr(fn, "__func__", fn)
            module = str(getattr(fn, "__module__", None) or "").partition(".")[0]
            code = getattr(fn, "__code__", None)
            owned = owner is not None and any(vars(k).get(getattr(fn, "__name__", "")) is fn
                                              for k in type(owner).__mro__)
            if isinstance(code, types.CodeType) and module not in ("torch", "gradpatch") and not owned:
                found.add(code)
            fn = getattr(fn, "__wrapped__", None)
    return frozenset(found)


def overriding_classes(values: Any, depth: int = 0) -> frozenset[type]:
    """The classes (in the MRO of every module in ``values``, its submodules included, and in tuples,
    lists and dicts three levels down) that define their own ``train`` or ``eval``: a LoRA layer's
    ``train()`` merges or unmerges weights, so the sampler's ``eval()`` must not reach it."""
    if isinstance(values, torch.nn.Module):
        # Most modules' classes define neither: two cached class lookups tell, before a walk of the MRO.
        train, eval_ = torch.nn.Module.train, torch.nn.Module.eval
        return frozenset(k for m in values.modules() if type(m).train is not train or type(m).eval is not eval_
                         for k in type(m).__mro__
                         if k is not torch.nn.Module and ("train" in vars(k) or "eval" in vars(k)))
    found: frozenset[type] = frozenset()
    if depth < 3 and isinstance(values, (tuple, list)):
        for value in values:
            found |= overriding_classes(value, depth + 1)
    elif depth < 3 and isinstance(values, dict):
        for value in values.values():
            found |= overriding_classes(value, depth + 1)
    return found
