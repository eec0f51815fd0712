"""Which definition in its module's source made an object: the object found at a target, not the file.

A fix replaces the object that is there at run time, so that is what must be recognised. Reading the
module's source and hashing the definition of a name would describe the file, not the object: a
user's wrapper installed on ``util.checkpoint``, a later ``checkpoint = ...`` in the module body, or
a file edited after import would all pass for the code on disk. :func:`definition_of` finds the
``def``/``class`` whose execution made the object, by compiling the module's source (once per file)
and comparing code objects, or raises :class:`LookupError`.
"""
from __future__ import annotations

import ast
from types import ModuleType
from typing import NamedTuple


def import_aliases(tree: ast.Module) -> dict[str, str]:
    """Every name a module-level import binds, mapped to the dotted name it was imported as."""
    aliases: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


class Parsed(NamedTuple):
    """A module's source as parsed, with what hashing and compiling it again need."""

    tree: ast.Module
    aliases: dict[str, str]
    flags: int  # the module's ``from __future__`` compiler flags
    filename: str


_parsed: dict[tuple[str, str | None], Parsed] = {}
_compiled: dict[str, object] = {}  # module file -> the module's code, compiled from its source


class NoSource(LookupError):
    """The module's source cannot be read, so nothing in it can be recognised. The message says
    why, in words fit for a warning; :attr:`advice` says what would make it readable."""

    def __init__(self, message: str, advice: str) -> None:
        super().__init__(message)
        self.advice = advice


def _no_source(module: ModuleType) -> NoSource:
    """Why ``module``'s source cannot be read, and what to do about it."""
    namespace = getattr(module, "__dict__", {})
    file = namespace.get("__file__")
    spec = namespace.get("__spec__")
    loader = getattr(spec, "loader", None) or namespace.get("__loader__")
    name = namespace.get("__name__", "?")
    if isinstance(file, str) and file.endswith((".pyc", ".pyo")):
        return NoSource(f"{name} was loaded from bytecode ({file}) with no .py source beside it",
                        "put its .py source where it is imported from (e.g. install the package "
                        "with its sources) and import it again")
    if file is None and loader is None:
        return NoSource(f"{name} has no source file and no loader (a module built in memory, e.g. "
                        "types.ModuleType and exec)",
                        "create it from its .py file instead (importlib.util.spec_from_file_location, "
                        "module_from_spec, then spec.loader.exec_module)")
    where = f"from {file}" if isinstance(file, str) else "without a file"
    return NoSource(f"{name} was loaded {where} by {type(loader).__name__}, which gives no source",
                    "import it from its .py file, or give its loader a get_source() that returns the "
                    "module's source")


def parse_module(module: ModuleType) -> Parsed:
    """The module's source as parsed, once per module file (the source is read, never re-executed):
    its file through :mod:`linecache` (plain files, zip files), else its loader's ``get_source``.
    Raises :class:`NoSource` when neither gives it."""
    key = (module.__name__, getattr(module, "__file__", None))
    if key not in _parsed:
        import inspect

        source: str | None
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):  # a .pyc without source, a module built in memory
            source = _loader_source(module)
            if source is None:
                raise _no_source(module) from None
        tree = ast.parse(source)
        import __future__

        flags = 0
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                flags |= sum(getattr(__future__, alias.name).compiler_flag for alias in node.names)
        _parsed[key] = Parsed(tree, import_aliases(tree), flags, key[1] or module.__name__)
    return _parsed[key]


def _loader_source(module: ModuleType) -> str | None:
    namespace = getattr(module, "__dict__", {})
    for loader in (getattr(namespace.get("__spec__"), "loader", None), namespace.get("__loader__")):
        get_source = getattr(loader, "get_source", None)
        if callable(get_source):
            try:
                source = get_source(namespace.get("__name__"))
            except (ImportError, OSError, TypeError, ValueError):
                continue
            if isinstance(source, str):
                return source
    return None


