"""Patch declarations and the records of what happened to them.

A :class:`Patch` is data: which attribute of which module it replaces, how to recognise the broken code
there, which fix builds the replacement, and which distribution versions it expects. The catalogue in
``gradpatch.patches`` is a list of these; the engine (:mod:`gradpatch.activation`, :mod:`gradpatch.hooks`)
does the rest. A :class:`Record` says what happened to one patch in this process.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

from gradpatch.fingerprint import Recogniser


class Status(str, enum.Enum):
    APPLIED = "applied"
    DEFERRED = "deferred"  # wanted; its target module is not imported yet
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


class Report(tuple):  # type: ignore[type-arg]
    """A tuple of :class:`Record` that prints as a table."""

    def __str__(self) -> str:
        from gradpatch.budget import report_line  # the checkpoint budget's plan, if that policy

        return "\n".join(filter(None, [self._table(), report_line()]))

    def _table(self) -> str:
        if not self:
            return "gradpatch: no patches selected"
        rows = [("patch", "status", "target", "reason")]
        for record in self:
            reason = record.reason
            if record.rebound:
                reason += f" (rebound {', '.join(record.rebound)})"
            rows.append((record.patch, str(record.status), record.target, reason))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
            for row in rows
        ).rstrip()

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython shows the table, not the tuple
        printer.text(str(self))

    def by_status(self, status: Status | str) -> list[Record]:
        return [record for record in self if record.status == Status(status)]
