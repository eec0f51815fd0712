"""apply, revert, applied, report: choosing patches and putting them in place, at import time.

While any patch is wanted, :mod:`~gradpatch.patching.watcher` calls one listener,
:func:`~gradpatch.patching.import_time.body_ran`, after every execution of a module body (first
import, re-import, reload, a lazy module's first use; any finder, any loader), in the executing
thread, before the importer binds names from the module. It applies the wanted patches whose target
is that module; for any other module holding a family member's name it asks
:mod:`~gradpatch.patching.scan` for copies of a selected family and adopts them: they join the known
patches, so a reload patches them again and every later selection of their family selects them. When
revert() leaves nothing wanted, the watcher stops and the import system is exactly as it was. The
state (what is known, wanted, installed, recorded) and applying one patch live in
:mod:`~gradpatch.patching.ledger` (its one :class:`~gradpatch.patching.ledger.Ledger`, asked through
its methods, under its lock).

Layers, lowest first, each importing only those below it: :mod:`~gradpatch.patching.watcher`
(imports nothing of gradpatch), :mod:`~gradpatch.patching.hooks` (install, rebind),
:mod:`~gradpatch.patching.scan` (recognise copies), :mod:`~gradpatch.patching.ledger`,
:mod:`~gradpatch.patching.import_time` (the listener, starting one patch), this module.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterable, Iterator

from gradpatch import environment, settings
from gradpatch.errors import ConfigWarning, PatchFailedWarning, complain
from gradpatch.patching import watcher
from gradpatch.patching import scan as scanning
from gradpatch.patching import adoption, scripts
from gradpatch.patching.ledger import LEDGER, known_patches, select
from gradpatch.patching import import_time
from gradpatch.patching.patch import Patch, Record, Report, Status


def apply(*names: str | Iterable[str], exclude: str | Iterable[str] | None = None, strict: bool | None = None,
          checkpoint: str | None = None, scan: bool | None = None) -> Report:
    """Apply patches now and on every later import of their targets.

    ``names`` are patch names (``"audioldm.checkpoint"``) or upstream names (``"audioldm"``,
    ``"f5_tts"``), each a string or an iterable of strings; none means every patch (or those
    ``GRADPATCH`` lists). ``exclude`` (a string or an iterable of strings) removes some (default:
    ``GRADPATCH_EXCLUDE``). ``strict=True`` raises :class:`~gradpatch.GradpatchError` where gradpatch
    would otherwise warn (default: ``GRADPATCH_STRICT``), also for the values of the ``GRADPATCH*``
    variables. ``checkpoint`` sets the process-wide checkpoint policy, ``"respect"``, ``"always"``,
    ``"never"``, ``"budget:<size>"`` or ``"peak:<size>"`` (default: ``GRADPATCH_CHECKPOINT``). Explicit arguments beat
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
            settings.set_checkpoint_policy(policy, by_apply=True)
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
    scan_on = env.scan if scan is None else bool(scan)
    with LEDGER.locked():
        for patch in excluded:
            if not LEDGER.is_wanted(patch.name):
                LEDGER.record(patch, Status.SKIPPED, "excluded")
        scanning.enabled = scan_on
        if scan_on:
            scanning.families()
        if selected:
            watcher.start(import_time.body_ran)
            if scan_on:
                scripts.watch_exit()
        for patch in selected:
            if not LEDGER.is_wanted(patch.name) or LEDGER.unseen(patch):
                import_time.start(patch)
        # Copies the scan adopted earlier are part of every selection of their family.
        again = LEDGER.copies_to_restart() if scan_on else []
        for patch in again:
            import_time.start(patch)
        found = import_time.sweep() if scan_on and selected else []
        adopted, problems = adoption.from_environment(known_patches(), scanning.families())
        for problem in problems:
            complain(ConfigWarning, problem, once=True)
        records = [request(patch) for patch in adopted]
        return Report(LEDGER.records(p.name for p in selected + excluded + again) + found + records)


def request(patch: Patch) -> Record:
    """Add ``patch`` to this process's catalogue and apply it now or when its module is imported
    (:func:`gradpatch.differentiable`'s string form). Requesting the same target again with other
    options reverts the earlier patch first; once reverted, it leaves the catalogue (a later
    ``apply()`` does not bring it back). Returns its record."""
    with LEDGER.locked():
        known = known_patches()
        if patch.name in known and known[patch.name] != patch and LEDGER.is_wanted(patch.name):
            revert(patch.name)
        LEDGER.add_requested(patch)
        if not LEDGER.is_wanted(patch.name):
            watcher.start(import_time.body_ran)
            import_time.start(patch)
        return LEDGER.record_of(patch.name)  # type: ignore[return-value]


