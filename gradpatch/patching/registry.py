"""Deprecated alias of :mod:`gradpatch.patching.patch`, kept for one release.

Importing it warns (:class:`DeprecationWarning`); import ``Patch``, ``Record``, ``Report`` and
``Status`` from ``gradpatch`` or :mod:`gradpatch.patching.patch` instead.
"""
import warnings

from gradpatch.patching.patch import (WIDTH, Patch, Record, Report, Status, elide, format_table,  # noqa: F401
                                      report_line)

__all__ = ["WIDTH", "Patch", "Record", "Report", "Status", "elide", "format_table", "report_line"]

warnings.warn("gradpatch.patching.registry is deprecated and will be removed in the next release: "
              "import Patch, Record, Report and Status from gradpatch (or gradpatch.patching.patch)",
              DeprecationWarning, stacklevel=2)
