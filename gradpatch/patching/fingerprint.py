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
``python -m gradpatch.patching.fingerprint FILE NAME [NAME ...]`` (e.g. ``util.py checkpoint CheckpointFunction``).

At run time :class:`Fingerprints` hashes the definitions that made the objects actually found at the
target (:mod:`gradpatch.patching.definitions`): a wrapper or a rebinding someone installed there is unknown code.
"""
from __future__ import annotations

import ast
import sys
from types import ModuleType
from typing import Callable, Literal, Mapping, NamedTuple, Protocol, Sequence

from gradpatch.patching.definitions import NoSource, definition_of, import_aliases, lookup, parse_module

#: ``unreadable``: the module's source cannot be read (the label says why and what to do), so the code
#: cannot be recognised at all.
Verdict = Literal["known", "fixed", "unknown", "unreadable"]


class Identity(NamedTuple):  # NamedTuples, not dataclasses: ~0.5 ms to define instead of ~2 at start-up
    """What a recogniser concluded about a target: its verdict and a label for the report."""

    verdict: Verdict
    label: str


class Recogniser(Protocol):
    """Decides whether ``original`` (``module.qualname``) is code a patch knows how to fix."""

    def identify(self, module: ModuleType, qualname: str, original: object) -> Identity: ...


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
    aliases = import_aliases(tree)
    digest = hashlib.sha256()
    for name in names:
        digest.update(_canonical(_find(tree, name), aliases).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def fingerprint_module(module: ModuleType, names: Sequence[str]) -> str:
    """The fingerprint of ``names`` in an imported module, as its source file defines them."""
    parsed = parse_module(module)
    import hashlib

    digest = hashlib.sha256()
    for name in names:
        digest.update(_canonical(_find(parsed.tree, name), parsed.aliases).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def fingerprint_objects(module: ModuleType, names: Sequence[str], found: Mapping[str, object] = {}) -> str:
    """The fingerprint of the objects ``module`` holds under ``names`` (or ``found[name]``), hashed
    from their own definitions.

    Each must be what the module's own definition of that name made (see :func:`definition_of`);
    a companion name (not in ``found``) already holding gradpatch's replacement counts as the
    definition it replaced, which gradpatch recognised before replacing it. Raises
    :class:`LookupError` otherwise."""
    parsed = parse_module(module)
    import hashlib

    digest = hashlib.sha256()
    for name in names:
        obj = found[name] if name in found else lookup(module, name)
        if name not in found and getattr(obj, "__module__", "").partition(".")[0] == "gradpatch":
            node = _find(parsed.tree, name)
        else:
            node = definition_of(module, name, obj)
        digest.update(_canonical(node, parsed.aliases).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


class Fingerprints(NamedTuple):
    """Recognise code by fingerprint.

    ``known`` maps each fingerprint of the broken code to its provenance (``"V1 · owner/repo@sha path"``);
    ``fixed`` does the same for versions already fixed upstream, and ``fixed_if`` may recognise those by
    behaviour instead (e.g. "``sample`` already takes ``cache``"). ``over`` names the definitions hashed
    together (default: the patched attribute alone); the checkpoint patches hash ``checkpoint`` and
    ``CheckpointFunction`` together because the defect lives in the class.

    What is hashed is the definition of the object found at the target, not whatever the file
    defines under that name: an object that is not what its module's own definition made (a user's
    wrapper, a later rebinding) is unknown code, and so is an ``over`` companion replaced by anything
    but gradpatch.
    """

    known: Mapping[str, str]
    fixed: Mapping[str, str] = {}  # never mutated
    over: tuple[str, ...] = ()
    fixed_if: Callable[[object], bool] | None = None

    def identify(self, module: ModuleType, qualname: str, original: object) -> Identity:
        if self.fixed_if is not None and self.fixed_if(original):
            return Identity("fixed", "the upstream code already has the fix")
        names = self.over or (qualname,)
        try:
            if qualname not in names:
                definition_of(module, qualname, original)
            digest = fingerprint_objects(module, names, {qualname: original})
        except NoSource as missing:
            return Identity("unreadable", f"{missing}; to have it recognised, {missing.advice}")
        except LookupError as missing:  # the definition moved, was removed, or is not what runs
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
        from gradpatch.patching.hooks import resolve

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
        print("usage: python -m gradpatch.patching.fingerprint FILE NAME [NAME ...]", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8", newline="") as handle:
        print(fingerprint_source(handle.read(), args[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
