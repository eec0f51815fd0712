"""What a checkpointed block's plan entry is keyed by, for :mod:`gradpatch.checkpointing.budget.policy`: the
call's :func:`signature` and the block's :func:`state` (training mode, trainable set, dtype). A block
whose key changes is measured again, so a plan follows gradual unfreezing, eval/train and autocast.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from gradpatch.checkpointing.compat import autocast_dtype, autocast_enabled


def signature(args: tuple, kwargs: dict | None) -> tuple:
    """The inputs' shapes, dtypes, devices and ``requires_grad``, and the autocast dtypes in force."""
    values = args if kwargs is None else (*args, *kwargs.values())
    return (autocast_enabled("cpu") and autocast_dtype("cpu"),
            autocast_enabled("cuda") and autocast_dtype("cuda"),
            *[(v.shape, v.dtype, v.device, v.requires_grad) if isinstance(v, Tensor) else None
              for v in values])


#: Each module's parameters as last listed, with the registration count they were listed at.
_PARAMS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[Tensor]]] = \
    weakref.WeakKeyDictionary()
_REGISTERED = [0]  # parameters and submodules registered anywhere (hooks installed on first use)
_HOOKED: list[Any] = []


def _registered(*args: Any) -> None:
    _REGISTERED[0] += 1


def state(owner: torch.nn.Module) -> tuple:
    """``owner``'s training mode, which of its parameters require grad (a bit mask), and their first
    dtype: a few microseconds a call. The list of parameters is walked again only after a parameter or
    a module was registered somewhere (torch's global registration hooks; where the installed torch
    has none, at every call)."""
    if not _HOOKED:
        hooks = [getattr(torch.nn.modules.module, f"register_module_{kind}_registration_hook", None)
                 for kind in ("parameter", "module")]
        _HOOKED.extend(h(_registered) for h in hooks if h is not None)
        _HOOKED.append(len(_HOOKED) == 2)
    listed = _PARAMS.get(owner)
    if listed is None or listed[0] != _REGISTERED[0] or not _HOOKED[-1]:
        listed = _PARAMS[owner] = (_REGISTERED[0], list(owner.parameters()))
    mask = 0
    for i, p in enumerate(listed[1]):
        if p.requires_grad:
            mask |= 1 << i
    return owner.training, mask, listed[1][0].dtype if listed[1] else None
