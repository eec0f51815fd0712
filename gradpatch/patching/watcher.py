"""Knowing when a module's body has run: one event for every execution, whoever found or loaded it.

A patch must go in right after its target's body has run and before any importer binds names from
it (``from util import checkpoint`` in a sibling), and again on *every* later execution of that body;
the scan for copies of known-broken code needs the same event for every module. :func:`start` calls
one listener, in the executing thread, for each of:

* an import through the import system, by any finder and any loader (``.py`` source, a zip file,
  ``.pyc`` without source, a custom loader whose ``exec_module`` runs ``exec`` on code it holds);
  a second import after the module left ``sys.modules``; an import that was already running (in
  this thread or another) when the watch started: its end is delivered when its body finishes;
* ``importlib.reload``, a lazily imported module (``importlib.util.LazyLoader``, ``lazy_loader.load``)
  loading on its first use, and a module executed by hand (``importlib.util.module_from_spec`` then
  ``spec.loader.exec_module``), for every loader built on the standard library's (below).

How it is seen, at two points every execution passes through. Neither is a finder, a loader object or
a path hook: nothing on ``sys.meta_path`` or ``sys.path_hooks`` is added, removed, reordered or
replaced (``PathFinder`` stays there, by identity, for typeguard's and jaxtyping's
``install_import_hook``, which look it up), and a finder inserted ahead later (both of theirs go to
``sys.meta_path[0]``; beartype.claw adds a path hook) changes nothing, whatever loader it returns.

1. ``exec_module`` of ``importlib._bootstrap_external._LoaderBasics``, the base that
   ``SourceFileLoader``, ``SourcelessFileLoader``, ``zipimport.zipimporter`` and their subclasses
   (typeguard's, jaxtyping's and beartype's instrumenting loaders, editable installs' loaders) run
   the body with, is wrapped in place on that class: every loader keeps its class and identity.
2. The import system marks a spec ``_initializing`` while it runs the body and clears the mark in
   ``_load_unlocked``'s ``finally`` once the body has finished, whatever the loader, before the
   importer binds any name. A property on ``ModuleSpec`` (storing the flag where the import system
   does) sees the mark cleared. An import passes through both points; its event is delivered once,
   at the second, when ``sys.modules`` holds the finished module (a failed import delivers nothing).

What it costs: per import, two calls of the property's setter and one wrapper frame (under a
microsecond; ``benchmarks/startup.py``); every ``import x`` of a module already imported reads the
flag through the property (tens of nanoseconds). A module is never read through ``getattr``:
:func:`namespace` reads its ``__dict__`` through the module type's own descriptor, so a lazily
imported module is never forced to load (its body runs on first use, and the event comes then).

What it cannot see: a loader with an ``exec_module`` of its own (not the standard library's) run
outside an import (its ``reload``, a hand-made execution); a loader with only the deprecated
``load_module``; code ``exec``'d into a ``types.ModuleType`` with no loader at all; on Python 3.9, zip
imports (its ``zipimporter`` has only ``load_module``). ``apply()`` examines what those left in
``sys.modules`` by then, and ``report()`` says so (with a warning) for a declared target whose body
ran unseen: not in place, and patched by ``apply()`` again.

Why not wrapt's post-import hooks: they fire once per name (their registry is emptied on the first
import), never on ``importlib.reload`` or a second import; their finder sits at ``sys.meta_path[0]``
and only sees names registered in advance, so it cannot watch every module for the scan and is
passed over by a finder inserted ahead of it later; a hook registered while another thread runs the
module's body fires at once on the half-built module. The composing principle is wrapt's (wrap the
loader's ``exec_module``, keep the real loader visible, never replace a finder), applied one level
lower. :func:`stop` takes both back out when nothing is patched any more, restoring the exact
original objects; if something else wrapped the same attribute after gradpatch did, its wrapper is
left in place and gradpatch's, under it, passes straight through.
"""
from __future__ import annotations

import sys
from types import ModuleType

# importlib._bootstrap and _bootstrap_external, as the interpreter runs them (always loaded)
from _frozen_importlib import ModuleSpec  # importlib.machinery.ModuleSpec
from _frozen_importlib_external import _LoaderBasics

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable

    Listener = Callable[[ModuleType, bool], None]

_listener: Listener | None = None  # type: ignore[name-defined]
_late: set[int] = set()  # specs of imports already running when they were deferred (see defer())
_MODULE_DICT = vars(ModuleType)["__dict__"]  # reads a module's dict without __getattribute__