def _first_line(node: ast.AST) -> int:
    """The line a definition's code object records as ``co_firstlineno`` (its first decorator's)."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])  # type: ignore[attr-defined]


def _nested(code: object, node: ast.AST) -> object | None:
    """The code object compiled from definition ``node`` among the constants of ``code``."""
    for const in getattr(code, "co_consts", ()):
        if getattr(const, "co_name", None) == getattr(node, "name", None) and const.co_firstlineno == _first_line(node):
            return const
    return None


def _unwrapped(obj: object, layers: int) -> list[object]:
    """``obj`` and what up to ``layers`` decorators made of it (staticmethod, functools.wraps..., and a
    wrapper that is not ``wraps``-based but closes over exactly one function, e.g. imagen's
    ``eval_decorator``: that function)."""
    found = [obj]
    for _ in range(layers):
        obj = next((getattr(obj, a) for a in ("__func__", "__wrapped__", "fget") if hasattr(obj, a)), None) \
            or _closed_over(found[-1])
        if obj is None:
            break
        found.append(obj)
    return found


def _closed_over(wrapper: object) -> object | None:
    """The one function a wrapper's closure holds, or ``None`` (no closure, or several functions)."""
    import types

    cells = [c.cell_contents for c in getattr(wrapper, "__closure__", None) or () if _filled(c)]
    functions = [value for value in cells if isinstance(value, types.FunctionType)]
    return functions[0] if len(functions) == 1 else None


def _filled(cell: object) -> bool:
    try:
        cell.cell_contents  # type: ignore[attr-defined]
    except ValueError:  # an empty cell
        return False
    return True


def _defines(obj: object, node: ast.AST, code: object, module: ModuleType) -> bool:
    """Whether ``obj`` is what executing definition ``node`` (compiled to ``code``) in ``module`` made.

    A function is one whose code object equals ``code`` (bytecode, constants, names, line numbers)
    and whose globals are the module's, reached through no more wrappers than ``node`` has
    decorators: a wrapper someone installed later is not the definition. A class is its module's
    class of that name whose every method in ``node`` is, in the same sense, that method."""
    if isinstance(node, ast.ClassDef):
        if not isinstance(obj, type) or obj.__module__ != module.__name__ or obj.__name__ != node.name:
            return False
        methods = {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        return all(name in vars(obj) and _defines(vars(obj)[name], method, _nested(code, method), module)
                   for name, method in methods.items())
    return code is not None and any(
        getattr(candidate, "__code__", None) == code and getattr(candidate, "__globals__", None) is module.__dict__
        for candidate in _unwrapped(obj, len(getattr(node, "decorator_list", []))))


def definition_of(module: ModuleType, qualname: str, obj: object) -> ast.AST:
    """The definition in ``module``'s source that made ``obj``, found at ``module.qualname``.

    Raises :class:`LookupError` when ``obj`` is not what the module's own ``def``/``class`` of that
    name made: a wrapper installed on it, a later rebinding in the module body, a module edited on
    disk after it was imported, or code without source."""
    parsed = parse_module(module)
    *outer, name = qualname.split(".")
    scopes: list[tuple[ast.AST | None, object]] = [(None, None)]
    for part in outer:  # the enclosing classes, as their module defines them
        scopes = [(node, _code(parsed, node, scope, code)) for scope, code in scopes
                  for node in _body(parsed, scope) if isinstance(node, ast.ClassDef) and node.name == part]
    for scope, code in scopes:
        for node in _body(parsed, scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                if _defines(obj, node, _code(parsed, node, scope, code), module):
                    return node
    raise LookupError(f"{module.__name__}.{qualname} is not the module's own definition of {name!r} "
                      "(a wrapper or a later rebinding, or the file changed since it was imported)")


def _body(parsed: Parsed, scope: ast.AST | None) -> list[ast.stmt]:
    return parsed.tree.body if scope is None else scope.body  # type: ignore[attr-defined]


def _code(parsed: Parsed, node: ast.AST, scope: ast.AST | None, scope_code: object) -> object:
    if scope is not None:
        return _nested(scope_code, node)
    if parsed.filename not in _compiled:
        # The whole module, not the definition alone: how a name was bound elsewhere in the module
        # (``import torch``) changes the bytecode compiled for its uses.
        _compiled[parsed.filename] = compile(parsed.tree, parsed.filename, "exec", parsed.flags, dont_inherit=True)
    return _nested(_compiled[parsed.filename], node)


def lookup(module: ModuleType, qualname: str) -> object:
    obj: object = module
    for part in qualname.split("."):
        namespace = getattr(obj, "__dict__", {})
        if part not in namespace:
            raise LookupError(f"{module.__name__} has no {qualname!r}")
        obj = namespace[part]
    return obj
