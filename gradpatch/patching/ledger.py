"""What gradpatch knows, wants, has installed and has recorded, and applying one patch.

:data:`LEDGER`, the one :class:`Ledger` of the process, owns the state behind
:mod:`gradpatch.patching.activation`, under one re-entrant lock: the known patches (the catalogue, and
the copies the scan adopted), which are wanted, what is installed (in order, so revert is LIFO), the
fixes of earlier executions of a reloaded module, and a :class:`~gradpatch.patching.patch.Record` per
patch. Everyone else asks it through its methods; a sequence of them that must not interleave with
another thread's runs inside ``with LEDGER.locked():``. :meth:`Ledger.apply_now` recognises and
installs one patch on a module whose body has run, and records the outcome; a failing fix is recorded
and warned about, never raised into the user's ``import`` (unless strict). A fork resets the lock in
the child, so a lock held by another thread of the parent cannot deadlock it.
"""
from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Iterable

from gradpatch.errors import PatchFailedWarning, UnknownCodeWarning, complain, logger
from gradpatch.patching import adoption, selection, watcher
from gradpatch.patching.catalogue import Catalogue
from gradpatch.patching.hooks import MISSING, Installed, forget, install, locate, resolve, uninstall
from gradpatch.patching.patch import Patch, Record, Status
from gradpatch.patching.unknown_code import is_fingerprint, left_alone_message
from gradpatch.patching.versions import installed_version


