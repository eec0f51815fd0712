"""apply, revert, applied: choosing patches and putting them in place, at import time.

All state lives here, under one re-entrant lock: the known patches, which are wanted, what is
installed (in order, so revert is LIFO) and a :class:`~gradpatch.registry.Record` per patch. Hooks run
outside wrapt's lock and take this one; a failing fix is recorded and reported, never propagated into
the user's ``import`` (unless strict).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from types import ModuleType
from typing import Iterable, Iterator

from gradpatch import environment, settings
from gradpatch.errors import ConfigWarning, PatchFailedWarning, UnknownCodeWarning, complain, logger
from gradpatch.hooks import MISSING, Installed, install, locate, resolve, uninstall, watch
from gradpatch.registry import Patch, Record, Report, Status

_lock = threading.RLock()
_patches: dict[str, Patch] | None = None
_wanted: set[str] = set()
_installed: dict[str, Installed] = {}  # insertion order is install order
_records: dict[str, Record] = {}


def known_patches() -> dict[str, Patch]:
    """Every declared patch by name (the built-in catalogue, then plug-ins)."""
    global _patches
    with _lock:
        if _patches is None:
            from gradpatch import catalogue

            _patches = catalogue.load()
        return _patches


def _normalise(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def select(names: Iterable[str] = (), exclude: Iterable[str] = (), *, source: str = "apply()",
           exclude_source: str = "exclude") -> tuple[list[Patch], list[Patch]]:
    """``(selected, excluded)`` patches for names of patches or of upstream packages.

    No names means every patch. Unknown names are reported (with the closest known name) and ignored.
    """
    patches = known_patches()
    vocabulary = {_normalise(p.name) for p in patches.values()} | {_normalise(p.upstream) for p in patches.values()}

    def matching(requested: Iterable[str], source: str) -> set[str]:
        chosen: set[str] = set()
        for raw in requested:
            name = _normalise(raw)
            if not name:
                continue
            hits = {p.name for p in patches.values() if name in (_normalise(p.name), _normalise(p.upstream))}
            if not hits:
                import difflib

                close = difflib.get_close_matches(name, sorted(vocabulary), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                complain(ConfigWarning, f"gradpatch: unknown patch {raw!r} in {source}; {hint}"
                         "`gradpatch list` shows every patch and upstream name")
            chosen |= hits
        return chosen

    names = list(names)
    wanted = matching(names, source) if names else set(patches)
    dropped = matching(exclude, exclude_source)
    selected = [p for p in patches.values() if p.name in wanted and p.name not in dropped]
    excluded = [p for p in patches.values() if p.name in wanted and p.name in dropped]
    return selected, excluded


def _record(patch: Patch, status: Status, reason: str = "", **fields: object) -> None:
    _records[patch.name] = Record(patch.name, patch.upstream, patch.target, status, reason, **fields)  # type: ignore[arg-type]


_OPERATORS = {">=": "__ge__", "<=": "__le__", "==": "__eq__", "!=": "__ne__", ">": "__gt__", "<": "__lt__"}


def _plain(version: str) -> bool:
    return all(part.isdigit() for part in version.split("."))


def split_requirement(requires: str) -> tuple[str, str]:
    """``("f5-tts", ">=1.0,<2")`` from ``"f5-tts>=1.0,<2"``."""
    cut = next((i for i, c in enumerate(requires) if c in "<>=!~ ;,["), len(requires))
    return requires[:cut].strip(), requires[cut:].strip()


def _contains(specifier: str, found: str) -> bool:
    """PEP 440 containment, prereleases included (tests check it against ``SpecifierSet``).

    This runs inside the user's ``import`` of a target, where ``packaging.specifiers`` would cost
    ~15 ms: plain release numbers compare as integer tuples, other simple clauses with
    ``packaging.version``, and only ``~=``, ``===`` and wildcards with ``SpecifierSet``."""
    clauses = [c.strip() for c in specifier.split(",") if c.strip()]
    operators = [next((op for op in (c[:2], c[:1]) if op in _OPERATORS), None) for c in clauses]
    simple = [(op, c[len(op):].strip()) for op, c in zip(operators, clauses) if op is not None]
    if len(simple) != len(clauses) or any("*" in bound for _, bound in simple):
        from packaging.specifiers import SpecifierSet  # ~=, ===, wildcards

        return SpecifierSet(specifier).contains(found, prereleases=True)
    if all(_plain(v) for v in [found] + [bound for _, bound in simple]):
        # Release numbers only (the usual case): spare importing packaging.version (~5 ms).
        width = max(len(v.split(".")) for v in [found] + [bound for _, bound in simple])
        key = lambda v: tuple(map(int, v.split("."))) + (0,) * (width - len(v.split(".")))  # noqa: E731
        return all(getattr(key(found), _OPERATORS[op])(key(bound)) for op, bound in simple)
    from packaging.version import Version

    version = Version(found)
    for op, text in simple:
        bound = Version(text)
        if op == "<" and not bound.is_prerelease:  # PEP 440: <V excludes V's pre-releases
            version_seen = Version(version.base_version)
        elif op == ">" and not bound.is_postrelease and version.is_postrelease:  # and >V its post-releases
            version_seen = Version(version.base_version)
            if version_seen == bound:
                return False
        else:
            version_seen = version
        if not getattr(version_seen, _OPERATORS[op])(bound):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _installed_version(requires: str | None) -> tuple[str | None, str | None]:
    """``(version, problem)``: the installed distribution's version and why it is out of range."""
    if not requires:
        return None, None
    from importlib.metadata import PackageNotFoundError, version

    name, specifier = split_requirement(requires)
    try:
        found = version(name)
    except PackageNotFoundError:
        return None, None  # a vendored copy: the fingerprint decides
    if specifier and not _contains(specifier, found):
        return found, f"{name} {found} is outside the supported range {specifier}"
    return found, None


