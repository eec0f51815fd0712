"""Lifting an in-body ``with torch.no_grad():`` out of a function, without touching its file.

Some upstream functions cut the graph inside their body rather than with a decorator::

    def decode_first_stage(self, z):
        with torch.no_grad():
            z = 1.0 / self.scale_factor * z
            decoding = self.first_stage_model.decode(z)
        return decoding

Unwrapping cannot help there. :func:`lift_no_grad` compiles an in-memory copy of such a function with
every ``with torch.no_grad():`` and ``with torch.inference_mode():`` removed and its body kept (a
``with`` holding other context managers too keeps those). The copy has the original's globals (the
same dict, so later rebinding is seen), closure cells (matched by name), defaults, keyword defaults,
name, qualname, module, docstring, annotations and ``__dict__``; tracebacks point at the original
file and lines. Decorators are not re-applied: the copy is the bare body, for ``cache=False`` calls
only; the original object stays where it was.

Trust. The source comes from the function's code object (``inspect.getsource`` on the unwrapped
function, i.e. the file and first line the code records), and is used only if compiling it unchanged
gives back the loaded code: the same instructions, names, variables and constants, jump targets
and exception-table blocks (so an edit of indentation alone is seen), nested code objects included
(the method-call sequence, which differs between 3.11 micro releases, is normalised). Only torch's
grad-mode decorators are looked through: a ``functools.wraps`` wrapper someone installed is code of
its own, recognised (and left alone) as such. The copy is cached per function (each closure of a
factory keeps its own cells and defaults); the compiled code per code object. ``with`` blocks inside
functions, lambdas and classes defined in the body are left as they are. A file edited after import and a ``.pyc`` without its source are refused. :class:`Liftable`, a recogniser for
:class:`gradpatch.patching.patch.Patch`, fingerprints that same source (the hash
``python -m gradpatch.patching.fingerprint FILE Class.method`` prints) and reports anything else as unknown
code, so the engine skips it with an :class:`~gradpatch.errors.UnknownCodeWarning` and records it like
every other patch. Grad-mode managers are recognised through the module's imports (``torch.no_grad``,
``th.no_grad``, ``from torch import no_grad``; ``torch.inference_mode()`` or ``(True)``); calls of
``torch.set_grad_enabled(False)`` and managers held in variables are left in place (the fingerprint
says what the body contains, so a target relying on those is not declared liftable).

No torch import here: the catalogue imports this module at start-up for :class:`Liftable`.
"""
from __future__ import annotations

import ast
import copy
import sys
from types import CodeType, FunctionType, ModuleType
from typing import Any, Callable, Mapping, NamedTuple

from gradpatch.patching.fingerprint import Identity, fingerprint_source
from gradpatch.sampling.lifting.bytecode import grad_mode_wrapper, same_code

GRAD_OFF = frozenset({"torch.no_grad", "torch.autograd.no_grad", "torch.autograd.grad_mode.no_grad",
                      "torch.inference_mode", "torch.autograd.inference_mode",
                      "torch.autograd.grad_mode.inference_mode"})
"""Dotted names (after import aliases are resolved) of the context managers :func:`lift_no_grad` removes."""

_OUTER = "__gradpatch_lift__"
_FUTURE_FLAGS = 0
for _feature in __import__("__future__").all_feature_names:  # the original's `from __future__` imports
    _FUTURE_FLAGS |= getattr(__import__("__future__"), _feature).compiler_flag


class LiftError(ValueError):
    """The function cannot be lifted: no source, source that is not the loaded code, nothing to lift."""


class _Parsed(NamedTuple):
    raw: FunctionType
    node: ast.FunctionDef | ast.AsyncFunctionDef  # line numbers as in the original file
    imports: str  # the module's top-level import statements, for aliases
    aliases: dict[str, str]


# Keyed by the code object's identity (code objects compare equal by content across files); the
# values hold the code object, so an id is never reused while its entry exists.
_parsed: dict[int, _Parsed] = {}
_lifted_code: dict[int, CodeType] = {}  # by the original's code (kept alive by _parsed)
_lifted: dict[int, tuple[FunctionType, FunctionType]] = {}  # by function: its cells and defaults


def _unwrap(fn: object) -> FunctionType:
    """The function ``fn`` runs, looking through torch's grad-mode decorators only: anyone else's
    ``functools.wraps`` wrapper is code of its own (looking through it would drop it)."""
    raw = getattr(fn, "__func__", fn)  # staticmethod, classmethod, bound method
    while grad_mode_wrapper(raw) and hasattr(raw, "__wrapped__"):
        raw = raw.__wrapped__  # type: ignore[union-attr]
    if not isinstance(raw, FunctionType):
        raise LiftError(f"{fn!r} is not a Python function")
    return raw


