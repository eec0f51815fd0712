"""Copies of known-broken code found wherever they live.

The declared patches name module paths, but the OpenAI/CompVis checkpoint lives on under hundreds of
other names (``audiosr.latent_diffusion.modules.diffusionmodules.util``, ``myproject/models/util.py``).
While the scan is on, every module whose body has run that defines a member of a
:class:`~gradpatch.patching.families.Family` is identified by fingerprint, and a known version is patched like a
declared path, with the same fixes, rebinding and report entries (named after the module where the copy
was found). This module only recognises: :mod:`gradpatch.patching.activation` calls :func:`copies` from the one
listener it gives :mod:`gradpatch.patching.watcher` (every execution of a module body: import, re-import,
reload, a lazy module's first use, any finder or loader) and for every module already imported when
``apply()`` runs, and adopts what it returns. A copy adopted once is a patch of this process from then
on: its module's next execution (``importlib.reload``) is patched like a declared path's, and every
later ``apply()`` or ``applied()`` selecting the family selects it again.

What it costs per module body: one test that the module's globals hold none of the member names
(about 0.2 us; ``benchmarks/startup.py`` measures the whole scan on ``import diffusers`` + ``import
audioldm``). Only a module holding a member name, with an object its own body defined (``__module__``),
shaped like a member (``torch.utils.checkpoint`` has the names but not the shapes) is fingerprinted,
once per code object. A shaped copy with an unknown fingerprint is left alone with an
:class:`~gradpatch.UnknownCodeWarning`; one whose source cannot be read (a ``.pyc`` without its
``.py``, a module built in memory) is left alone with a warning saying so; declared paths are never
examined here (they carry provenance and version ranges of their own), and neither are gradpatch's
own modules.

On while ``apply()`` has selected a patch of the family (``GRADPATCH=1`` selects all), unless
switched off with ``apply(scan=False)`` or ``GRADPATCH_SCAN=0``.

A running script (``python train.py``, ``python -m pkg.train``, ``runpy.run_path``) is no import: no
module body ends when it has defined a copy. Its module (:data:`SCRIPTS`) is examined mid-body, by
``apply()`` and at the end of every module body that runs after it changed one of the members' names
(:func:`scripts`), so a copy it defines before calling ``apply()``, or before importing a module
not imported yet, is patched; one it defines later is reported as not patched (see
:mod:`gradpatch.patching.scripts`).
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from gradpatch.patching import watcher

#: The switch (``apply(scan=...)``, ``GRADPATCH_SCAN``); nothing is examined while it is False.
enabled = False
_families: list[Any] = []
_names: frozenset[str] = frozenset()  # every member's module-level name, of every family: the per-module check
#: The module names a script runs under: ``python train.py`` and ``python -m pkg.train`` run
#: ``__main__``, ``runpy.run_path`` runs ``<run_path>`` unless given another ``run_name``, and a
#: process multiprocessing spawns runs the parent's script as ``__mp_main__``.
SCRIPTS = ("__main__", "<run_path>", "__mp_main__")
_looked: dict[str, tuple] = {}  # script name -> what its members' names were bound to when last examined


def families() -> list[Any]:
    """The declared families (``patches/_families.py``), loaded on first use."""
    global _names
    if not _families:
        from gradpatch.patching import catalogue

        package = catalogue.builtin_package()
        _families.extend(__import__(f"{package.__name__}._families", fromlist=["FAMILIES"]).FAMILIES)
        _names = frozenset(name for family in _families for name in family.heads)
    return _families


def candidate(namespace: dict) -> bool:
    """Whether a module with these globals may hold a copy (the scan is on and it holds a member
    name): the test every module body pays."""
    # With the families' ~20 names a set test beats a loop over them (0.13 us on a 10-name module,
    # 0.26-0.28 us on torch.nn.functional and os, against 0.31-0.33 us for the loop).
    return enabled and not namespace.keys().isdisjoint(_names)


def scripts(*, changed: bool = False) -> list[ModuleType]:
    """The modules of the running scripts (:data:`SCRIPTS`) that may hold a copy. ``changed=True``:
    only those whose members' names are bound to other objects than when last :func:`examined` (every
    module body asks, and must not examine a script again for nothing)."""
    found: list[ModuleType] = []
    for name in SCRIPTS:
        module = sys.modules.get(name)
        namespace = watcher.namespace(module) if module is not None else None
        if namespace is None or not candidate(namespace) or any(module is other for other in found):
            continue
        if changed and _looked.get(str(namespace.get("__name__"))) == _state(namespace):
            continue
        found.append(module)  # type: ignore[arg-type]
    return found


def _state(namespace: dict) -> tuple:
    return (id(namespace), *map(id, map(namespace.get, _names)))


def examined(script: ModuleType) -> None:
    """``script`` (one of :func:`scripts`) is examined as it is now: ``scripts(changed=True)`` leaves it
    out until it changes a member's name again."""
    namespace = watcher.namespace(script)
    if namespace is not None:
        _looked[str(namespace.get("__name__"))] = _state(namespace)


def copies(module: ModuleType, namespace: dict, selected: list[Any]) -> list[tuple[Any, list[Any]]]:
    """``(family, patches)`` for each of the ``selected`` families whose copy ``module`` (with globals
    ``namespace``, not a declared path) defines: the patches replacing its members, as the family
    recognises them (:meth:`gradpatch.patching.families.Family.copy_in`)."""
    name = namespace.get("__name__")
    if not isinstance(name, str) or name.partition(".")[0] == "gradpatch":
        return []
    found = []
    for family in selected:
        patches = family.copy_in(module, namespace, name)
        if patches:
            found.append((family, [patch._replace(summary=f"copy found by scan ({family.name}); {patch.summary}")
                                   for patch in patches]))
    return found
