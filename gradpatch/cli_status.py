"""``gradpatch status`` without ``--all``: whether gradpatch is active here, then one line per upstream.

The first line answers "will my next ``python train.py`` be patched?": it reads ``GRADPATCH`` from
the environment and looks for the start-up file (``gradpatch.pth``, or ``gradpatch.start`` on Python
3.15+) in the site-packages directories of this interpreter. Nothing is imported: neither torch nor
any target.
"""
from __future__ import annotations

import os
import site
import textwrap
from typing import Iterable

from gradpatch.switch import OFF as _OFF
from gradpatch.patching.patch import WIDTH

_STARTUP_FILES = ("gradpatch.pth", "gradpatch.start")


def startup_file() -> str | None:
    """The path of gradpatch's start-up file in this interpreter's site-packages, if installed."""
    folders = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    for folder in folders:
        for name in _STARTUP_FILES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    return None


def activity_line(environ: dict[str, str] | None = None, startup: str | None | bool = True,
                  width: int = 100) -> str:
    """One line (at most ``width`` columns): whether a Python process started from this environment
    is patched, and how. ``startup``: the start-up file's path, ``None`` for none, ``True`` to look."""
    from gradpatch.patching.patch import elide

    environ = dict(os.environ) if environ is None else environ
    path = startup_file() if startup is True else startup or None
    value = environ.get("GRADPATCH", "")
    shown = elide(value, 16)
    if value.strip().lower() not in _OFF and path:
        head = f"gradpatch: ACTIVE in every Python process here (GRADPATCH={shown}, start-up file "
        return head + elide(path, max(width - len(head) - 1, 8)) + ")"
    if value.strip().lower() not in _OFF:
        return (f"gradpatch: active only where imported (GRADPATCH={shown}; no start-up file): "
                "import gradpatch.auto")
    state = " unset" if not value else f"={shown}"
    installed = "start-up file installed" if path else "no start-up file"
    return f"gradpatch: NOT active (GRADPATCH{state}, {installed}): set GRADPATCH=1 or apply() in code"


def summary_lines(statuses: Iterable[dict[str, object]], upstream_of: dict[str, str]) -> list[str]:
    """One line per upstream package installed here: its version and how its code was recognised;
    then the packages not installed, wrapped to the table width."""
    groups: dict[str, list[dict[str, object]]] = {}
    for row in statuses:
        groups.setdefault(upstream_of[str(row["patch"])], []).append(row)
    lines, missing = [], []
    for upstream, rows in groups.items():
        present = [r for r in rows if r["installed"]]
        if not present:
            missing.append(upstream)
            continue
        versions = sorted({str(r["version"] or ("local copy" if r["shadowed"] else "-")) for r in present})
        counts: dict[str, int] = {}
        for r in present:
            code = str(r["code"])
            kind = code.split(" ", 1)[0].rstrip(":") if not code.startswith("checked") else "checked"
            kind = {"known": "code known", "fixed": "fixed upstream", "unknown": "UNKNOWN code",
                    "checked": "checked on import"}.get(kind, kind)
            counts[kind] = counts.get(kind, 0) + 1
        detail = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        lines.append(f"  {upstream} {'/'.join(versions)}: {len(present)} patch{'es' if len(present) > 1 else ''} ({detail})")
    if missing:
        lines += textwrap.wrap(f"not installed: {', '.join(missing)}", WIDTH, initial_indent="  ",
                               subsequent_indent="    ", break_on_hyphens=False)
    return lines