def _module_imports(raw: FunctionType) -> tuple[str, dict[str, str]]:
    import inspect

    module = sys.modules.get(raw.__module__ or "")
    if not isinstance(module, ModuleType):
        return "", {}
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return "", {}
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    aliases: dict[str, str] = {}
    for node in imports:
        for alias in node.names:
            if isinstance(node, ast.Import):
                aliases[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname \
                    else alias.name.partition(".")[0]
            else:
                aliases[alias.asname or alias.name] = f"{'.' * node.level}{node.module or ''}.{alias.name}"
    return "\n".join(ast.unparse(node) for node in imports), aliases


def _parse(fn: object) -> _Parsed:
    import inspect

    raw = _unwrap(fn)
    if id(raw.__code__) in _parsed:
        return _parsed[id(raw.__code__)]
    try:
        lines, first = inspect.getsourcelines(raw)
    except (OSError, TypeError) as missing:
        raise LiftError(f"no source for {raw.__qualname__}: {missing}") from None
    text = "".join(lines)
    indented = text[:1].isspace()
    try:  # an indented method parses inside a dummy block; docstring lines may be indented less
        tree = ast.parse("if 1:\n" + text if indented else text)
    except SyntaxError as error:
        raise LiftError(f"the source of {raw.__qualname__} does not parse: {error}") from None
    node = tree.body[0].body[0] if indented else tree.body[0]  # type: ignore[attr-defined]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != raw.__name__:
        raise LiftError(f"the source found for {raw.__qualname__} is not its definition")
    ast.increment_lineno(node, first - (2 if indented else 1))
    imports, aliases = _module_imports(raw)
    parsed = _Parsed(raw, node, imports, aliases)
    if not same_code(_compile(parsed, node), raw.__code__):
        raise LiftError(f"the source of {raw.__qualname__} in {raw.__code__.co_filename} is not the code "
                        "that was loaded (edited since import?)")
    _parsed[id(raw.__code__)] = parsed
    return parsed


def _compile(parsed: _Parsed, node: ast.FunctionDef | ast.AsyncFunctionDef) -> CodeType:
    """Compile ``node`` (decorators dropped) inside a function that defines its free variables, so
    they compile as free variables (``__class__`` for zero-argument ``super()`` too); return its code."""
    raw = parsed.raw
    copy = type(node)(**{**{f: getattr(node, f) for f in node._fields}, "decorator_list": []})
    ast.copy_location(copy, node)
    cells = [ast.Assign(targets=[ast.Name(name, ast.Store())], value=ast.Constant(None))
             for name in raw.__code__.co_freevars]
    outer = ast.FunctionDef(name=_OUTER, args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[],
                                                              kw_defaults=[], defaults=[]),
                            body=[*cells, copy, ast.Return(ast.Name(node.name, ast.Load()))], decorator_list=[])
    module = ast.Module(body=[outer], type_ignores=[])
    for extra in (outer, *[n for cell in cells for n in ast.walk(cell)], *ast.walk(outer.body[-1])):
        extra.lineno, extra.col_offset = node.lineno, 0  # type: ignore[attr-defined]
        extra.end_lineno, extra.end_col_offset = node.end_lineno, 0  # type: ignore[attr-defined]
    ast.fix_missing_locations(module)
    code = compile(module, raw.__code__.co_filename, "exec", flags=raw.__code__.co_flags & _FUTURE_FLAGS,
                   dont_inherit=True)
    outer_code = next(c for c in code.co_consts if isinstance(c, CodeType) and c.co_name == _OUTER)
    return next(c for c in outer_code.co_consts if isinstance(c, CodeType) and c.co_name == node.name)


