"""What a checkpointed block's plan entry is keyed by, for :mod:`gradpatch.checkpointing.budget.policy`:
the call's :func:`signature` and the block's :func:`state` (training mode, trainable set, dtype, and the
settings of its submodules). A block whose key changes is measured again, so a plan follows gradual
unfreezing, eval/train, autocast and a changed dropout probability.

**Shape buckets.** The signature holds each input's shape rounded up, dimension by dimension, to a power
of two (:func:`bucket`): calls at lengths 300 and 400 are one block, planned once, where a new length at
every step (speech, text) would otherwise make a new block at every step, measured and never planned.
Within a bucket the bytes a block keeps grow with its inputs: the policy keeps a block only at input
sizes up to the largest it measured (:func:`size_of`), and measures a larger call again.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from gradpatch.checkpointing.compat import autocast_dtype, autocast_enabled

#: Module attributes whose values are part of the key: flags, probabilities, modes. Integers are left
#: out (sizes, which do not change, and counters, which change at every call).
SETTINGS = (bool, float, str)


def bucket(shape: torch.Size) -> tuple[int, ...]:
    """``shape`` with each dimension above 1 rounded up to a power of two."""
    return tuple(d if d <= 1 else 1 << (d - 1).bit_length() for d in shape)


def signature(args: tuple, kwargs: dict | None) -> tuple:
    """The inputs' shape buckets, dtypes, devices and ``requires_grad``, and the autocast dtypes in
    force."""
    values = args if kwargs is None else (*args, *kwargs.values())
    return (autocast_enabled("cpu") and autocast_dtype("cpu"),
            autocast_enabled("cuda") and autocast_dtype("cuda"),
            *[(bucket(v.shape), v.dtype, v.device, v.requires_grad) if isinstance(v, Tensor) else None
              for v in values])


def size_of(args: tuple, kwargs: dict | None) -> int:
    """The inputs' elements, all tensors together: what orders calls within a bucket."""
    values = args if kwargs is None else (*args, *kwargs.values())
    return sum(v.numel() for v in values if isinstance(v, Tensor))


#: Each module's parameters and settings as last listed, with the registration count they were
#: listed at: (count, parameters, [(a submodule's ``__dict__``, attribute name)]).
_PARAMS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[Tensor], list[tuple[dict, str]]]] = \
    weakref.WeakKeyDictionary()
_REGISTERED = [0]  # parameters and submodules registered anywhere (hooks installed on first use)
_HOOKED: list[Any] = []


def _registered(*args: Any) -> None:
    _REGISTERED[0] += 1


def state(owner: torch.nn.Module) -> tuple:
    """``owner``'s training mode, which of its parameters require grad (a bit mask), their first
    dtype, and the :data:`SETTINGS` attributes of its submodules (dropout's ``p``, a submodule's
    ``training``): a few microseconds a call. The parameters and the settings' names are listed again
    only after a parameter or a module was registered somewhere (torch's global registration hooks;
    where the installed torch has none, at every call); the settings' values are read at every call."""
    if not _HOOKED:
        hooks = [getattr(torch.nn.modules.module, f"register_module_{kind}_registration_hook", None)
                 for kind in ("parameter", "module")]
        _HOOKED.extend(h(_registered) for h in hooks if h is not None)
        _HOOKED.append(len(_HOOKED) == 2)
    listed = _PARAMS.get(owner)
    if listed is None or listed[0] != _REGISTERED[0] or not _HOOKED[-1]:
        listed = _PARAMS[owner] = (_REGISTERED[0], list(owner.parameters()), _settings(owner))
    mask = 0
    for i, p in enumerate(listed[1]):
        if p.requires_grad:
            mask |= 1 << i
    return (owner.training, mask, listed[1][0].dtype if listed[1] else None,
            tuple([d.get(name) for d, name in listed[2]]))


def _settings(owner: torch.nn.Module) -> list[tuple[dict, str]]:
    found = []
    for module in owner.modules():
        dropout = isinstance(module, _DROPOUT)  # its p, also where given as an integer (Dropout(0))
        found += [(module.__dict__, name) for name, value in module.__dict__.items()
                  if (type(value) in SETTINGS or dropout and name == "p")
                  and not (module is owner and name == "training")]
    return found


_DROPOUT = torch.nn.modules.dropout._DropoutNd
