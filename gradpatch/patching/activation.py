"""apply, revert, applied: choosing patches and putting them in place, at import time.

All state lives here, under one re-entrant lock: the known patches, which are wanted, what is
installed (in order, so revert is LIFO) and a :class:`~gradpatch.patching.registry.Record` per patch. Hooks run
in the importing thread after each execution of a target's body (first import, re-import, reload) and
take this lock; a failing fix is recorded and reported, never propagated into the user's ``import``
(unless strict). A fork resets the lock in the child, so a lock held by another thread of the parent
cannot deadlock it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from types import ModuleType
from typing import Iterable, Iterator

from gradpatch import environment, settings

from gradpatch.patching import selection
from gradpatch.errors import ConfigWarning, PatchFailedWarning, UnknownCodeWarning, complain, logger
from gradpatch.patching.hooks import MISSING, Installed, forget, install, locate, resolve, uninstall, watch, when_initialised
from gradpatch.patching.registry import Patch, Record, Report, Status
from gradpatch.patching.versions import _contains, _installed_version, split_requirement  # noqa: F401 (used by cli, tests)

_lock = threading.RLock()
_patches: dict[str, Patch] | None = None
_wanted: set[str] = set()
_installed: dict[str, Installed] = {}  # insertion order is install order
_superseded: dict[str, list[Installed]] = {}  # fixes of earlier executions of a reloaded module
_records: dict[str, Record] = {}
_requested: set[str] = set()  # patches added by request() (gradpatch.differentiable's string form)


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

            _patches = catalogue.load()
        return _patches


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
    unknown = None
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
            _record(patch, Status.SKIPPED, f"unknown code (fingerprint {identity.label})",
                    variant=identity.label, version=version)
            unknown = identity.label
        else:
            factory = resolve(patch.fix)
            in_use = [other.replacement for other in _installed.values()]
            installed = install(patch.name, module, patch.qualname, factory, late=late, in_use=in_use)  # type: ignore[arg-type]
    except Exception as exc:
        _record(patch, Status.FAILED, f"{type(exc).__name__}: {exc}", version=version)
        complain(PatchFailedWarning, f"gradpatch: patch {patch.name!r} failed on {patch.target} and "
                 f"was not applied: {type(exc).__name__}: {exc}")
        return
    if unknown is not None:  # outside the try: in strict mode this raises, recorded as skipped
        # One warning per module, not one per patch on it (e.g. checkpoint and CheckpointFunction).
        names = [p.name for p in known_patches().values() if p.module == patch.module and p.name in _wanted]
        if not any(n != patch.name and n in _records and _records[n].reason.startswith("unknown code")
                   for n in names):
            complain(UnknownCodeWarning, f"gradpatch: {patch.module} does not match any known version "
                     f"(fingerprint {unknown}), so gradpatch left it alone ({', '.join(names)}). "
                     "If it is a copy of the known-broken code, add this fingerprint to the catalogue.")
        return
    _installed[patch.name] = installed
    _record(patch, Status.APPLIED, patch.summary, variant=identity.label, version=version,
            rebound=installed.rebound_names())
    logger.info("applied %s to %s (%s)", patch.name, patch.target, identity.label)


def _on_import(module: ModuleType, *, late: bool = False) -> None:
    """Apply every wanted patch that targets ``module``, whose body has just run."""
    with _lock:
        for patch in known_patches().values():
            if patch.module == module.__name__:
                _apply_now(patch, module, late=late)


def _guarded_on_import(module: ModuleType, *, late: bool = False) -> None:
    # Whatever happens in here must not break the user's import (strict mode excepted).
    try:
        _on_import(module, late=True) if late else _on_import(module)  # benchmarks time _on_import(module)
    except Exception as exc:
        if settings.strict:
            raise
        complain(PatchFailedWarning, f"gradpatch: error while patching {module.__name__}: {exc!r}")


def _on_import_finished(module: ModuleType) -> None:
    # Called when an import that was already running at apply() finishes: another thread may have
    # bound names from the module meanwhile, so rebind as for a late apply.
    _guarded_on_import(module, late=True)


def _initialised(name: str) -> ModuleType | None:
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def _start(patch: Patch) -> None:
    """Make ``patch`` wanted: apply it now, or when its module's body has run. Lock held."""
    _wanted.add(patch.name)
    watch(patch.module, _guarded_on_import)  # every later execution of the body: import, reload
    module = sys.modules.get(patch.module)
    if module is not None and _initialised(patch.module) is None:
        # Its body is running right now (in another thread, or further up this thread's stack).
        _record(patch, Status.DEFERRED, f"waiting for the import of {patch.module} in progress to finish")
        if when_initialised(module, _on_import_finished):  # may call back at once: recorded first
            return
        module = _initialised(patch.module)
        if module is None:
            _record(patch, Status.DEFERRED, f"waiting for {patch.module} to be imported")
            complain(PatchFailedWarning, f"gradpatch: {patch.module} is being imported and its import "
                     f"cannot be watched, so {patch.name!r} is applied only if it is imported again; call "
                     "gradpatch.apply() again once that import has finished")
            return
    if module is None:
        _record(patch, Status.DEFERRED, f"waiting for {patch.module} to be imported")
    else:
        _apply_now(patch, module, late=True)


