"""Putting a fix in place and taking it out again.

:func:`install` replaces one attribute and, when its module had been imported before ``apply()``,
also *rebinds* every module global that still holds the original object (``from util import
checkpoint`` made a copy of the name). :func:`uninstall` restores the exact original objects, but only
where the current value is still ours. Knowing when a module's body has run is
:mod:`gradpatch.patching.watcher`'s job. Rebinding reads module globals without attribute access: a lazily
imported module that has not loaded yet is never forced to load (it cannot hold the original yet).
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Callable, Iterable, NamedTuple

from gradpatch.errors import RevertWarning, complain
from gradpatch.patching.watcher import namespace as globals_of, unloaded


def resolve(dotted: str) -> object:
    """Import ``"package.module:Qual.name"`` and return the object it names."""
    module_name, _, qualname = dotted.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: The "original" of a class attribute the class does not define itself (it inherits it, e.g.
#: ``__init_subclass__`` from ``object``): installing defines it, reverting deletes it again.
MISSING = _Missing()


def locate(module: ModuleType, qualname: str) -> tuple[object, str, object]:
    """``(owner, attribute, original)`` for ``qualname`` in ``module``.

    The original is read from the owner's ``__dict__`` so descriptors (staticmethod, classmethod) are
    kept as the exact objects that revert must put back; for a class that does not define the
    attribute itself it is :data:`MISSING`.
    """
    *path, attr = qualname.split(".")
    owner: object = module
    for part in path:
        owner = getattr(owner, part)
    namespace = vars(owner)
    if attr in namespace:
        return owner, attr, namespace[attr]
    if isinstance(owner, type):
        return owner, attr, MISSING
    raise LookupError(f"{module.__name__} has no attribute {qualname!r}")


class Installed(NamedTuple):
    """One replacement in place, with everything needed to undo it."""

    name: str
    owner: object
    attr: str
    original: object
    replacement: object
    rebound: list[tuple[ModuleType, str]]

    def rebound_names(self) -> tuple[str, ...]:
        return tuple(f"{module.__name__}.{name}" for module, name in self.rebound)


def rebind(original: object, replacement: object, skip: object,
           within: str | None = None) -> list[tuple[ModuleType, str]]:
    """Point every module global that is ``original`` at ``replacement``; return where.

    ``within`` limits the scan to one top-level package. gradpatch's own modules are skipped: the
    fixes hold the objects they are built from.
    """
    found = []
    for name, module in list(sys.modules.items()):
        if module is skip or not isinstance(name, str) or name.partition(".")[0] == "gradpatch" or unloaded(module):
            continue
        namespace = globals_of(module)
        if namespace is None:
            continue
        if within is not None and name != within and not name.startswith(within + "."):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                namespace[name] = replacement
                found.append((module, name))
    return found


def install(name: str, module: ModuleType, qualname: str, factory: Callable[[object], object],
            *, late: bool, in_use: Iterable[object] = ()) -> Installed:
    owner, attr, original = locate(module, qualname)
    replacement = factory(getattr(owner, attr) if original is MISSING else original)
    if replacement is original or any(replacement is other for other in in_use):
        # Revert finds stale names by identity, so every target needs an object of its own.
        raise TypeError(f"the fix for {name!r} returned the original or another target's object; "
                        "a fix factory must build a new object per call")
    setattr(owner, attr, replacement)
    rebound: list[tuple[ModuleType, str]] = []
    if late and owner is module:
        # An object the module defines may have been imported anywhere (a user's script too); one it
        # merely imported (torch's checkpoint bound into sgm) belongs to others: only the target's
        # own package is rebound then, and torch keeps its function everywhere else.
        defined_here = getattr(original, "__module__", None) == module.__name__
        rebound = rebind(original, replacement, skip=module,
                         within=None if defined_here else module.__name__.partition(".")[0])
    installed = Installed(name, owner, attr, original, replacement, rebound)
    return installed


def uninstall(installed: Installed) -> None:
    """Put the original back where the current value is still the replacement; warn elsewhere."""
    current = vars(installed.owner).get(installed.attr)
    where = f"{getattr(installed.owner, '__name__', installed.owner)}.{installed.attr}"
    if current is installed.replacement:
        if installed.original is MISSING:
            delattr(installed.owner, installed.attr)
        else:
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


def forget(installed: Installed) -> None:
    """Undo what :func:`uninstall` would, except the owner's attribute: for a replacement whose module
    body ran again (``importlib.reload``), so the owner already holds upstream's new object."""
    rebind(installed.replacement, installed.original, skip=installed.owner)
    undo = getattr(installed.replacement, "__gradpatch_revert__", None)
    if callable(undo):
        undo()
