"""Shared by the background interpreters that check older upstream releases (see
``support.BackgroundCheck``): each release is imported from its own folder in turn, in one process."""
from __future__ import annotations

import importlib
import json
import sys
import traceback
from typing import Any, Callable

import gradpatch


def switch_to(root: str, package: str) -> None:
    """Forget every loaded module of ``package`` and put ``root`` first on ``sys.path``."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    from gradpatch.patching import versions  # the engine caches installed versions per process

    versions.installed_version.cache_clear()


def main(upstream: str, load: Callable[[str], Any], run: Callable[[Any], dict]) -> None:
    """For each ``{key: root}`` in ``argv[1]``: load the release, check it, revert; print the results
    as JSON. The first release is patched as it is imported, the others after (a late ``apply()``)."""
    results = {}
    for i, (key, root) in enumerate(json.loads(sys.argv[1]).items()):
        try:
            if i == 0:
                gradpatch.apply(upstream)
            loaded = load(root)
            if i:
                gradpatch.apply(upstream)
            try:
                results[key] = run(loaded)
            finally:
                gradpatch.revert(upstream)
                sys.path.remove(root)
        except Exception:
            results[key] = {"error": traceback.format_exc()}
    print(json.dumps(results))