def apply(*names: str | Iterable[str], exclude: str | Iterable[str] | None = None, strict: bool | None = None,
          checkpoint: str | None = None, scan: bool | None = None) -> Report:
    """Apply patches now and on every later import of their targets.

    ``names`` are patch names (``"audioldm.checkpoint"``) or upstream names (``"audioldm"``,
    ``"f5_tts"``), each a string or an iterable of strings; none means every patch (or those
    ``GRADPATCH`` lists). ``exclude`` (a string or an iterable of strings) removes some (default:
    ``GRADPATCH_EXCLUDE``). ``strict=True`` raises :class:`~gradpatch.GradpatchError` where gradpatch
    would otherwise warn (default: ``GRADPATCH_STRICT``), also for the values of the ``GRADPATCH*``
    variables. ``checkpoint`` sets the process-wide checkpoint policy, ``"respect"``, ``"always"``,
    ``"never"`` or ``"budget:<size>"`` (default: ``GRADPATCH_CHECKPOINT``). Explicit arguments beat
    environment variables, which beat defaults. Strictness and policy are process-wide; if ``apply`` raises, strictness is
    put back as it was. ``scan`` finds copies of a selected family's code at any other path (see
    :mod:`gradpatch.patching.scan`; default: ``GRADPATCH_SCAN``, on).

    Targets already imported are patched at once, and module globals still holding an original
    object are rebound (and reported); the others are patched the moment they are imported, and
    again whenever their body runs again (``importlib.reload``). Applying twice changes nothing.
    Returns the report of the selected patches.
    """
    env = environment.read()
    previous = settings.set_strict(env.strict if strict is None else bool(strict))
    try:
        policy = checkpoint if checkpoint is not None else env.checkpoint
        if policy is not None:
            settings.set_checkpoint_policy(policy)
        return _apply(names, exclude, env, scan)
    except BaseException:
        settings.set_strict(previous)
        raise


def _apply(names: tuple, exclude: object, env: environment.Environment, scan: bool | None) -> Report:
    for problem in env.problems:  # now that strictness is known; once, as every apply() reads them
        complain(ConfigWarning, problem, once=True)
    source = "apply()"
    if not names and env.names:
        names, source = tuple(env.names), "GRADPATCH"
    exclude_source = "exclude="
    if exclude is None:
        exclude, exclude_source = env.exclude, "GRADPATCH_EXCLUDE"
    selected, excluded = select(names, exclude, source=source, exclude_source=exclude_source)  # type: ignore[arg-type]
    with _lock:
        for patch in excluded:
            if patch.name not in _wanted:
                _record(patch, Status.SKIPPED, "excluded")
        for patch in selected:
            if patch.name not in _wanted:
                _start(patch)
        from gradpatch.patching import scan as scanning

        found = scanning.start(env.scan if scan is None else bool(scan))
        return Report([_records[p.name] for p in selected + excluded if p.name in _records] + found)