def _dotted(expr: ast.expr, aliases: Mapping[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(aliases.get(expr.id, expr.id))
    return ".".join(reversed(parts))


def _grad_off(item: ast.withitem, aliases: Mapping[str, str]) -> bool:
    call = item.context_expr
    if item.optional_vars is not None or not isinstance(call, ast.Call) or call.keywords:
        return False
    name = _dotted(call.func, aliases)
    if name not in GRAD_OFF:
        return False
    if "inference_mode" in name:  # inference_mode(False) would not cut the graph: not a target
        return not call.args or (len(call.args) == 1 and isinstance(call.args[0], ast.Constant)
                                 and call.args[0].value is True)
    return not call.args


class _Lifter(ast.NodeTransformer):
    """Removes the grad-off ``with`` items of the function it visits first, not those of functions,
    lambdas or classes defined inside it (a nested helper's ``no_grad`` is its own business)."""

    def __init__(self, aliases: Mapping[str, str]) -> None:
        self.aliases, self.removed, self.entered = aliases, 0, False

    def visit_FunctionDef(self, node: Any) -> Any:
        if self.entered:
            return node
        self.entered = True
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> Any:
        return node

    def visit_Lambda(self, node: ast.Lambda) -> Any:
        return node

    def visit_With(self, node: ast.With) -> Any:
        self.generic_visit(node)
        kept = [item for item in node.items if not _grad_off(item, self.aliases)]
        self.removed += len(node.items) - len(kept)
        if len(kept) == len(node.items):
            return node
        if kept:
            node.items = kept
            return node
        return node.body  # spliced into the enclosing block


def function_fingerprint(fn: object) -> str:
    """The fingerprint of ``fn``'s definition as its code object's source gives it (decorators
    included; import aliases of its module applied): the same hash ``python -m gradpatch.patching.fingerprint``
    prints for that definition in that file. Raises :class:`LiftError` if there is no such source."""
    parsed = _parse(fn)
    return fingerprint_source(f"{parsed.imports}\n{ast.unparse(parsed.node)}\n", [parsed.node.name])


def lift_no_grad(fn: object) -> FunctionType:
    """A copy of ``fn`` (unwrapped) with its in-body grad-disabling ``with`` statements removed.

    Cached per code object. Raises :class:`LiftError` when the source is missing, is not the loaded
    code, or contains nothing to lift. See the module docstring for what the copy keeps.
    """
    parsed = _parse(fn)
    raw = _unwrap(fn)  # not parsed.raw: closures of one code object differ in cells and defaults
    cached = _lifted.get(id(raw))
    if cached is not None and cached[0] is raw:
        return cached[1]
    code = _lifted_code.get(id(raw.__code__))
    if code is None:
        lifter = _Lifter(parsed.aliases)
        node = lifter.visit(copy.deepcopy(parsed.node))  # statements keep the original's line numbers
        if not lifter.removed:
            raise LiftError(f"{raw.__qualname__} has no `with torch.no_grad():` or `torch.inference_mode()` "
                            "block in its body to lift")
        code = _compile(parsed, node)
        if sys.version_info >= (3, 11):
            code = code.replace(co_qualname=raw.__code__.co_qualname)
        _lifted_code[id(raw.__code__)] = code
    cells = dict(zip(raw.__code__.co_freevars, raw.__closure__ or ()))
    missing = [name for name in code.co_freevars if name not in cells]
    if missing:
        raise LiftError(f"lifting {raw.__qualname__} needs free variables it does not have: {missing}")
    lifted = FunctionType(code, raw.__globals__, raw.__name__, raw.__defaults__,
                          tuple(cells[name] for name in code.co_freevars))
    lifted.__kwdefaults__ = dict(raw.__kwdefaults__) if raw.__kwdefaults__ else None
    for attr in ("__qualname__", "__module__", "__doc__", "__annotations__"):
        setattr(lifted, attr, getattr(raw, attr))
    lifted.__dict__.update(raw.__dict__)
    lifted.__dict__.pop("__wrapped__", None)
    lifted.__gradpatch_lifted_from__ = raw  # type: ignore[attr-defined]
    _lifted[id(raw)] = (raw, lifted)
    return lifted


class Liftable(NamedTuple):
    """Recognise a function whose in-body ``no_grad`` a fix lifts with :func:`lift_no_grad`.

    Like :class:`~gradpatch.patching.fingerprint.Fingerprints`, but the fingerprint is that of the source the
    function's code object points at (:func:`function_fingerprint`), and a known function is reported
    as unknown code when it cannot be lifted (no source, source edited since import, nothing to
    lift), so the engine skips it with a warning and records why. ``fixed_if`` as for ``Fingerprints``.
    """

    known: Mapping[str, str]
    fixed: Mapping[str, str] = {}  # never mutated
    fixed_if: Callable[[object], bool] | None = None

    def identify(self, module: ModuleType, qualname: str, original: object) -> Identity:
        if self.fixed_if is not None and self.fixed_if(original):
            return Identity("fixed", "the upstream code already has the fix")
        try:
            digest = function_fingerprint(original)
            if digest in self.known:
                lift_no_grad(original)
                return Identity("known", self.known[digest])
        except LiftError as error:
            return Identity("unknown", f"not liftable: {error}")
        if digest in self.fixed:
            return Identity("fixed", self.fixed[digest])
        return Identity("unknown", digest)


__all__ = ["GRAD_OFF", "LiftError", "Liftable", "function_fingerprint", "lift_no_grad"]
