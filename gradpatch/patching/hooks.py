"""Putting a fix in place and taking it out again.

:func:`install` replaces one attribute and, when its module had been imported before ``apply()``,
also *rebinds* every module global that still holds the original object (``from util import
checkpoint`` made a copy of the name). :func:`uninstall` restores the exact original objects, but only
where the current value is still ours. :func:`watch` calls back when a module is first
imported (and again on every later execution of its body: a re-import, ``importlib.reload``); the
callback runs right after the module body finishes, before the importer binds names from it, so
``from util import checkpoint`` in a sibling module already sees the fix.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Callable, Iterable, NamedTuple

from gradpatch.errors import RevertWarning, complain


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


def rebind(original: object, replacement: object, skip: ModuleType,
           within: str | None = None) -> list[tuple[ModuleType, str]]:
    """Point every module global that is ``original`` at ``replacement``; return where.

    ``within`` limits the scan to one top-level package. gradpatch's own modules are skipped: the
    fixes hold the objects they are built from.
    """
    found = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if module is skip or not isinstance(namespace, dict) or name.partition(".")[0] == "gradpatch":
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


# --- knowing when a module body has run -----------------------------------------------------------
# wrapt's post-import hooks fire once per name (their registry is emptied on the first import), never
# on ``importlib.reload`` or on a second import after a failed one, and, registered while another thread
# is still running the module's body, they fire at once on the half-built module. A patch must follow
# every execution of its target's body, so gradpatch keeps its own registry, finder and loader.

_callbacks: dict[str, Callable[[ModuleType], None]] = {}
_finding = threading.local()  # names this thread is resolving: another finder may call back into us


class _NotifyingLoader:
    """Runs the real loader's ``exec_module``, then the callback. Every other attribute is the real
    loader's, and the module's ``__loader__``/``__spec__.loader`` are set back to the real loader before
    its body runs (as wrapt's chained loader does), so code that inspects them sees upstream's."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def __getattr__(self, attr: str) -> Any:
        if attr == "_loader":  # not set yet (copy, pickle): no recursion
            raise AttributeError(attr)
        return getattr(self._loader, attr)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        if getattr(module, "__loader__", None) in (None, self):
            with contextlib.suppress(AttributeError):
                module.__loader__ = self._loader
        if getattr(getattr(module, "__spec__", None), "loader", None) is self:
            module.__spec__.loader = self._loader  # type: ignore[union-attr]
        self._loader.exec_module(module)
        callback = _callbacks.get(self._name)
        if callback is not None:
            callback(module)


class _Finder:
    """First on ``sys.meta_path``: for a watched name, the spec the other finders return, with its
    loader wrapped in a :class:`_NotifyingLoader`. It resolves through the remaining finders directly,
    with the ``path`` Python already computed, and never imports a parent package (wrapt's finder
    calls ``importlib.util.find_spec``, which does, and deadlocks when another thread is importing that
    parent). Also consulted by ``importlib.reload``, so a reload runs the callback too."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname not in _callbacks:
            return None
        busy = _finding.__dict__.setdefault("names", set())
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if isinstance(finder, _Finder) or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    loader = spec.loader
                    if loader is not None and hasattr(loader, "exec_module") \
                            and not isinstance(loader, _NotifyingLoader):
                        spec.loader = _NotifyingLoader(loader, fullname)
                    return spec
            return None
        finally:
            busy.discard(fullname)

    def invalidate_caches(self) -> None:
        pass


def watch(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` each time ``module_name``'s body has run: on its first import, on an
    import after it failed or was removed from ``sys.modules``, and on ``importlib.reload``. It runs
    in the importing thread, before the importer binds names from the module. An import already in
    progress when ``watch`` is called is not covered (see :func:`when_initialised`); a module already
    imported is not called back now. One callback per name, kept for the life of the process: the
    callback itself decides, each time, what is still wanted.
    """
    _callbacks[module_name] = callback
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


_swapped: dict[type, type] = {}


def when_initialised(module: ModuleType, callback: Callable[[ModuleType], None]) -> bool:
    """Call ``callback(module)`` when the import now running ``module``'s body finishes (in the importing
    thread, before the importer binds names from it; not if that import fails). False if ``module`` is
    not being initialised, or its spec cannot be watched: then nothing will be called.

    The import system marks a module's spec ``_initializing`` while its body runs and clears the flag
    when the import finishes; the spec's class is swapped, for that moment, for a subclass in which
    clearing the flag calls back.
    """
    spec = getattr(module, "__spec__", None)
    if spec is None or not vars(spec).get("_initializing", False):
        return False
    vars(spec).setdefault("_gradpatch_callbacks", []).append(callback)  # before the swap: see below
    base = type(spec)
    if getattr(base, "_gradpatch_base", None) is None:  # else already watched: one more callback
        watching = _swapped.get(base)
        if watching is None:
            watching = _swapped[base] = type(base.__name__, (base,), {
                "_initializing": property(lambda self: vars(self).get("_initializing", False), _initialised),
                "_gradpatch_base": base, "__module__": base.__module__})
        try:
            spec.__class__ = watching
        except TypeError:
            vars(spec).pop("_gradpatch_callbacks", None)
            return False
    if not vars(spec).get("_initializing", False):  # the import finished while the class was swapped
        _initialised(spec, False)
    return True


def _initialised(spec: Any, value: bool) -> None:
    vars(spec)["_initializing"] = value
    if value:
        return
    callbacks = vars(spec).pop("_gradpatch_callbacks", [])  # atomic: each callback runs at most once
    base = getattr(type(spec), "_gradpatch_base", None)
    if base is not None:
        with contextlib.suppress(TypeError):
            spec.__class__ = base
    module = sys.modules.get(spec.name)
    if module is not None and getattr(module, "__spec__", None) is spec:
        for callback in callbacks:
            callback(module)
