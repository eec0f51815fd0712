"""Copies of known-broken code found wherever they live.

The declared patches name module paths, but the OpenAI/CompVis checkpoint lives on under hundreds of
other names (``audiosr.latent_diffusion.modules.diffusionmodules.util``, ``myproject/models/util.py``).
While the scan is on, every imported module that defines a member of a :class:`~gradpatch.patching.families.Family`
is identified by fingerprint, and a known version is patched like a declared path, with the same
fixes, rebinding and report entries (named after the module where the copy was found).

How modules are seen: :class:`_ScanPathFinder` takes the place of :class:`importlib.machinery.PathFinder`
in ``sys.meta_path`` and gives every pure-Python module it finds a :class:`_ScanLoader`, a
``SourceFileLoader`` that calls :func:`_imported` after the module body ran and before any importer
binds names from it (the class of the loader PathFinder built is switched: no new object). Modules
imported before the scan started are examined by :func:`sweep`, which every ``apply()`` runs; so are
modules loaded by other finders (zip files, custom importers, a package's own ``__init__`` found by
an editable-install finder), but only if they were imported by then.

What it costs per import: one test that the module's globals hold none of the member names (about
0.2 us; ``benchmarks/startup.py`` measures the whole scan on ``import diffusers`` + ``import audioldm``).
Only a module holding a member name, with an object its own body defined (``__module__``), shaped
like a member (``torch.utils.checkpoint`` has the names but not the shapes) is fingerprinted, once
per code object. A shaped copy with an unknown fingerprint is left alone with an
:class:`~gradpatch.UnknownCodeWarning`; declared paths are never examined here (they carry
provenance and version ranges of their own), and neither are gradpatch's own modules.

On while ``apply()`` has selected a patch of the family (``GRADPATCH=1`` selects all), unless
switched off with ``apply(scan=False)`` or ``GRADPATCH_SCAN=0``.
"""
from __future__ import annotations

import sys
from importlib.machinery import PathFinder, SourceFileLoader
from types import ModuleType
from typing import Any

from gradpatch import settings
from gradpatch.errors import PatchFailedWarning, complain, logger

#: The switch (``apply(scan=...)``, ``GRADPATCH_SCAN``); nothing is examined while it is False.
enabled = False
_families: list[Any] = []
_names: tuple[str, ...] = ()  # every member name of every family: the per-import check
_chosen: dict[tuple[int, ...], tuple[tuple[object, ...], tuple[str, ...]]] = {}  # per code object


def start(scan: bool) -> list[Any]:
    """Set the switch; when on, watch every later import and examine the modules already imported.
    Returns the records of the copies the sweep found."""
    global enabled, _names
    enabled = scan
    if not enabled:
        return []
    if not _families:
        from gradpatch.patching import catalogue

        package = catalogue._builtin_package()
        _families.extend(__import__(f"{package.__name__}._families", fromlist=["FAMILIES"]).FAMILIES)
        _names = tuple(dict.fromkeys(name for family in _families for name in family.names))
    _install_finder()
    return sweep()


def sweep() -> list[Any]:
    """Examine every module already imported; ``apply()`` runs this after its declared patches."""
    records: list[Any] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and not namespace.keys().isdisjoint(_names) \
                and not getattr(namespace.get("__spec__"), "_initializing", False):
            records.extend(_imported(module, late=True))
    return records


def _imported(module: ModuleType, late: bool = False) -> list[Any]:
    """Patch the family copies ``module`` defines; never raises into the user's import."""
    namespace = getattr(module, "__dict__", None)
    if not enabled or not isinstance(namespace, dict) or namespace.keys().isdisjoint(_names):
        return []  # the common case, costed in benchmarks/startup.py
    try:
        return _examine(module, namespace, late)
    except Exception as exc:
        if settings.strict:
            raise
        complain(PatchFailedWarning, f"gradpatch: error while scanning {module.__name__}: {exc!r}")
        return []


def _examine(module: ModuleType, namespace: dict, late: bool) -> list[Any]:
    from gradpatch.patching import activation

    name = namespace.get("__name__")
    if not isinstance(name, str) or name.partition(".")[0] == "gradpatch":
        return []
    records: list[Any] = []
    for family in _families:
        shaped = [m.name for m in family.members if getattr(namespace.get(m.name), "__module__", None) == name
                  and m.shape.matches(namespace[m.name])]
        if not family.is_copy(shaped):
            continue  # unrelated code that uses a member's name
        if any(patch.module == name for patch in activation.known_patches().values()):
            continue  # a declared path (or a copy found before): its own patches handle it
        over = _group(module, namespace, family)
        top = name.partition(".")[0]
        patches = [patch._replace(summary=f"copy found by scan ({family.name}); {patch.summary}")
                   for patch in family.patches(top, name, family.known(over), over=over, name=name)]
        records.extend(activation.adopt(patches, module, late=late, fixes=family.fixes()))
    return records


def _group(module: ModuleType, namespace: dict, family: Any) -> tuple[str, ...]:
    """The set of names to identify ``module``'s copy by: the largest it defines whose fingerprint
    is known, else the largest it defines (which is then reported as unknown)."""
    from gradpatch.patching.fingerprint import Fingerprints

    objects = tuple(namespace.get(name) for name in family.names)
    key = tuple(id(getattr(obj, "__code__", obj)) for obj in objects)
    if key in _chosen:
        return _chosen[key][1]
    groups = family.groups([name for name in family.names if name in namespace])
    chosen = groups[0]
    for over in groups:
        recognise = Fingerprints(family.known(over), over=over)
        if recognise.identify(module, over[0], namespace.get(over[0])).verdict == "known":
            chosen = over
            break
    # The objects are kept with the key so that their ids cannot be reused by other code.
    _chosen[key] = (tuple(getattr(obj, "__code__", obj) for obj in objects), chosen)
    return chosen


class _ScanLoader(SourceFileLoader):
    """A ``SourceFileLoader`` (so ``isinstance`` checks on ``module.__loader__`` still hold) that
    examines the module right after its body ran."""

    def exec_module(self, module: ModuleType) -> None:
        super().exec_module(module)
        _imported(module)


class _ScanPathFinder(PathFinder):
    """``PathFinder`` whose pure-Python modules get a :class:`_ScanLoader`; everything else
    (``find_distributions``, ``invalidate_caches``) is PathFinder's own."""

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> Any:
        spec = _find_spec(fullname, path, target)
        # FileFinder builds a loader per spec, so switching that one object's class (a subclass
        # with no state of its own) touches nothing shared and costs less than building another.
        if spec is not None and spec.loader.__class__ is SourceFileLoader:
            spec.loader.__class__ = _ScanLoader
        return spec


_find_spec = PathFinder.find_spec


def _install_finder() -> None:
    if _ScanPathFinder in sys.meta_path:
        return
    if PathFinder not in sys.meta_path:
        logger.info("sys.meta_path has no PathFinder; copies are found only when apply() runs")
        return
    sys.meta_path[sys.meta_path.index(PathFinder)] = _ScanPathFinder
