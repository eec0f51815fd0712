"""Patch declarations and the records of what happened to them.

A :class:`Patch` is data: which attribute of which module it replaces, how to recognise the broken code
there, which fix builds the replacement, and which distribution versions it expects. The catalogue in
``gradpatch.patches`` is a list of these; the engine (:mod:`gradpatch.patching.activation`, :mod:`gradpatch.patching.hooks`)
does the rest. A :class:`Record` says what happened to one patch in this process.
"""
from __future__ import annotations

import enum
import sys
from typing import Mapping, NamedTuple, Sequence

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


def format_table(rows: Sequence[tuple[str, ...]], *, wide: bool = False, width: int = WIDTH,
                 headings: Mapping[int, str] | None = None, indent: int = 0) -> str:
    """``rows`` (the first one the header) as aligned columns, every line at most ``width`` wide.

    The last column is the free text: it wraps under itself, or, when the other columns leave it too
    little room, goes on indented lines of its own below its row; a fixed column too wide to fit is
    cut at its start. ``wide=True`` puts every row on one line, however long (for logs and grep).
    ``headings`` maps a row's index to a line printed above it, flush left (a group's title), and
    ``indent`` shifts the table's own lines right under those titles.
    """
    import textwrap

    headings = headings or {}
    pad = " " * indent
    fixed = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    if wide:
        lines = []
        for i, row in enumerate(rows):
            lines += [headings[i]] if i in headings else []
            lines.append((pad + "  ".join(c.ljust(w) for c, w in zip(row, fixed)) + "  " + row[-1]).rstrip())
        return "\n".join(lines)
    width -= indent
    while sum(fixed) + 2 * len(fixed) > width:  # a fixed column too wide: cut the widest
        widest = fixed.index(max(fixed))
        fixed[widest] -= sum(fixed) + 2 * len(fixed) - width
        fixed[widest] = max(fixed[widest], 12)
    beside = sum(fixed) + 2 * len(fixed)
    below = width - beside < 32  # too little room beside: the free text goes under its row
    free = width - 4 if below else width - beside
    lines = []
    for i, row in enumerate(rows):
        if i in headings:
            lines.append(headings[i])
        cells = "  ".join(elide(c, w).ljust(w) for c, w in zip(row, fixed))
        text = textwrap.wrap(row[-1], free, break_on_hyphens=False) or [""]
        if below and i == 0:  # the header names the indented line's column too, if it fits
            heading = cells.rstrip() + "  " + row[-1]
            lines += [pad + heading] if len(heading) <= width else [pad + cells.rstrip(), pad + "    " + row[-1]]
        elif below:
            lines.append(pad + cells.rstrip())
            lines += [pad + "    " + part for part in text if part]
        else:
            lines.append(pad + (cells + "  " + text[0]).rstrip())
            lines += [pad + " " * beside + part for part in text[1:]]
    return "\n".join(lines)


