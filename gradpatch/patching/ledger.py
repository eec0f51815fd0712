"""What gradpatch knows, wants, has installed and has recorded, and applying one patch.

The state behind :mod:`gradpatch.patching.activation`, under one re-entrant lock: the known patches
(the catalogue, and the copies the scan adopted), which are wanted, what is installed (in order, so
revert is LIFO), the fixes of earlier executions of a reloaded module, and a
:class:`~gradpatch.patching.registry.Record` per patch. :func:`_apply_now` recognises and installs one
patch on a module whose body has run, and records the outcome; a failing fix is recorded and warned
about, never raised into the user's ``import`` (unless strict). A fork resets the lock in the child,
so a lock held by another thread of the parent cannot deadlock it.
"""
from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Iterable

from gradpatch.errors import PatchFailedWarning, UnknownCodeWarning, complain, logger
from gradpatch.patching import selection, watcher
from gradpatch.patching.hooks import MISSING, Installed, install, locate, resolve
from gradpatch.patching.registry import Patch, Record, Status
from gradpatch.patching.versions import _installed_version

_lock = threading.RLock()
_patches: _Catalogue | None = None
_wanted: set[str] = set()
_installed: dict[str, Installed] = {}  # insertion order is install order
_superseded: dict[str, list[Installed]] = {}  # fixes of earlier executions of a reloaded module
_records: dict[str, Record] = {}
_adopted: dict[str, frozenset[str]] = {}  # copies the scan found: patch name -> their family's fixes
_requested: set[str] = set()  # patches added by request() (gradpatch.differentiable's string form)
_targets: dict[str, list[Patch]] = {}  # module name -> known patches on it (see _index)
_indexed = -1  # _patches.changes when _targets was built


class _Catalogue(dict):  # type: ignore[type-arg]
    """The known patches by name: a dict that counts its changes, so that the index by module (read
    at every module body) knows in O(1) whether it is current, whoever changed it (the scan, a
    request, a test)."""

    changes = 0

    def __setitem__(self, key: str, value: Patch) -> None:
        super().__setitem__(key, value)
        self.changes += 1

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.changes += 1

    def pop(self, *args: object) -> object:  # type: ignore[override]
        self.changes += 1
        return super().pop(*args)  # type: ignore[arg-type]

    def update(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        super().update(*args, **kwargs)  # type: ignore[arg-type]
        self.changes += 1

    def setdefault(self, key: str, default: Patch) -> Patch:  # type: ignore[override]
        self.changes += 1
        return super().setdefault(key, default)

    def popitem(self) -> tuple[str, Patch]:
        self.changes += 1
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self.changes += 1


def _reset_lock_in_child() -> None:
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_in_child)


def known_patches() -> dict[str, Patch]:
    """Every declared patch by name (the built-in catalogue, then plug-ins)."""
    global _patches
    with _lock:
        if _patches is None:
            from gradpatch.patching import catalogue

            _patches = _Catalogue(catalogue.load())
        return _patches


def _index() -> dict[str, list[Patch]]:
    """Known patches by target module, rebuilt when the catalogue changed (the scan, a request)."""
    global _targets, _indexed
    patches = _patches
    if patches is None:
        return {}
    if patches.changes != _indexed:  # no lock: every import asks, and must never wait for another thread
        changes = patches.changes  # read first: a change while building leaves the index stale, not wrong
        known = list(patches.values())  # one C call: no other thread runs during it
        targets: dict[str, list[Patch]] = {}
        for patch in known:
            targets.setdefault(patch.module, []).append(patch)
        _targets, _indexed = targets, changes
    return _targets


def select(names: Iterable[object] = (), exclude: object = (), *, source: str = "apply()",
           exclude_source: str = "exclude") -> tuple[list[Patch], list[Patch]]:
    """``(selected, excluded)`` among :func:`known_patches`: see :func:`gradpatch.patching.selection.select`."""
    return selection.select(known_patches(), names, exclude, source=source, exclude_source=exclude_source)


def _record(patch: Patch, status: Status, reason: str = "", **fields: object) -> None:
    _records[patch.name] = Record(patch.name, patch.upstream, patch.target, status, reason, **fields)  # type: ignore[arg-type]


def _in_place(installed: Installed, module: ModuleType, qualname: str) -> bool:
    try:
        return locate(module, qualname)[2] is installed.replacement
    except (AttributeError, LookupError):
        return False


