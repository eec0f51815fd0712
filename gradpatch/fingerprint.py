"""Recognising upstream code by what it is, not where it lives.

Module paths and versions cannot identify a copy of the broken code: ``ldm`` names several different
codebases, ``audioldm`` two, and vendored copies carry no version at all. A *fingerprint* is a short
hash of the normalised syntax tree of one or more top-level definitions of a module, computed from the
module's source text. Normalisation removes what does not change behaviour:

* comments, blank lines, line endings (CRLF or LF) and formatting (the tree is hashed, not the text);
* docstrings of the module, classes and functions;
* import aliases: ``th.no_grad`` and ``torch.no_grad`` hash alike, because every name bound by a
  module-level import is replaced by the dotted name it was imported as.

The serialisation skips empty and ``None`` fields, so the same source hashes alike on every Python
version that parses it. Compute a fingerprint offline with
``python -m gradpatch.fingerprint FILE NAME [NAME ...]`` (e.g. ``util.py checkpoint CheckpointFunction``).
"""
from __future__ import annotations

import ast
import sys
from types import ModuleType
from typing import Callable, Literal, Mapping, NamedTuple, Protocol, Sequence

Verdict = Literal["known", "fixed", "unknown"]


class Identity(NamedTuple):  # NamedTuples, not dataclasses: ~0.5 ms to define instead of ~2 at start-up
    """What a recogniser concluded about a target: its verdict and a label for the report."""

    verdict: Verdict
    label: str


class Recogniser(Protocol):
    """Decides whether ``original`` (``module.qualname``) is code a patch knows how to fix."""

    def identify(self, module: ModuleType, qualname: str, original: object) -> Identity: ...


def _import_aliases(tree: ast.Module) -> dict[str, str]:
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


def _strip_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[1:]
    return body


def _canonical(node: object, aliases: Mapping[str, str]) -> str:
    """A Python-version-independent text form of ``node``."""
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item, aliases) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    if isinstance(node, ast.Name):
        return f"Name({aliases.get(node.id, node.id)!r})"
    parts = []
    for name, value in ast.iter_fields(node):
        if name == "ctx" or value is None or value == []:
            continue
        if name == "body" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            value = _strip_docstring(value)
        parts.append(f"{name}={_canonical(value, aliases)}")
    return f"{type(node).__name__}({','.join(parts)})"


def _find(tree: ast.Module, qualname: str) -> ast.AST:
    scope: Sequence[ast.stmt] = tree.body
    found: ast.AST | None = None
    for part in qualname.split("."):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == part:
                    found = node
            elif isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == part for t in node.targets):
                    found = node
        if found is None:
            raise LookupError(f"no top-level definition {qualname!r} in the source")
        scope = getattr(found, "body", [])
    assert found is not None
    return found


def fingerprint_source(source: str, names: Sequence[str]) -> str:
    """The fingerprint of the definitions ``names`` (dotted for methods) in module source text."""
    import hashlib

    tree = ast.parse(source)
    aliases = _import_aliases(tree)
    digest = hashlib.sha256()
    for name in names:
        digest.update(_canonical(_find(tree, name), aliases).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


_by_module: dict[tuple[str, str | None, tuple[str, ...]], str] = {}


def fingerprint_module(module: ModuleType, names: Sequence[str]) -> str:
    """The fingerprint of ``names`` in an imported module (its source is read, not re-executed).

    Cached per module file: the patches of one codebase usually hash the same definitions.
    """
    key = (module.__name__, getattr(module, "__file__", None), tuple(names))
    if key not in _by_module:
        import inspect

        _by_module[key] = fingerprint_source(inspect.getsource(module), names)
    return _by_module[key]


class Fingerprints(NamedTuple):
    """Recognise code by fingerprint.

    ``known`` maps each fingerprint of the broken code to its provenance (``"V1 · owner/repo@sha path"``);
    ``fixed`` does the same for versions already fixed upstream, and ``fixed_if`` may recognise those by
    behaviour instead (e.g. "``sample`` already takes ``cache``"). ``over`` names the definitions hashed
    together (default: the patched attribute alone); the checkpoint patches hash ``checkpoint`` and
    ``CheckpointFunction`` together because the defect lives in the class.
    """

    known: Mapping[str, str]
    fixed: Mapping[str, str] = {}  # never mutated
    over: tuple[str, ...] = ()
    fixed_if: Callable[[object], bool] | None = None

    def identify(self, module: ModuleType, qualname: str, original: object) -> Identity:
        if self.fixed_if is not None and self.fixed_if(original):
            return Identity("fixed", "the upstream code already has the fix")
        try:
            digest = fingerprint_module(module, self.over or (qualname,))
        except LookupError as missing:  # the definition moved or was removed upstream
            return Identity("unknown", str(missing))
        if digest in self.known:
            return Identity("known", self.known[digest])
        if digest in self.fixed:
            return Identity("fixed", self.fixed[digest])
        return Identity("unknown", digest)


class IsObject(NamedTuple):
    """Recognise a target that *is* a given object, e.g. ``torch.utils.checkpoint:checkpoint``
    bound into a module that should not use its reentrant default."""

    dotted: str
    label: str

    def identify(self, module: ModuleType, qualname: str, original: object) -> Identity:
        from gradpatch.hooks import resolve

        if original is resolve(self.dotted):
            return Identity("known", self.label)
        return Identity("unknown", f"not {self.dotted}")


def has_parameter(name: str) -> Callable[[object], bool]:
    """A ``fixed_if`` test: the (unwrapped) callable already accepts ``name``."""

    def test(original: object) -> bool:
        import inspect

        try:
            return name in inspect.signature(inspect.unwrap(original)).parameters  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False

    return test


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m gradpatch.fingerprint FILE NAME [NAME ...]", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8", newline="") as handle:
        print(fingerprint_source(handle.read(), args[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
