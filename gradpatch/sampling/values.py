"""What goes into and comes out of a :func:`gradpatch.differentiable` call: the target's code objects,
the tensors in arguments and results, inference tensors cloned, a result described for a message."""
from __future__ import annotations

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