class Ledger:
    """The live patch state of this process. Methods marked "lock held" expect the caller to be
    inside :meth:`locked`; the others take it themselves or read a snapshot without it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._patches: Catalogue | None = None
        self._wanted: set[str] = set()
        self._installed: dict[str, Installed] = {}  # insertion order is install order
        self._superseded: dict[str, list[Installed]] = {}  # fixes of earlier executions of a reloaded module
        self._records: dict[str, Record] = {}
        self._adopted: dict[str, frozenset[str]] = {}  # copies the scan found: patch name -> their family's fixes
        self._requested: set[str] = set()  # patches added by request() (gradpatch.differentiable's string form)
        self._targets: dict[str, list[Patch]] = {}  # module name -> known patches on it (see targets)
        self._indexed = -1  # self._patches.changes when self._targets was built

    def locked(self) -> threading.RLock:
        """The lock, for ``with``: what runs inside sees and changes the state as one step."""
        return self._lock

    def _reset_lock(self) -> None:
        self._lock = threading.RLock()

    # What is known, wanted, installed, recorded.

    def known(self) -> Catalogue:
        """Every known patch by name (the built-in catalogue, then plug-ins, requests and adopted copies)."""
        with self._lock:
            if self._patches is None:
                from gradpatch.patching import catalogue

                self._patches = Catalogue(catalogue.load())
            return self._patches

    def targets(self) -> dict[str, list[Patch]]:
        """Known patches by target module, rebuilt when the catalogue changed (the scan, a request)."""
        patches = self._patches
        if patches is None:
            return {}
        if patches.changes != self._indexed:  # no lock: every import asks, and must never wait for another thread
            changes = patches.changes  # read first: a change while building leaves the index stale, not wrong
            known = list(patches.values())  # one C call: no other thread runs during it
            targets: dict[str, list[Patch]] = {}
            for patch in known:
                targets.setdefault(patch.module, []).append(patch)
            self._targets, self._indexed = targets, changes
        return self._targets

    def is_wanted(self, name: str) -> bool:
        return name in self._wanted

    def wanted(self) -> list[str]:
        """The wanted patches' names (a snapshot)."""
        return list(self._wanted)

    def is_installed(self, name: str) -> bool:
        return name in self._installed

    def record_of(self, name: str) -> Record | None:
        return self._records.get(name)

    def records(self, names: Iterable[str] | None = None) -> list[Record]:
        """The records of ``names`` that have one, in that order (default: every record)."""
        if names is None:
            return list(self._records.values())
        return [self._records[name] for name in names if name in self._records]

    def record(self, patch: Patch, status: Status, reason: str = "", **fields: object) -> None:
        self._records[patch.name] = Record(patch.name, patch.upstream, patch.target, status, reason, **fields)  # type: ignore[arg-type]

    # Changing what is wanted. Lock held.

    def want(self, patch: Patch) -> None:
        self._wanted.add(patch.name)

    def add_requested(self, patch: Patch) -> None:
        """``patch`` joins the catalogue until it is reverted (:func:`gradpatch.differentiable`'s string form)."""
        self.known()[patch.name] = patch
        self._requested.add(patch.name)

    def adopt(self, patches: Iterable[Patch], fixes: frozenset[str]) -> list[Patch]:
        """Copies the scan built for a family with ``fixes``: those not known yet join the catalogue,
        wanted, as the family's copies. Returns them."""
        new = [patch for patch in patches if patch.name not in self.known()]
        for patch in new:
            self.known()[patch.name] = patch
            self._adopted[patch.name] = fixes
            self._wanted.add(patch.name)
        return new

    def family_wanted(self, fixes: frozenset[str]) -> bool:
        """Whether a wanted declared patch uses one of a family's ``fixes``: its copies are wanted then.
        Reads snapshots, without the lock."""
        patches: dict[str, Patch] = self._patches or {}
        return any(getattr(patches.get(name), "fix", None) in fixes
                   for name in list(self._wanted) if name not in self._adopted)

    def copies_to_restart(self) -> list[Patch]:
        """Copies the scan adopted earlier, not wanted now, whose family is wanted again: part of every
        selection of their family. Lock held."""
        return [self.known()[name] for name, fixes in self._adopted.items()
                if name not in self._wanted and self.family_wanted(fixes)]

    def copies_going_with(self, chosen: set[str]) -> list[Patch]:
        """The adopted copies that go when ``chosen`` are reverted: those of a family none of whose
        declared patches stays wanted. Lock held."""
        left = self._wanted - chosen
        return [self.known()[name] for name, fixes in self._adopted.items()
                if name in left and not any(self.known()[n].fix in fixes for n in left if n not in self._adopted)]

    def withdraw(self, chosen: list[Patch]) -> None:
        """Take ``chosen`` out, newest first, and make them unwanted (recorded as reverted); a requested
        patch leaves the catalogue. Lock held."""
        names = {patch.name for patch in chosen}
        for name in reversed(list(self._installed)):
            if name in names:
                uninstall(self._installed.pop(name))
        for name in names:
            for stale in reversed(self._superseded.pop(name, [])):
                forget(stale)
        for patch in chosen:
            if patch.name in self._wanted:
                self._wanted.discard(patch.name)
                self.record(patch, Status.REVERTED, "reverted")
            if patch.name in self._requested:  # asked for once: a later apply() does not bring it back
                self._requested.discard(patch.name)
                self.known().pop(patch.name, None)

    # Applying one patch.

    def apply_now(self, patch: Patch, module: ModuleType, *, late: bool) -> None:
        """Recognise and install one patch on an imported module; record the outcome. Lock held."""
        if patch.name not in self._wanted:
            return
        previous = self._installed.get(patch.name)
        if previous is not None:
            if _in_place(previous, module, patch.qualname):
                return
            # The body ran again (importlib.reload, or a re-import after the module left sys.modules) and
            # bound upstream's objects anew: fix those. Names bound to the earlier fix keep it until revert.
            self._superseded.setdefault(patch.name, []).append(self._installed.pop(patch.name))
            logger.info("%s ran again: re-applying %s", patch.module, patch.name)
        version = None
        unknown = unreadable = None
        try:
            version, problem = installed_version(patch.requires)
            if problem:
                self.record(patch, Status.SKIPPED, problem, version=version)
                return
            try:
                owner, attr, original = locate(module, patch.qualname)
            except LookupError as absent:  # this version or copy (AudioX's stable_audio_tools) lacks it
                self.record(patch, Status.SKIPPED, f"not defined here: {absent}", version=version)
                return
            if original is MISSING:  # an inherited class attribute: recognise what the class sees
                original = getattr(owner, attr)
            ours = next((i.name for i in self._installed.values() if i.replacement is original), None)
            if ours is not None:  # e.g. sgm's attention rebound a checkpoint gradpatch already fixed
                self.record(patch, Status.SKIPPED, f"already gradpatch's fix (from {ours})", version=version)
                return
            instead = self.adopted_instead(patch)
            if instead is not None:  # the user adopted this target: their choice stands
                self.record(patch, Status.SKIPPED, f"adopted instead ({instead})", version=version)
                return
            identity = patch.recognise.identify(module, patch.qualname, original)
            if identity.verdict == "fixed":
                self.record(patch, Status.SKIPPED, f"fixed upstream ({identity.label})", variant=identity.label,
                            version=version)
                return
            if identity.verdict == "unknown":
                what = f"fingerprint {identity.label}" if is_fingerprint(identity.label) else identity.label
                self.record(patch, Status.SKIPPED, f"unknown code ({what})", variant=identity.label, version=version)
                unknown = identity.label
            elif identity.verdict == "unreadable":
                self.record(patch, Status.SKIPPED, f"cannot be recognised: {identity.label}", version=version)
                unreadable = identity.label
            else:
                factory = resolve(patch.fix)
                in_use = [other.replacement for other in self._installed.values()]
                installed = install(patch.name, module, patch.qualname, factory, late=late, in_use=in_use)  # type: ignore[arg-type]
        except Exception as exc:
            self.record(patch, Status.FAILED, f"{type(exc).__name__}: {exc}", version=version)
            complain(PatchFailedWarning, f"gradpatch: patch {patch.name!r} failed on {patch.target} and "
                     f"was not applied: {type(exc).__name__}: {exc}")
            return
        if unknown is not None or unreadable is not None:  # outside the try: strict mode raises this
            self._left_alone(patch, unknown, unreadable)
            return
        self._installed[patch.name] = installed
        self.record(patch, Status.APPLIED, patch.summary, variant=identity.label, version=version,
                    rebound=installed.rebound_names())
        if patch.upstream == adoption.ADOPTED:
            self.note_adopted(patch)
        logger.info("applied %s to %s (%s)", patch.name, patch.target, identity.label)

    def _left_alone(self, patch: Patch, unknown: str | None, unreadable: str | None) -> None:
        # One warning per module, not one per patch on it (e.g. checkpoint and CheckpointFunction).
        names = [p.name for p in self.targets().get(patch.module, ()) if p.name in self._wanted]
        said = "unknown code" if unknown is not None else "cannot be recognised"
        records = self._records
        if any(n != patch.name and n in records and records[n].reason.startswith(said) for n in names):
            return
        left = [self.known()[n] for n in names]
        complain(UnknownCodeWarning, left_alone_message(patch.module, left, unknown, unreadable,
                                                        self.known(), self._adopted))

    def adopted_instead(self, patch: Patch) -> str | None:
        """The wanted adopted patch on ``patch``'s target, if ``patch`` is not that one. Lock held."""
        if patch.upstream == adoption.ADOPTED:
            return None
        return next((p.name for p in self.targets().get(patch.module, ()) if p.upstream == adoption.ADOPTED
                     and p.target == patch.target and p.name in self._wanted), None)

    def note_adopted(self, patch: Patch) -> None:
        """The other wanted patches on adopted ``patch``'s target that left it alone say so. Lock held."""
        for other in self.targets().get(patch.module, ()):
            record = self._records.get(other.name)
            if other.name != patch.name and other.target == patch.target and record is not None \
                    and record.status == Status.SKIPPED and other.name in self._wanted:
                self.record(other, Status.SKIPPED, f"adopted instead ({patch.name}); was: {record.reason}",
                            variant=record.variant, version=record.version)

    def unseen(self, patch: Patch) -> str | None:
        """Why a wanted patch is not in place although its module's body has run, unseen (a loader
        gradpatch cannot watch, see :mod:`~gradpatch.patching.watcher`: imported, or reloaded, since),
        or None. Lock held."""
        record = self._records.get(patch.name)
        module = sys.modules.get(patch.module)
        if record is None or patch.name not in self._wanted or module is None or watcher.unloaded(module) \
                or watcher.running(module):
            return None
        installed = self._installed.get(patch.name)
        if record.status == Status.APPLIED and installed is not None and _in_place(installed, module, patch.qualname):
            return None
        if record.status not in (Status.APPLIED, Status.DEFERRED):
            return None
        loader = (watcher.namespace(module) or {}).get("__loader__")
        return (f"{patch.module}'s body ran (loaded by {type(loader).__name__}) without gradpatch seeing it, so "
                f"{patch.target} is not gradpatch's fix; call gradpatch.apply() again to patch it now")


def _in_place(installed: Installed, module: ModuleType, qualname: str) -> bool:
    try:
        return locate(module, qualname)[2] is installed.replacement
    except (AttributeError, LookupError):
        return False


#: The live patch state of this process.
LEDGER = Ledger()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: LEDGER._reset_lock())


def known_patches() -> dict[str, Patch]:
    """Every declared patch by name (the built-in catalogue, then plug-ins)."""
    return LEDGER.known()


def select(names: Iterable[object] = (), exclude: object = (), *, source: str = "apply()",
           exclude_source: str = "exclude") -> tuple[list[Patch], list[Patch]]:
    """``(selected, excluded)`` among :func:`known_patches`: see :func:`gradpatch.patching.selection.select`."""
    return selection.select(known_patches(), names, exclude, source=source, exclude_source=exclude_source)
