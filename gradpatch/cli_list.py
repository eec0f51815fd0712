"""``gradpatch list``: the known patches, one line per codebase (how many, what they replace); with a
CODEBASE, that codebase's patches and what each fixes; ``--all`` every patch by codebase, ``--wide``
one line per patch, ``--json`` for tools (see :mod:`gradpatch.cli`)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from gradpatch.patching.patch import WIDTH, Patch, elide, format_table


def print_list(args: argparse.Namespace) -> int:
    from gradpatch.patching.activation import known_patches

    patches = list(known_patches().values())
    codebases = list(dict.fromkeys(p.upstream for p in patches))
    if args.codebase:
        wanted = args.codebase.strip().lower().replace("-", "_")
        patches = [p for p in patches if p.upstream.lower() == wanted]
        if not patches:
            import difflib

            close = difflib.get_close_matches(wanted, codebases, n=1) or [c for c in codebases if c.startswith(wanted)]
            hint = f"did you mean {close[0]!r}? " if close else ""
            print(f"gradpatch list: no codebase {args.codebase!r}; {hint}`gradpatch list` names them all",
                  file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps([{"patch": p.name, "upstream": p.upstream, "target": p.target, "fixes": p.summary,
                           "requires": p.requires} for p in patches], indent=2))
        return 0
    groups: dict[str, list[Patch]] = {}
    for patch in patches:
        groups.setdefault(patch.upstream, []).append(patch)
    count = f"gradpatch: {len(patches)} patch{'es' if len(patches) != 1 else ''}"
    if not (args.codebase or args.all or args.wide):  # one line per codebase
        print(f"{count} for {len(groups)} codebases (one codebase: gradpatch list NAME; every patch: --all)")
        room = WIDTH - max(len(name) for name in groups) - 2 - len("patches") - 2
        summary: list[tuple[str, ...]] = [("codebase", "patches", "what they replace")]
        summary += [(name, str(len(group)).rjust(7), replaced(group, room)) for name, group in groups.items()]
        print(format_table(summary))
        return 0
    print(count + (f" for {args.codebase}" if args.codebase else f" for {len(groups)} codebases"))
    rows: list[tuple[str, ...]] = [("patch", "upstream", "target", "fixes") if args.wide else ("patch", "fixes")]
    headings: dict[int, str] = {}
    for name, group in groups.items():
        headings[len(rows)] = f"{name}: {len(group)}"
        rows += [(p.name, p.upstream, p.target, p.summary) if args.wide else (p.name, p.summary) for p in group]
    if args.wide:  # one line per patch, for logs and grep
        print(format_table(rows, wide=True))
        return 0
    print(headings.pop(1))
    print(format_table(rows, headings=headings, indent=2))
    return 0


def replaced(group: Sequence[Patch], room: int) -> str:
    """``checkpoint, CheckpointFunction, DDIMSampler.* (6), ... (+2)``: what a codebase's patches
    replace (the methods of a class counted), cut to ``room`` columns."""
    owners: dict[str, list[str]] = {}
    for patch in group:
        owner, dot, _ = patch.qualname.rpartition(".")
        owners.setdefault(owner + ".*" if dot else patch.qualname, []).append(patch.qualname)
    parts = [f"{name} ({len(names)})" if len(names) > 1 else names[0] for name, names in owners.items()]
    for shown in range(len(parts), 0, -1):
        more = f", ... (+{len(parts) - shown})" if shown < len(parts) else ""
        text = ", ".join(parts[:shown]) + more
        if len(text) <= room:
            return text
    return elide(parts[0], room)