def _apply_now(patch: Patch, module: ModuleType, *, late: bool) -> None:
    """Recognise and install one patch on an imported module; record the outcome. Lock held."""
    if patch.name in _installed or patch.name not in _wanted:
        return
    version = None
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
            complain(UnknownCodeWarning, f"gradpatch: {patch.target} does not match any known version "
                     f"(fingerprint {identity.label}), so {patch.name!r} left it alone. If it is a copy "
                     "of the known-broken code, add this fingerprint to the catalogue.")
            return
        factory = resolve(patch.fix)
        in_use = [other.replacement for other in _installed.values()]
        installed = install(patch.name, module, patch.qualname, factory, late=late, in_use=in_use)  # type: ignore[arg-type]
    except Exception as exc:
        _record(patch, Status.FAILED, f"{type(exc).__name__}: {exc}", version=version)
        complain(PatchFailedWarning, f"gradpatch: patch {patch.name!r} failed on {patch.target} and "
                 f"was not applied: {type(exc).__name__}: {exc}")
        return
    _installed[patch.name] = installed
    _record(patch, Status.APPLIED, patch.summary, variant=identity.label, version=version,
            rebound=installed.rebound_names())
    logger.info("applied %s to %s (%s)", patch.name, patch.target, identity.label)


def _on_import(module: ModuleType) -> None:
    """wrapt post-import hook: apply every wanted patch that targets ``module``."""
    with _lock:
        for patch in known_patches().values():
            if patch.module == module.__name__:
                _apply_now(patch, module, late=False)


