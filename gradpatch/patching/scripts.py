"""Copies of a family that the running script itself defines, and saying so when they are not patched.

``python train.py``, ``python -m pkg.train`` and ``runpy.run_path`` run a script's body as no import
does: nothing tells gradpatch when it has defined something, so a copy of the OpenAI/CompVis
checkpoint written into the script cannot be patched the moment it is defined, as a module's can.
:mod:`gradpatch.patching.activation` examines the script (:func:`gradpatch.patching.scan.scripts`)
whenever ``apply()`` runs, and at the end of a module body that an ``import`` statement of the
script's own code runs after the script changed a family member's name: a copy defined before either
is patched. One defined after the last of them
(``GRADPATCH=1`` applies at interpreter start, before the script's first line) is found here by
``report()``, which gives it a ``skipped`` row saying why and what to do, and at interpreter exit;
either way one warning says it was not patched.
"""
from __future__ import annotations

import atexit
import sys
from types import FrameType, ModuleType
from typing import Any

from gradpatch import settings
from gradpatch.errors import PatchFailedWarning, complain
from gradpatch.patching import scan as scanning
from gradpatch.patching import watcher
from gradpatch.patching.ledger import LEDGER
from gradpatch.patching.patch import Patch, Status

_watching_exit = False
_warned: set[tuple[str, str]] = set()  # (script, members) said not patched: said once
#: The modules whose frames stand between an ``import`` statement and the listener.
_IMPORT_MACHINERY = ("importlib", "gradpatch.patching.", "_frozen_importlib")


def unpatched() -> list[tuple[ModuleType, Any, list[Patch]]]:
    """``(script module, family, patches)`` for each copy of a wanted family that a running script
    defines and gradpatch has never examined (a copy it examined is applied, or recorded with why not)."""
    candidates = scanning.scripts()
    selected = [family for family in scanning.families() if LEDGER.family_wanted(family.fixes())] if candidates else []
    found = []
    for module in candidates if selected else []:
        namespace = watcher.namespace(module) or {}
        for family, patches in scanning.copies(module, namespace, selected):
            new = [patch for patch in patches if patch.name not in LEDGER.known()]
            if new:
                found.append((module, family, new))
    return found


def between_statements(script: ModuleType) -> bool:
    """Whether the import being delivered now is an ``import`` statement of ``script``'s own code (at
    its top level, or in one of its functions such as ``main()``): the script is between two of its
    statements, not inside a library call that imports lazily (such as a forward pass, maybe through
    the very copy to be replaced)."""
    namespace = watcher.namespace(script)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__")).startswith(_IMPORT_MACHINERY):
        frame = frame.f_back
    return frame is not None and frame.f_globals is namespace


def _where(module: ModuleType) -> str:
    namespace = watcher.namespace(module) or {}
    # python FILE takes __file__ away from __main__ when the file's code has run (this may be at exit).
    file = namespace.get("__file__") or getattr(namespace.get("__spec__"), "origin", None) or (
        sys.argv[0] if module.__name__ == "__main__" and sys.argv and sys.argv[0] not in ("", "-c") else None)
    return f"{module.__name__}, {file}" if isinstance(file, str) else str(module.__name__)


def report_unpatched() -> None:
    """Record a ``skipped`` row for every unpatched copy in a running script (:func:`unpatched`) and
    warn once about each. Lock held."""
    for module, family, patches in unpatched():
        names = ", ".join(patch.qualname for patch in patches)
        reason = ("defined in the running script after gradpatch last examined it (at apply(), or at an "
                  "import after the definition), so not patched: call gradpatch.apply() after defining it, "
                  "or move it into a module the script imports")
        for patch in patches:
            LEDGER.record(patch, Status.SKIPPED, reason)
        if (module.__name__, names) in _warned:
            continue
        _warned.add((module.__name__, names))
        complain(PatchFailedWarning, f"gradpatch: the running script ({_where(module)}) defines {names}, a copy "
                 f"of the {family.name} family, after gradpatch last examined the script (when apply() ran, "
                 "or a module was imported after the definition), so it was not patched and runs the broken "
                 f"upstream code. Call gradpatch.apply() after defining {names}, or move the definition into "
                 "a module the script imports.")


def watch_exit() -> None:
    """At interpreter exit, warn about the script's copies that were never patched (once per process)."""
    global _watching_exit
    if not _watching_exit:
        _watching_exit = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    if not scanning.enabled:
        return
    try:
        with settings.scope(strict=False), LEDGER.locked():  # exiting: say it, never raise
            report_unpatched()
    except Exception:  # noqa: BLE001 (a check at exit must not add a traceback to the program's own)
        pass
