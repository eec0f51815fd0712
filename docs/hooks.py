"""MkDocs hooks: the pages' generated parts, made from the code at build time so that they cannot drift.

A page asks for one with a line of its own:

``<!-- generated: catalogue -->``  every declared patch, grouped by the ``patches/`` module of its codebase
``<!-- generated: families -->``   the code families found at any path (``patches/_families.py``)
``<!-- generated: cli -->``        ``gradpatch --help`` and each subcommand's ``--help``
``<!-- generated: version -->``    ``gradpatch.__version__``

Nothing here imports torch: the catalogue is data, and the CLI builds its parser without it.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"<!-- generated: ([a-z]+) -->")


def _gradpatch():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return importlib.import_module("gradpatch")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def catalogue() -> str:
    _gradpatch()
    from gradpatch.patching.activation import known_patches
    from gradpatch.patching.catalogue import builtin_package

    package = builtin_package()
    patches = list(known_patches().values())
    lines = [f"{len(patches)} patches for {len({p.upstream for p in patches})} upstream names, declared in "
             f"{len(package.MODULES)} modules of `patches/`.", ""]
    lines += ["| codebase (`patches/` module) | patches | upstream names |", "|---|---|---|"]
    by_module = []
    for name in package.MODULES:
        module = importlib.import_module(f"{package.__name__}.{name}")
        declared = [p for p in getattr(module, "PATCHES", [])]
        by_module.append((name, module, declared))
        upstreams = sorted({p.upstream for p in declared})
        lines.append(f"| [`{name}`](#{name}) | {len(declared)} | "
                     f"{', '.join(f'`{u}`' for u in upstreams) or 'opt-in: none declared'} |")
    for name, module, declared in by_module:
        lines += ["", f"### {name}", "", _cell(_first_paragraph(module.__doc__)), ""]
        if not declared:
            lines.append("No declared patch: see the module's docstring for the one-line opt-in.")
            continue
        lines += ["| patch | target | fixes | requires |", "|---|---|---|---|"]
        for p in declared:
            lines.append(f"| `{p.name}` | `{p.target}` | {_cell(p.summary)} | "
                         f"{f'`{p.requires}`' if p.requires else ''} |")
    return "\n".join(lines)


def families() -> str:
    _gradpatch()
    from gradpatch.patching.catalogue import builtin_package

    package = builtin_package()
    module = importlib.import_module(f"{package.__name__}._families")
    lines = ["| family | members (fix) | known versions |", "|---|---|---|"]
    for family in module.FAMILIES:
        if not hasattr(family, "members"):  # a set of methods recognised together, by version
            lines.append(f"| `{family.name}` | the samplers' methods, recognised together as one version | |")
            continue
        members = "; ".join(f"`{m.name}`" + (f" ({_cell(m.summary)})" if m.summary else "") for m in family.members)
        known = sorted({label for _, versions in family.fingerprints for label in versions.values()})
        lines.append(f"| `{family.name}` | {members} | {len(known)} |")
    return "\n".join(lines)


def _help(argv: list[str]) -> str:
    from gradpatch import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        os.environ["COLUMNS"] = "100"
        cli.main(argv)
    return out.getvalue().rstrip()


def subcommands() -> list[str]:
    """The subcommands ``gradpatch --help`` lists (read from its output, so a new one shows up)."""
    _gradpatch()
    text = _help(["--help"])
    block = text.split("COMMAND", 2)[-1]
    return re.findall(r"^    ([a-z][a-z-]*)\s", block, re.M)


def cli() -> str:
    _gradpatch()
    parts = ["### `gradpatch`", "", "```text", _help(["--help"]), "```"]
    for name in subcommands():
        parts += ["", f"### `gradpatch {name}`", "", "```text", _help([name, "--help"]), "```"]
    return "\n".join(parts)


def version() -> str:
    return _gradpatch().__version__


GENERATORS = {"catalogue": catalogue, "families": families, "cli": cli, "version": version}


def on_page_markdown(markdown: str, page: object, config: object, files: object) -> str:
    return MARKER.sub(lambda match: GENERATORS[match.group(1)](), markdown)
