"""The checkpoint fix's graph path: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

Taken where the fast path's single node cannot carry the gradients: ``func`` read a non-leaf tensor
it was not given (fast weights under ``functional_call`` or swapped into modules, a closure tensor
computed beforehand), returned an input or a view of one, something other than a tensor or a flat
tuple, or tensors sharing storage, or runs under ``torch.compile``; and where a sharding engine
manages modules inside ``func`` (:mod:`gradpatch.checkpointing.sharding`), whose hooks must see the
recompute inside the autograd graph. torch's checkpoint keeps the forward's graph and
recomputes only the saved tensors, so every tensor ``func`` reads gets its gradient; it costs the
forward's graph plus Python saved-tensor hooks (measured about 10% over upstream's time on a small
UNet on CPU, ``benchmarks/checkpoint_speed.py``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint


def graph_path(func: Callable[..., Any], args: tuple, kwargs: dict | None, rebind: bool = True) -> Any:
    """``func(*args, **kwargs)`` under torch's non-reentrant checkpoint, recomputing with the
    parameters its module holds now (see :func:`rebinding`), or with ``rebind=False`` with those it
    holds at the recompute (a sharding engine's, see :mod:`gradpatch.checkpointing.sharding`)."""
    return _torch_checkpoint(rebinding(func) if rebind else func, *args, use_reentrant=False,
                             **(kwargs or {}))


def rebinding(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func``, made to run with the parameters its module holds now. Non-leaf parameters (fast
    weights under ``functional_call``, DataParallel replicas) are often in the module only during
    the forward; the recompute, run later, would otherwise read other ones."""
    owner = getattr(func, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        return func
    where = [(m, n, t) for m in owner.modules() for n, t in m._parameters.items()]

    def run(*args: Any, **kwargs: Any) -> Any:
        with parameters_as(where):
            return func(*args, **kwargs)

    return run


@contextlib.contextmanager
def parameters_as(where: list[tuple[torch.nn.Module, str, Any]]) -> Iterator[None]:
    """Put these tensors back as these modules' parameters for the duration. On exit each entry is
    restored as it was (an entry that was absent is removed again), unless something else changed it
    in the meantime (an engine that unregisters and re-registers parameters in the module's forward):
    then that change stays."""
    absent: Any = object()
    swapped = [(m, n, t, m._parameters.get(n, absent)) for m, n, t in where
               if m._parameters.get(n, absent) is not t]
    for m, n, t, _ in swapped:
        m._parameters[n] = t
    try:
        yield
    finally:
        for m, n, t, before in swapped:
            if m._parameters.get(n, absent) is not t:
                continue
            if before is absent:
                del m._parameters[n]
            else:
                m._parameters[n] = before
