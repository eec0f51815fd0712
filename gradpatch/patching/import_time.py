"""Patching at import time, while any patch is wanted: :func:`body_ran`, the one listener
:mod:`~gradpatch.patching.watcher` calls after every execution of a module body, applies the wanted
patches whose target is that module and, for any other module holding a family member's name, adopts
the copies of selected families :mod:`~gradpatch.patching.scan` finds in it. :func:`start` makes one
patch wanted (applied now, or when its module's body runs); :func:`sweep` examines the modules
imported before the scan was on. Used by :mod:`~gradpatch.patching.activation`, the layer above; the
state lives in :mod:`~gradpatch.patching.ledger`.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Iterable

from gradpatch import settings
from gradpatch.errors import PatchFailedWarning, complain
from gradpatch.patching import watcher
from gradpatch.patching import scan as scanning
from gradpatch.patching import scripts
from gradpatch.patching.ledger import LEDGER
from gradpatch.patching.patch import Patch, Record, Status


def body_ran(module: ModuleType, late: bool) -> None:
    """The watcher's listener: ``module``'s body has run. Cheap for the modules gradpatch has no
    business with (a dict lookup and a key test, no lock); never breaks the import (unless strict).
    A running script that has changed a family member's name since is examined too when an
    ``import`` statement of its own code ran this body (see :mod:`~gradpatch.patching.scripts`): no
    import ever ends a script's body, and this is a point between two of its statements."""
    namespace = watcher.namespace(module)
    name = namespace.get("__name__") if namespace is not None else None
    if isinstance(name, str) and (name in LEDGER.targets() or scanning.candidate(namespace)):  # type: ignore[arg-type]
        _patch(module, name, late)
    if scanning.enabled:
        for script in scanning.scripts(changed=True):
            if scripts.between_statements(script):
                scanning.examined(script)
                _patch(script, script.__name__, True)


def _patch(module: ModuleType, name: str, late: bool) -> None:
    try:
        on_import(module, late=late)
    except Exception as exc:
        if settings.strict:
            raise
        complain(PatchFailedWarning, f"gradpatch: error while patching {name}: {exc!r}")


def on_import(module: ModuleType, *, late: bool = False) -> list[Record]:
    """Apply every wanted patch that targets ``module``, whose body has just run; for a module no
    patch targets, adopt the copies of selected families the scan finds in it. The lock is taken only
    to patch: looking for a copy (most modules holding a member's name hold none, such as
    ``torch.utils.checkpoint``) never waits for a thread that holds it while importing."""
    name = module.__name__
    if name.partition(".")[0] == "gradpatch":
        return []
    if name in LEDGER.targets():
        with LEDGER.locked():
            for patch in LEDGER.targets().get(name, ()):
                LEDGER.apply_now(patch, module, late=late)
        return []
    namespace = watcher.namespace(module)
    if namespace is None or not scanning.candidate(namespace):
        return []
    selected = [family for family in scanning.families() if LEDGER.family_wanted(family.fixes())]
    found = scanning.copies(module, namespace, selected) if selected else []
    records: list[Record] = []
    if found:
        with LEDGER.locked():
            for family, patches in found:
                if LEDGER.family_wanted(family.fixes()):  # still: a revert may have run meanwhile
                    records += _adopt(patches, module, late=late, fixes=family.fixes())
    return records


def _adopt(patches: Iterable[Patch], module: ModuleType, *, late: bool, fixes: frozenset[str]) -> list[Record]:
    """Apply ``patches`` that :mod:`gradpatch.patching.scan` built for a family copy found in ``module``. They
    join this process's catalogue, so report(), revert(), a reload and every later selection of the
    family treat them as declared patches. Lock held."""
    patches = list(patches)
    new = LEDGER.adopt(patches, fixes)  # all of them first: one warning names every patch on the module
    for patch in new:
        LEDGER.apply_now(patch, module, late=late)
    return LEDGER.records(p.name for p in patches)


def sweep() -> list[Record]:
    """Adopt the copies in modules imported before the scan was on (or by a loader the watcher
    cannot see); a module still being imported is examined when its body finishes. Lock held."""
    records: list[Record] = []
    index = LEDGER.targets()
    for module in list(sys.modules.values()):
        namespace = watcher.namespace(module)
        if namespace is None or not scanning.candidate(namespace) or watcher.unloaded(module):
            continue  # nothing to find, or a lazy module not loaded yet: examined when it loads
        name = namespace.get("__name__")
        if not isinstance(name, str) or name in index:
            continue
        if watcher.running(module):
            watcher.defer(module)
            continue
        try:
            records += on_import(module, late=True)  # type: ignore[arg-type]
        except Exception as exc:
            if settings.strict:
                raise
            complain(PatchFailedWarning, f"gradpatch: error while scanning {name}: {exc!r}")
    return records


def start(patch: Patch) -> None:
    """Make ``patch`` wanted: apply it now, or when its module's body has run. Lock held."""
    LEDGER.want(patch)
    module = sys.modules.get(patch.module)
    if module is None:
        LEDGER.record(patch, Status.DEFERRED, f"waiting for {patch.module} to be imported")
    elif watcher.unloaded(module):
        LEDGER.record(patch, Status.DEFERRED, f"waiting for {patch.module}, imported lazily, to load on first use")
    elif watcher.running(module):
        # Its body is running right now (in another thread, or further up this thread's stack).
        LEDGER.record(patch, Status.DEFERRED, f"waiting for the import of {patch.module} in progress to finish")
        if not watcher.defer(module):
            complain(PatchFailedWarning, f"gradpatch: {patch.module} is being imported and its import "
                     f"cannot be watched, so {patch.name!r} is applied only if it is imported again; call "
                     "gradpatch.apply() again once that import has finished")
    else:
        LEDGER.apply_now(patch, module, late=True)
