"""Finding every declared :class:`~gradpatch.patching.patch.Patch`.

The built-in catalogue is the package ``gradpatch.patches`` (the top-level ``patches/`` folder of the
source tree, shipped inside the wheel): each of its modules named in ``MODULES`` exposes a list
``PATCHES``. Other distributions add patches through the entry-point group ``gradpatch.patches``; an
entry point names either such a module or a callable returning a list of patches.
Loading imports declarations only, never torch or a target.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from gradpatch.errors import ConfigWarning, complain
from gradpatch.patching.patch import Patch

ENTRY_POINT_GROUP = "gradpatch.patches"


class Catalogue(dict):  # type: ignore[type-arg]
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


def builtin_package() -> ModuleType:
    try:
        return importlib.import_module("gradpatch.patches")
    except ModuleNotFoundError:
        pass
    # A source checkout or an editable install: the catalogue sits beside the package.
    root = Path(__file__).resolve().parents[2] / "patches"
    spec = importlib.util.spec_from_file_location(
        "gradpatch.patches", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("gradpatch's patch catalogue is missing; reinstall gradpatch")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _any_plugin_declared() -> bool:
    # importlib.metadata costs ~60 ms to import and scan; this check costs ~1 ms and spares it in
    # the usual case of no plug-ins (it runs at interpreter start under GRADPATCH=1).
    header = f"[{ENTRY_POINT_GROUP}]"
    for entry in sys.path:
        try:
            names = [n for n in os.listdir(entry or ".") if n.endswith((".dist-info", ".egg-info"))]
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(entry or ".", name, "entry_points.txt"), encoding="utf-8") as f:
                    if header in f.read():
                        return True
            except OSError:
                continue
    return False


def _from_entry_points() -> list[Patch]:
    if not _any_plugin_declared():
        return []
    from importlib.metadata import entry_points

    found: list[Patch] = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
            patches = loaded() if callable(loaded) else getattr(loaded, "PATCHES")
            found.extend(p for p in patches if isinstance(p, Patch))
        except Exception as exc:  # a broken plug-in must not break the user's program
            complain(ConfigWarning, f"gradpatch: could not load patches from entry point "
                     f"{entry.name!r} ({entry.value}): {exc!r}; ignoring it")
    return found


def load() -> dict[str, Patch]:
    """Every known patch by name, built-in first, in declaration order."""
    package = builtin_package()
    patches: dict[str, Patch] = {}
    for name in package.MODULES:
        for patch in importlib.import_module(f"{package.__name__}.{name}").PATCHES:
            patches[patch.name] = patch
    for patch in _from_entry_points():
        if patch.name in patches:
            complain(ConfigWarning, f"gradpatch: a plug-in redeclares patch {patch.name!r}; "
                     "keeping the built-in one")
            continue
        patches[patch.name] = patch
    return patches
