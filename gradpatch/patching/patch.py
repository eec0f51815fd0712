"""Patch declarations and the records of what happened to them.

A :class:`Patch` is data: which attribute of which module it replaces, how to recognise the broken code
there, which fix builds the replacement, and which distribution versions it expects. The catalogue in
``gradpatch.patches`` is a list of these; the engine (:mod:`gradpatch.patching.activation`, :mod:`gradpatch.patching.hooks`)
does the rest. A :class:`Record` says what happened to one patch in this process.
"""
from __future__ import annotations

import enum
import sys
from typing import NamedTuple, Sequence

from gradpatch import settings

from gradpatch.patching.fingerprint import Recogniser


class Status(str, enum.Enum):
    APPLIED = "applied"
    DEFERRED = "deferred"  # wanted; its target's body has not run yet (or ran unseen: see the reason)
    SKIPPED = "skipped"  # left alone on purpose: see the record's reason
    FAILED = "failed"  # the fix raised; the target is as it was
    REVERTED = "reverted"

    def __str__(self) -> str:
        return self.value


class Patch(NamedTuple):
    """One declared replacement.

    ``target`` is ``"package.module:Qual.name"``: a module attribute (``util:checkpoint``) or a class
    attribute (``cfm:CFM.sample``). ``fix`` is ``"package.module:factory"``; the factory is imported only
    when the target is, and is called as ``factory(original)`` to build the replacement. ``requires``
    is a PEP 508 requirement (``"f5-tts>=1.0"``) checked when that distribution is installed; vendored
    copies without a distribution are recognised by fingerprint alone. ``upstream`` groups patches so
    that ``apply("audioldm")`` selects them all.
    """

    name: str
    target: str
    fix: str
    recognise: Recogniser
    upstream: str
    summary: str
    requires: str | None = None

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]


class Record(NamedTuple):
    """What happened to one patch: ``status`` and, in words, ``reason``.

    ``variant`` is the recognised code's label (provenance of the matching fingerprint) or, for unknown
    code, its fingerprint; ``version`` the installed distribution's version, if any; ``rebound`` the
    ``module.name`` globals that still held the original object and were pointed at the fix.
    """

    patch: str
    upstream: str
    target: str
    status: Status
    reason: str = ""
    variant: str | None = None
    version: str | None = None
    rebound: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "patch": self.patch,
            "upstream": self.upstream,
            "target": self.target,
            "status": str(self.status),
            "reason": self.reason,
            "variant": self.variant,
            "version": self.version,
            "rebound": list(self.rebound),
        }


#: Tables are laid out for this many columns unless asked to be wide.
WIDTH = 100


def elide(text: str, width: int) -> str:
    """``text`` cut to its last ``width`` characters: a target's end (``util:checkpoint``) says the most,
    and its package is already in the patch's name."""
    return text if len(text) <= width else "..." + text[len(text) - width + 3:]


def format_table(rows: Sequence[tuple[str, ...]], *, wide: bool = False, width: int = WIDTH) -> str:
    """``rows`` (the first one the header) as aligned columns, every line at most ``width`` wide.

    The last column is the free text: it wraps under itself, or, when the other columns leave it too
    little room, goes on indented lines of its own below its row; a fixed column too wide to fit is
    cut at its start. ``wide=True`` puts every row on one line, however long (for logs and grep).
    """
    import textwrap

    fixed = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    if wide:
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, fixed)) + "  " + row[-1] for row in rows).rstrip()
    while sum(fixed) + 2 * len(fixed) > width:  # a fixed column too wide: cut the widest
        widest = fixed.index(max(fixed))
        fixed[widest] -= sum(fixed) + 2 * len(fixed) - width
        fixed[widest] = max(fixed[widest], 12)
    indent = sum(fixed) + 2 * len(fixed)
    below = width - indent < 32  # too little room beside: the free text goes under its row
    free = width - 4 if below else width - indent
    lines = []
    for row in rows:
        cells = "  ".join(elide(c, w).ljust(w) for c, w in zip(row, fixed))
        text = textwrap.wrap(row[-1], free, break_on_hyphens=False) or [""]
        if below and row is rows[0]:  # the header names the indented line's column too, if it fits
            heading = cells.rstrip() + "  " + row[-1]
            lines += [heading] if len(heading) <= width else [cells.rstrip(), "    " + row[-1]]
        elif below:
            lines.append(cells.rstrip())
            lines += ["    " + part for part in text if part]
        else:
            lines.append((cells + "  " + text[0]).rstrip())
            lines += [" " * indent + part for part in text[1:]]
    return "\n".join(lines)


def _importable(module: str) -> bool:
    """Whether ``module``'s top-level package can be found here (found, not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def report_line() -> str:
    """One line on the ``budget:<size>`` plan for :class:`Report`, or ``""`` under another policy. The
    planner is asked only if something has loaded it: reporting never imports torch."""
    policy = settings.checkpoint_policy
    if not settings.is_budget(policy):
        return ""
    planner = sys.modules.get("gradpatch.checkpointing.budget.policy")
    if planner is None:
        return f"checkpoint policy {policy}: no checkpointed block has run yet"
    return planner.checkpoint_plan().summary()


class Report(tuple):  # type: ignore[type-arg]
    """A tuple of :class:`Record` that prints as a table (:meth:`table`)."""

    def __str__(self) -> str:
        return self.table()

    def table(self, *, all: bool = False, wide: bool = False) -> str:
        """The records as a table that fits 100 columns (``wide=True``: one line per record), and,
        under the ``budget:<size>`` checkpoint policy, a line summing up its plan.

        Deferred records whose target package is not installed here are left out unless
        ``all=True``: they only say that gradpatch is ready for a package this environment lacks.
        """
        return "\n".join(filter(None, [self._records_table(all, wide), report_line()]))

    def _records_table(self, all: bool, wide: bool) -> str:
        if not self:
            return "gradpatch: no patches selected"
        shown = [r for r in self if all or r.status != Status.DEFERRED or _importable(r.target)]
        rows = [("patch", "status", "target", "reason")]
        for record in shown:
            reason = record.reason
            if record.rebound:
                reason += f" (rebound {', '.join(record.rebound)})"
            rows.append((record.patch, str(record.status), record.target, reason))
        hidden = len(self) - len(shown)
        waiting = f"{hidden} deferred for packages not installed here (report().table(all=True) lists them)"
        if not shown:
            return f"gradpatch: {waiting}"
        return format_table(rows, wide=wide) + (f"\n(and {waiting})" if hidden else "")

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython shows the table, not the tuple
        printer.text(str(self))

    def by_status(self, status: Status | str) -> list[Record]:
        return [record for record in self if record.status == Status(status)]