def adopt(patches: Iterable[Patch], module: ModuleType, *, late: bool, fixes: frozenset[str]) -> list[Record]:
    """Apply ``patches`` that :mod:`gradpatch.patching.scan` built for a family copy found in ``module``, an
    undeclared path, while a wanted patch uses one of the family's ``fixes``. They join this
    process's catalogue, so report(), revert() and apply() treat them as declared patches."""
    with _lock:
        if not any(known_patches()[name].fix in fixes for name in _wanted):
            return []
        for patch in patches:
            if patch.name not in known_patches():
                known_patches()[patch.name] = patch
                _wanted.add(patch.name)
                _apply_now(patch, module, late=late)
        return [_records[p.name] for p in patches if p.name in _records]


def request(patch: Patch) -> Record:
    """Add ``patch`` to this process's catalogue and apply it now or when its module is imported
    (:func:`gradpatch.differentiable`'s string form). Requesting the same target again with other
    options reverts the earlier patch first; once reverted, it leaves the catalogue (a later
    ``apply()`` does not bring it back). Returns its record."""
    with _lock:
        known = known_patches()
        if patch.name in known and known[patch.name] != patch and patch.name in _wanted:
            revert(patch.name)
        known[patch.name] = patch
        _requested.add(patch.name)
        if patch.name not in _wanted:
            _start(patch)
        return _records[patch.name]


def revert(*names: str | Iterable[str]) -> Report:
    """Undo patches (all if no names), newest first, restoring the original objects themselves.

    A target that something else has replaced since is left alone with a
    :class:`~gradpatch.RevertWarning`. Reverted patches are no longer applied on later imports.
    """
    with _lock:
        chosen = select(names, source="revert()")[0] if names else [known_patches()[n] for n in _wanted]
        chosen_names = {p.name for p in chosen}
        for name in reversed(list(_installed)):
            if name in chosen_names:
                uninstall(_installed.pop(name))
        for name in chosen_names:
            for stale in reversed(_superseded.pop(name, [])):
                forget(stale)
        for patch in chosen:
            if patch.name in _wanted:
                _wanted.discard(patch.name)
                _record(patch, Status.REVERTED, "reverted")
            if patch.name in _requested:  # asked for once: a later apply() does not bring it back
                _requested.discard(patch.name)
                known_patches().pop(patch.name, None)
        return Report(_records[p.name] for p in chosen if p.name in _records)


@contextlib.contextmanager
def applied(*names: str | Iterable[str], exclude: str | Iterable[str] | None = None, strict: bool | None = None,
            checkpoint: str | None = None, scan: bool | None = None) -> Iterator[Report]:
    """Apply patches for the duration of a ``with`` block, then revert those this block applied
    (patches applied before it stay).

    ``strict`` and ``checkpoint`` (or their variables) hold only in the context that entered the
    block (its thread or asyncio task), for its duration: concurrent blocks do not see or undo each
    other's settings, and the process-wide ones are untouched. Patches are process-wide.
    """
    env = environment.read()
    overrides: dict[str, object] = {"strict": env.strict if strict is None else bool(strict)}
    policy = checkpoint if checkpoint is not None else env.checkpoint
    if policy is not None:
        overrides["checkpoint_policy"] = settings.check_policy(policy)
    with _lock:
        before = set(_wanted)
    with settings.scope(**overrides):
        try:
            yield _apply(names, exclude, env, scan)
        finally:
            with _lock:
                mine = [name for name in _wanted if name not in before]
            if mine:
                revert(*mine)


def report() -> Report:
    """What happened to every patch this process has selected: applied, deferred, skipped (with the
    reason), failed (with the error) or reverted."""
    with _lock:
        return Report(_records.values())