def _importable(module: str) -> bool:
    """Whether ``module``'s top-level package can be found here (found, not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def report_line() -> str:
    """One line on the ``budget:<size>`` or ``peak:<size>`` plan for :class:`Report`, or ``""`` under
    another policy. The planner is asked only if something has loaded it: reporting never imports torch."""
    policy = settings.checkpoint_policy
    if not (settings.is_budget(policy) or settings.is_peak(policy)):
        return ""
    planner = sys.modules.get("gradpatch.checkpointing.budget.policy")
    if planner is None:
        return f"checkpoint policy {policy}: no checkpointed block has run yet"
    return planner.checkpoint_plan().summary()


#: A report of at most this many records (not counting those of packages not installed) prints every one.
SHORT = 8
#: The order counts are given in.
_ORDER = (Status.APPLIED, Status.DEFERRED, Status.SKIPPED, Status.FAILED, Status.REVERTED)


def counts(records: Sequence[Record]) -> str:
    """``"22 applied, 3 deferred"``: how many records have each status, in a fixed order."""
    found = [sum(r.status == status for r in records) for status in _ORDER]
    return ", ".join(f"{n} {status}" for n, status in zip(found, _ORDER) if n)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('ch') else 's'}"


def _normalise(name: str) -> str:
    return name.strip().lower().replace("-", "_")


class Report(tuple):  # type: ignore[type-arg]
    """A tuple of :class:`Record` that prints its counts first, then by codebase (:meth:`table`)."""

    def __str__(self) -> str:
        return self.table()

    def table(self, codebase: str | None = None, *, all: bool = False, wide: bool = False) -> str:
        """The records, at most 100 columns wide (``wide=True``: one line per record): a line of counts,
        then by codebase (the ``upstream`` that selects them). A codebase where something happened
        (applied, skipped, failed, reverted) shows its records; one whose patches all wait for their
        module to be imported takes one mention on a shared line; deferred records whose package is
        not installed here are counted at the end. ``codebase="audioldm"``: that codebase's records
        only, every one; ``all=True``: every record. Under the ``budget:<size>`` checkpoint policy, a
        last line sums up its plan.
        """
        return "\n".join(filter(None, [self._records_table(codebase, all, wide), report_line()]))

    def _records_table(self, codebase: str | None, all: bool, wide: bool) -> str:
        import textwrap

        if not self:
            return "gradpatch: no patches selected"
        records: Sequence[Record] = self
        if codebase is not None:
            records = [r for r in self if _normalise(r.upstream) == _normalise(codebase)]
            if not records:
                names = ", ".join(dict.fromkeys(r.upstream for r in self))
                return "\n".join(textwrap.wrap(f"gradpatch: no record of codebase {codebase!r} here (codebases: "
                                               f"{names})", WIDTH, subsequent_indent="  ", break_on_hyphens=False))
            all = True
        shown = [r for r in records if all or r.status != Status.DEFERRED or _importable(r.target)]
        hidden = len(records) - len(shown)
        waiting = f"{hidden} deferred for packages not installed here (report().table(all=True) lists them)"
        if not shown:
            return f"gradpatch: {waiting}"
        lines = [f"gradpatch: {_plural(len(records), 'patch')}: {counts(records)}"]
        groups: dict[str, list[Record]] = {}
        for record in shown:
            groups.setdefault(record.upstream, []).append(record)
        full = all or len(shown) <= SHORT  # a short report in full
        rows: list[tuple[str, ...]] = [("patch", "status", "target", "reason") if wide else ("patch", "status", "reason")]
        headings: dict[int, str] = {}
        quiet: list[str] = []
        for upstream, group in groups.items():
            if not full and all_deferred(group):
                quiet.append(f"{upstream} ({len(group)})")
                continue
            title = elide(f"{upstream}: {counts(group)}", WIDTH)
            listed = group if full else [r for r in group if needs_attention(r)]
            if not listed:
                lines.append(title)
                continue
            headings[len(rows)] = title
            for record in listed:
                reason = record.reason + (f" (rebound {', '.join(record.rebound)})" if record.rebound else "")
                rows.append((record.patch, str(record.status), record.target, reason) if wide
                            else (record.patch, str(record.status), reason))  # a name starts with its codebase
        if len(rows) > 1:
            lines.append(headings.pop(1))  # the first group's title above the columns' names
            lines.append(format_table(rows, wide=wide, headings=headings, indent=2))
        if quiet:
            lines += textwrap.wrap("waiting for their module to be imported: " + ", ".join(quiet), WIDTH,
                                   subsequent_indent="  ", break_on_hyphens=False)
        if not full:
            lines.append('every record of one codebase: report().table("NAME"); of all: report().table(all=True)')
        return "\n".join(lines + ([f"(and {waiting})"] if hidden else []))

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython shows the table, not the tuple
        printer.text(str(self))

    def by_status(self, status: Status | str) -> list[Record]:
        return [record for record in self if record.status == Status(status)]


def needs_attention(record: Record) -> bool:
    """Whether a record asks the reader to act: a failure, code left alone (unknown, unreadable), or a
    target not in place although its module ran (every reason but the usual ones)."""
    if record.status == Status.FAILED:
        return True
    if record.status == Status.SKIPPED:
        return not record.reason.startswith(("excluded", "fixed upstream", "already gradpatch's fix", "adopted instead"))
    return record.status == Status.DEFERRED and not record.reason.startswith("waiting for")


def all_deferred(records: Sequence[Record]) -> bool:
    return all(r.status == Status.DEFERRED for r in records)