def _initialised(name: str) -> ModuleType | None:
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def apply(*names: str, exclude: Iterable[str] | None = None, strict: bool | None = None,
          checkpoint: str | None = None) -> Report:
    """Apply patches now and on every later import of their targets.

    ``names`` are patch names (``"audioldm.checkpoint"``) or upstream names (``"audioldm"``,
    ``"f5_tts"``); none means every patch (or those ``GRADPATCH`` lists). ``exclude`` removes some
    (default: ``GRADPATCH_EXCLUDE``). ``strict=True`` raises :class:`~gradpatch.GradpatchError` where
    gradpatch would otherwise warn (default: ``GRADPATCH_STRICT``). ``checkpoint`` sets the
    checkpoint policy, ``"respect"``, ``"always"``, ``"never"`` or ``"budget:<size>"`` (default:
    ``GRADPATCH_CHECKPOINT``).
    Explicit arguments beat environment variables, which beat defaults.

    Targets already imported are patched at once, and module globals still holding an original
    object are rebound (and reported); the others are patched the moment they are imported.
    Applying twice changes nothing. Returns the report of the selected patches.
    """
    env = environment.read()
    settings.strict = env.strict if strict is None else bool(strict)
    if checkpoint is not None or env.checkpoint is not None:
        settings.set_checkpoint_policy(checkpoint if checkpoint is not None else env.checkpoint)  # type: ignore[arg-type]
    source = "apply()"
    if not names and env.names:
        names, source = tuple(env.names), "GRADPATCH"
    exclude_source = "exclude="
    if exclude is None:
        exclude, exclude_source = env.exclude, "GRADPATCH_EXCLUDE"
    selected, excluded = select(names, exclude, source=source, exclude_source=exclude_source)
    with _lock:
        for patch in excluded:
            if patch.name not in _wanted:
                _record(patch, Status.SKIPPED, "excluded")
        for patch in selected:
            if patch.name in _wanted:
                continue
            _wanted.add(patch.name)
            module = _initialised(patch.module)
            if module is None:
                _record(patch, Status.DEFERRED, f"waiting for {patch.module} to be imported")
                watch(patch.module, _guarded_on_import)
            else:
                _apply_now(patch, module, late=True)
        return Report(_records[p.name] for p in selected + excluded if p.name in _records)


def _guarded_on_import(module: ModuleType) -> None:
    # Whatever happens in here must not break the user's import (strict mode excepted).
    try:
        _on_import(module)
    except Exception as exc:
        if settings.strict:
            raise
        complain(PatchFailedWarning, f"gradpatch: error while patching {module.__name__}: {exc!r}")


def revert(*names: str) -> Report:
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
        for patch in chosen:
            if patch.name in _wanted:
                _wanted.discard(patch.name)
                _record(patch, Status.REVERTED, "reverted")
        return Report(_records[p.name] for p in chosen if p.name in _records)


@contextlib.contextmanager
def applied(*names: str, exclude: Iterable[str] | None = None, strict: bool | None = None,
            checkpoint: str | None = None) -> Iterator[Report]:
    """Apply patches for the duration of a ``with`` block, then revert those this block applied
    (patches applied before it stay) and restore the checkpoint policy and strictness."""
    with _lock:
        before = set(_wanted)
    policy, was_strict = settings.checkpoint_policy, settings.strict
    try:
        yield apply(*names, exclude=exclude, strict=strict, checkpoint=checkpoint)
    finally:
        with _lock:
            mine = [name for name in _wanted if name not in before]
        if mine:
            revert(*mine)
        settings.set_checkpoint_policy(policy)
        settings.strict = was_strict


def report() -> Report:
    """What happened to every patch this process has selected: applied, deferred, skipped (with the
    reason), failed (with the error) or reverted."""
    with _lock:
        return Report(_records.values())


def activate_from_env() -> Report | None:
    """Apply what the ``GRADPATCH*`` environment variables ask for; the startup file calls this."""
    env = environment.read()
    if env.log_level is not None:
        _configure_logging(env.log_level)
    if not env.enabled:
        return None
    return apply()


def _configure_logging(level: int) -> None:
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("gradpatch: %(message)s"))
        logger.addHandler(handler)