def _apply_now(patch: Patch, module: ModuleType, *, late: bool) -> None:
    """Recognise and install one patch on an imported module; record the outcome. Lock held."""
    if patch.name not in _wanted:
        return
    previous = _installed.get(patch.name)
    if previous is not None:
        if _in_place(previous, module, patch.qualname):
            return
        # The body ran again (importlib.reload, or a re-import after the module left sys.modules) and
        # bound upstream's objects anew: fix those. Names bound to the earlier fix keep it until revert.
        _superseded.setdefault(patch.name, []).append(_installed.pop(patch.name))
        logger.info("%s ran again: re-applying %s", patch.module, patch.name)
    version = None
    unknown = unreadable = None
    try:
        version, problem = _installed_version(patch.requires)
        if problem:
            _record(patch, Status.SKIPPED, problem, version=version)
            return
        owner, attr, original = locate(module, patch.qualname)
        if original is MISSING:  # an inherited class attribute: recognise what the class sees
            original = getattr(owner, attr)
        ours = next((i.name for i in _installed.values() if i.replacement is original), None)
        if ours is not None:  # e.g. sgm's attention rebound a checkpoint gradpatch already fixed
            _record(patch, Status.SKIPPED, f"already gradpatch's fix (from {ours})", version=version)
            return
        identity = patch.recognise.identify(module, patch.qualname, original)
        if identity.verdict == "fixed":
            _record(patch, Status.SKIPPED, f"fixed upstream ({identity.label})", variant=identity.label, version=version)
            return
        if identity.verdict == "unknown":
            what = f"fingerprint {identity.label}" if _is_fingerprint(identity.label) else identity.label
            _record(patch, Status.SKIPPED, f"unknown code ({what})", variant=identity.label, version=version)
            unknown = identity.label
        elif identity.verdict == "unreadable":
            _record(patch, Status.SKIPPED, f"cannot be recognised: {identity.label}", version=version)
            unreadable = identity.label
        else:
            factory = resolve(patch.fix)
            in_use = [other.replacement for other in _installed.values()]
            installed = install(patch.name, module, patch.qualname, factory, late=late, in_use=in_use)  # type: ignore[arg-type]
    except Exception as exc:
        _record(patch, Status.FAILED, f"{type(exc).__name__}: {exc}", version=version)
        complain(PatchFailedWarning, f"gradpatch: patch {patch.name!r} failed on {patch.target} and "
                 f"was not applied: {type(exc).__name__}: {exc}")
        return
    if unknown is not None or unreadable is not None:  # outside the try: strict mode raises this
        # One warning per module, not one per patch on it (e.g. checkpoint and CheckpointFunction).
        names = [p.name for p in _index().get(patch.module, ()) if p.name in _wanted]
        said = "unknown code" if unknown is not None else "cannot be recognised"
        if not any(n != patch.name and n in _records and _records[n].reason.startswith(said) for n in names):
            if unknown is not None and _is_fingerprint(unknown):
                complain(UnknownCodeWarning, f"gradpatch: {patch.module} does not match any known version "
                         f"(fingerprint {unknown}), so gradpatch left it alone ({', '.join(names)}). "
                         "If it is a copy of the known-broken code, add this fingerprint to the catalogue.")
            elif unknown is not None:  # no fingerprint to add: say what was found instead
                wrapped = "not the module's own definition" in unknown
                complain(UnknownCodeWarning, f"gradpatch: {patch.module} was left alone ({', '.join(names)}): "
                         f"{unknown}. gradpatch replaces only code it recognises" + (
                             "; to have it patched, remove the wrapper (an import hook that wraps every "
                             "function, such as jaxtyping's install_import_hook, can be told to leave this "
                             "module out)" if wrapped else ""))
            else:
                complain(UnknownCodeWarning, f"gradpatch: cannot recognise {patch.module}, so gradpatch left "
                         f"it alone ({', '.join(names)}): {unreadable}.")
        return
    _installed[patch.name] = installed
    _record(patch, Status.APPLIED, patch.summary, variant=identity.label, version=version,
            rebound=installed.rebound_names())
    logger.info("applied %s to %s (%s)", patch.name, patch.target, identity.label)


def _is_fingerprint(label: str) -> bool:
    return len(label) == 16 and all(c in "0123456789abcdef" for c in label)


def _unseen(patch: Patch) -> str | None:
    """Why a wanted patch is not in place although its module's body has run, unseen (a loader
    gradpatch cannot watch, see :mod:`~gradpatch.patching.watcher`: imported, or reloaded, since), or
    None. Lock held."""
    record = _records.get(patch.name)
    module = sys.modules.get(patch.module)
    if record is None or patch.name not in _wanted or module is None or watcher.unloaded(module) \
            or watcher.running(module):
        return None
    installed = _installed.get(patch.name)
    if record.status == Status.APPLIED and installed is not None and _in_place(installed, module, patch.qualname):
        return None
    if record.status not in (Status.APPLIED, Status.DEFERRED):
        return None
    loader = (watcher.namespace(module) or {}).get("__loader__")
    return (f"{patch.module}'s body ran (loaded by {type(loader).__name__}) without gradpatch seeing it, so "
            f"{patch.target} is not gradpatch's fix; call gradpatch.apply() again to patch it now")
