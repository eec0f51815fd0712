"""The deprecated paths of modules that moved (one release): ``gradpatch.checkpointing._paths`` is
:mod:`gradpatch.checkpointing.paths`, and so on. Each old module, on import, warns once
(``DeprecationWarning``) and puts the new module in its place, so that both names are one object."""
from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make the module being imported as ``old`` the module ``new``, with a ``DeprecationWarning``."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; import {new}",
                  DeprecationWarning, stacklevel=2)
    sys.modules[old] = importlib.import_module(new)
