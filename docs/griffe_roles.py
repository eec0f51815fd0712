"""A griffe extension for the API reference: Sphinx cross-reference roles in docstrings
(``:func:`~gradpatch.apply```, ``:class:`Patch```) shown as code (``apply``, ``Patch``), since the
package's docstrings are written for both ``help()`` and this site."""
from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
