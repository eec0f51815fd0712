"""What a code object is: whether two are the same program (:mod:`gradpatch.sampling.lifting.lift` checks that
a function's source on disk is the code that was loaded), and whether a function is torch's grad-mode
decorator wrapper (lift and :mod:`gradpatch.sampling.families.diffusers` look through it). No torch import."""
from __future__ import annotations

from types import CodeType
from typing import Any, Callable


def _instructions(code: CodeType) -> list[tuple[str, object]]:
    """The instruction stream, normalised across 3.11 micro versions (which differ in the method-call
    sequence); jump targets and exception-table blocks as positions in that stream, not offsets."""
    import dis

    kept = [ins for ins in dis.get_instructions(code)
            if ins.opname not in ("CACHE", "PRECALL", "PUSH_NULL", "EXTENDED_ARG", "NOP", "RESUME")]
    offsets = [ins.offset for ins in kept]

    def position(offset: int) -> int:  # a jump target as an index into the normalised stream
        import bisect

        return bisect.bisect_left(offsets, offset)

    out: list[tuple[str, object]] = []
    for ins in kept:
        name = "LOAD_ATTR" if ins.opname == "LOAD_METHOD" else ins.opname
        if ins.opcode in dis.hasjrel + dis.hasjabs:  # block structure: where each jump lands
            out.append((name, ("->", position(ins.argval))))
        else:
            out.append((name, None if isinstance(ins.argval, CodeType) else ins.argval))
    parse = getattr(dis, "_parse_exception_table", None)  # 3.11+: with/try blocks live here
    for entry in parse(code) if parse is not None else ():
        out.append(("EXCEPT", (position(entry.start), position(entry.end), position(entry.target), entry.depth,
                               entry.lasti)))
    return out


def same_code(a: CodeType, b: CodeType) -> bool:
    """Whether ``a`` (compiled here from the source) is the loaded ``b``: the same instructions, names,
    variables and constants, nested code objects included."""
    fields = ("co_names", "co_varnames", "co_freevars", "co_cellvars", "co_argcount", "co_posonlyargcount",
              "co_kwonlyargcount", "co_name")
    if any(getattr(a, f) != getattr(b, f) for f in fields) or len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, CodeType) or isinstance(y, CodeType):
            if not (isinstance(x, CodeType) and isinstance(y, CodeType) and same_code(x, y)):
                return False
        elif type(x) is not type(y) or (x != y and x == x):  # NaN constants compare unequal to themselves
            return False
    return _instructions(a) == _instructions(b)


def grad_mode_wrapper(fn: object) -> bool:
    """Whether ``fn`` is the wrapper torch's grad-mode decorators make (``@torch.no_grad()``,
    ``@torch.inference_mode()``): ``decorate_context`` or ``generator_context`` of torch's _contextlib.
    Recognised by file and closure, not name or identity: from torch 2.15 each wrapper's code is a copy
    renamed after its context manager (``no_grad``), for tracebacks."""
    code = getattr(fn, "__code__", None)
    return (isinstance(code, CodeType) and code.co_freevars == ("ctx_factory", "func")
            and code.co_filename.replace("\\", "/").endswith("torch/utils/_contextlib.py"))


def no_grad_body(fn: object) -> Callable[..., Any] | None:
    """The function under ``@torch.no_grad()`` if ``fn`` is exactly that decorator's wrapper, else None."""
    if not grad_mode_wrapper(fn) or not hasattr(fn, "__wrapped__"):
        return None
    import inspect

    import torch  # imported already: fn is torch's decorator wrapper
    cells = {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__)}  # type: ignore[attr-defined]
    no_grad = isinstance(getattr(cells.get("ctx_factory"), "__self__", None), torch.no_grad)  # a bound clone
    body = cells.get("func")
    # torch wraps a generator function in generator_context, anything else in decorate_context: only
    # the latter is a pipeline's no_grad __call__.
    return body if no_grad and body is fn.__wrapped__ and not inspect.isgeneratorfunction(body) else None  # type: ignore[attr-defined]