def adopt(target: str, like: str) -> Record:
    """Patch ``target`` (``"module:Qual.name"``), a copy gradpatch does not recognise, with the fix
    of the catalogued patch ``like`` (``"audioldm.checkpoint"``; ``gradpatch list`` names them): the
    one line an :class:`~gradpatch.UnknownCodeWarning` prints. An imported module is patched at once,
    one imported later when its body runs; ``revert()`` (or ``revert(target)``) puts the original back.
    Adopting the same target again changes nothing; with another ``like``, the new fix replaces the
    old. Raises :class:`ValueError` for a malformed target, an unknown ``like``, an imported module
    without that attribute, or an object of another kind than ``like`` fixes (a function for a class).
    ``GRADPATCH_ADOPT="module:Qual.name=patch,..."`` does the same at every ``apply()``. Returns the
    target's record (``status`` ``"applied"``, or ``"deferred"`` until the module is imported). See
    :mod:`gradpatch.patching.adoption`."""
    patch = adoption.build(target, like, known_patches(), scanning.families())
    with LEDGER.locked():
        if LEDGER.is_wanted(patch.name):
            if known_patches().get(patch.name) == patch:
                return LEDGER.record_of(patch.name)  # type: ignore[return-value]
            revert(patch.name)  # adopted like another patch before: the original is checked
        adoption.check_now(patch, sys.modules)
        record = request(patch)
        if record.status == Status.FAILED:
            revert(patch.name)
            raise adoption.AdoptionError(f"gradpatch.adopt: {record.reason}")
        return LEDGER.record_of(patch.name)  # type: ignore[return-value]


def revert(*names: str | Iterable[str]) -> Report:
    """Undo patches (all if no names), newest first, restoring the original objects themselves.

    A target that something else has replaced since is left alone with a
    :class:`~gradpatch.RevertWarning`. Reverted patches are no longer applied on later imports. When
    nothing is left applied, the checkpoint policy that ``apply(checkpoint=...)`` (or
    ``GRADPATCH_CHECKPOINT``) set is put back as it was before, unless it was set otherwise since.
    """
    with LEDGER.locked():
        chosen = select(names, source="revert()")[0] if names else [known_patches()[n] for n in LEDGER.wanted()]
        # A copy the scan adopted goes with the last wanted declared patch of its family.
        chosen += LEDGER.copies_going_with({p.name for p in chosen})
        LEDGER.withdraw(chosen)
        if not LEDGER.wanted():
            watcher.stop()  # the import system exactly as it was
            settings.undo_applied_policy()  # and the checkpoint policy, if apply(checkpoint=...) set it
        return Report(LEDGER.records(p.name for p in chosen))


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
    with LEDGER.locked():
        before = set(LEDGER.wanted())
    with settings.scope(**overrides):
        try:
            yield _apply(names, exclude, env, scan)
        finally:
            with LEDGER.locked():
                mine = [name for name in LEDGER.wanted() if name not in before]
            if mine:
                revert(*mine)


def report() -> Report:
    """What happened to every patch this process has selected: applied, deferred, skipped (with the
    reason), failed (with the error) or reverted. A patch not in place although its module's body has
    run (by a loader gradpatch cannot watch) says so, and is warned about once; so does a copy the
    running script defined after gradpatch last examined it (:mod:`~gradpatch.patching.scripts`)."""
    with LEDGER.locked():
        if scanning.enabled:
            with settings.scope(strict=False):  # a report is for reading: it never raises
                scripts.report_unpatched()
        for name in [name for name in LEDGER.wanted() if LEDGER.record_of(name) is not None]:
            why = LEDGER.unseen(known_patches()[name])
            if why is not None and LEDGER.record_of(name).reason != why:  # type: ignore[union-attr]
                LEDGER.record(known_patches()[name], Status.DEFERRED, why)
                if not settings.strict:  # a report is for reading: it never raises
                    complain(PatchFailedWarning, f"gradpatch: {name!r} is not applied: {why}", once=True)
        return Report(LEDGER.records())
