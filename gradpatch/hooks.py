"""Putting a fix in place and taking it out again.

:func:`install` replaces one attribute and, when its module had been imported before ``apply()``,
also *rebinds* every module global that still holds the original object (``from util import
checkpoint`` made a copy of the name). :func:`uninstall` restores the exact original objects, but only
where the current value is still ours. :func:`watch` asks wrapt to call back when a module is first
imported; the callback runs right after the module body finishes, before the importer binds names
from it, so ``from util import checkpoint`` in a sibling module already sees the fix.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

from gradpatch.errors import RevertWarning, complain


def resolve(dotted: str) -> object:
    """Import ``"package.module:Qual.name"`` and return the object it names."""
    module_name, _, qualname = dotted.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def locate(module: ModuleType, qualname: str) -> tuple[object, str, object]:
    """``(owner, attribute, original)`` for ``qualname`` in ``module``.

    The original is read from the owner's ``__dict__`` so descriptors (staticmethod, classmethod) are
    kept as the exact objects that revert must put back.
    """
    *path, attr = qualname.split(".")
    owner: object = module
    for part in path:
        owner = getattr(owner, part)
    namespace = vars(owner)
    if attr not in namespace:
        raise LookupError(f"{module.__name__} has no attribute {qualname!r}")
    return owner, attr, namespace[attr]


@dataclass
class Installed:
    """One replacement in place, with everything needed to undo it."""

    name: str
    owner: object
    attr: str
    original: object
    replacement: object
    rebound: list[tuple[ModuleType, str]] = field(default_factory=list)

    def rebound_names(self) -> tuple[str, ...]:
        return tuple(f"{module.__name__}.{name}" for module, name in self.rebound)


def rebind(original: object, replacement: object, skip: ModuleType) -> list[tuple[ModuleType, str]]:
    """Point every module global that is ``original`` at ``replacement``; return where."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if module is skip or not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                namespace[name] = replacement
                found.append((module, name))
    return found


def install(name: str, module: ModuleType, qualname: str, factory: Callable[[object], object],
            *, late: bool) -> Installed:
    owner, attr, original = locate(module, qualname)
    replacement = factory(original)
    if replacement is original:
        raise TypeError(f"fix factory for {name!r} returned the original object")
    setattr(owner, attr, replacement)
    installed = Installed(name, owner, attr, original, replacement)
    if late and owner is module:
        installed.rebound = rebind(original, replacement, skip=module)
    return installed


def uninstall(installed: Installed) -> None:
    """Put the original back where the current value is still the replacement; warn elsewhere."""
    current = vars(installed.owner).get(installed.attr)
    where = f"{getattr(installed.owner, '__name__', installed.owner)}.{installed.attr}"
    if current is installed.replacement:
        setattr(installed.owner, installed.attr, installed.original)
    else:
        complain(RevertWarning, f"gradpatch: not reverting {installed.name!r}: {where} was replaced by "
                 f"{current!r} after gradpatch patched it; leaving that in place")
    if isinstance(installed.owner, ModuleType):
        # Names bound from the patched module after the fix went in (``from util import checkpoint``
        # in a sibling imported later) hold the replacement too: every one goes back. Fix factories
        # return a new object per target, so this never touches another patch's names.
        rebind(installed.replacement, installed.original, skip=installed.owner)
    undo = getattr(installed.replacement, "__gradpatch_revert__", None)
    if callable(undo):
        undo()


_watched: set[str] = set()


def watch(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (now, if it already is).

    wrapt hooks cannot be removed, so a module is watched at most once per process and the callback
    itself decides, each time, what is still wanted.
    """
    if module_name in _watched:
        return
    _watched.add(module_name)
    import wrapt

    wrapt.register_post_import_hook(callback, module_name)