def namespace(module: object) -> dict | None:
    """``module``'s ``__dict__``, read without attribute access (a lazily imported module stays
    unloaded, a module's ``__getattr__`` is not called); None for an object without one."""
    if isinstance(type(module), type) and issubclass(type(module), ModuleType):
        return _MODULE_DICT.__get__(module)  # type: ignore[attr-defined]
    try:
        found = object.__getattribute__(module, "__dict__")
    except (AttributeError, TypeError):
        return None
    return found if isinstance(found, dict) else None


def unloaded(module: object) -> bool:
    """Whether ``module`` was imported lazily (``importlib.util.LazyLoader``) and its body has not
    run yet: it will, on first use, and that is when the listener hears of it."""
    util = sys.modules.get("importlib.util")
    lazy = getattr(util, "_LazyModule", None) if util is not None else None
    return lazy is not None and issubclass(type(module), lazy)


def _spec(module: object) -> object:
    found = namespace(module)
    return None if found is None else found.get("__spec__")


def running(module: object) -> bool:
    """Whether an import is running ``module``'s body right now (in this thread or another)."""
    spec = _spec(module)
    return bool(getattr(spec, "__dict__", {}).get("_initializing", False))


def defer(module: object) -> bool:
    """Deliver the end of the import now running ``module``'s body as *late* (another thread may
    have bound names from the half-built module meanwhile). False if that end cannot be seen (its
    spec is not a ``ModuleSpec``): the listener will not hear of it."""
    spec = _spec(module)
    if not isinstance(spec, ModuleSpec):
        return False
    _late.add(id(spec))
    if not running(module):  # finished meanwhile: already delivered, or waiting for the caller's lock
        _late.discard(id(spec))
    return True


def _deliver(module: ModuleType, late: bool) -> None:
    listener = _listener
    if listener is not None:
        listener(module, late)


def _get_initializing(spec: ModuleSpec) -> bool:
    return spec.__dict__.get("_initializing", False)


def _set_initializing(spec: ModuleSpec, value: bool) -> None:
    spec.__dict__["_initializing"] = value
    if value:
        return
    late = id(spec) in _late
    if late:
        _late.discard(id(spec))
    if _listener is None:
        return
    module = sys.modules.get(spec.name)
    if module is not None and _spec(module) is spec and not unloaded(module):
        try:
            _deliver(module, late)
        except BaseException:
            # Raised into the import (strict mode): as for a body that raised, the module leaves
            # sys.modules, so the next import runs it (and the listener) again.
            if sys.modules.get(spec.name) is module:
                del sys.modules[spec.name]
            raise


def _del_initializing(spec: ModuleSpec) -> None:
    spec.__dict__.pop("_initializing", None)


_INITIALIZING = property(_get_initializing, _set_initializing, _del_initializing,
                         "gradpatch.watcher: the import system's mark, seen as it is cleared")


def _wrap(inner: Callable) -> Callable:  # type: ignore[name-defined]
    def exec_module(self: object, module: ModuleType) -> None:
        inner(self, module)
        if _listener is not None and not running(module):  # else the import's end delivers it
            _deliver(module, False)

    exec_module.__name__, exec_module.__qualname__ = inner.__name__, getattr(inner, "__qualname__", "exec_module")
    exec_module.__doc__, exec_module.__wrapped__ = inner.__doc__, inner  # type: ignore[attr-defined]
    exec_module._gradpatch_watcher = True  # type: ignore[attr-defined]
    return exec_module


def start(listener: Listener) -> None:  # type: ignore[name-defined]
    """Call ``listener(module, late)`` after every execution of a module body (see the module
    docstring), in the executing thread, before the importer binds names from the module. ``late``
    is True for an import :func:`defer` was told of. One listener: a second call replaces it. The
    listener's exceptions propagate into the import that ran the body."""
    global _listener
    if not getattr(vars(_LoaderBasics).get("exec_module"), "_gradpatch_watcher", False):
        _LoaderBasics.exec_module = _wrap(vars(_LoaderBasics)["exec_module"])  # type: ignore[method-assign]
    if vars(ModuleSpec).get("_initializing") is not _INITIALIZING:
        ModuleSpec._initializing = _INITIALIZING  # type: ignore[attr-defined]
    _listener = listener


def stop() -> None:
    """Stop calling the listener and put back the exact objects :func:`start` replaced. Where
    something else has replaced them since (wrapping gradpatch's), that stays, and gradpatch's
    wrapper under it passes straight through."""
    global _listener
    _listener = None
    _late.clear()
    current = vars(_LoaderBasics).get("exec_module")
    if getattr(current, "_gradpatch_watcher", False):
        _LoaderBasics.exec_module = current.__wrapped__  # type: ignore[union-attr, method-assign]
    if vars(ModuleSpec).get("_initializing") is _INITIALIZING:
        del ModuleSpec._initializing  # type: ignore[attr-defined]
