"""Which checkpointed calls a sharding engine manages from inside, for the checkpoint fix.

FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``) and DeepSpeed ZeRO-3 gather a module's
parameters in hooks around that module's own forward, release them after it, and tie their backward
work (gathering again, reducing the gradients, releasing) to hooks and nodes on the graph that forward
builds. A module they manage *inside* a checkpointed call therefore needs its backward to run through
the graph its forward built, in order: the fast path (:mod:`gradpatch.checkpointing.recompute`) drops that
graph and produces the gradients later, in its own node's backward, after the engine has reduced
(FSDP2: reduce-scatter ran before the recompute, leaving gradients missing and stale) or while the
parameters are released (ZeRO-3: a full-size gradient for an empty partition). Such a call takes the
graph path, torch's non-reentrant checkpoint, whose recompute runs inside the autograd graph through
saved-tensor hooks, so the engine's hooks fire as they do without checkpointing; it runs with the
parameters the engine puts in place at that moment (no rebinding to the forward's tensors, which the
engine has since released or replaced).

A call on a module that is itself an engine's unit (``fully_shard`` on the block whose method is
checkpointed) stays on the fast path: its parameters are gathered before its forward calls the
checkpoint and again, the same tensors, before its backward, and its gradients reach them before the
engine's post-backward hook runs. DDP, ZeRO-1/2 and FSDP1 units wrapping the block from outside do not
change the parameters inside the call (FSDP1's views of its flat parameter already send the call to the
graph path, as any non-leaf parameter does).

Cost: nothing unless ``torch.distributed`` has a process group; then one walk over the call's modules
at each call (about 20 us for AudioLDM's BasicTransformerBlock, 24 modules, on CPU, DeepSpeed
imported), not cached, so that an engine applied after a first forward is seen.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterator

import torch

__all__ = ["sharded_inside", "modules_of", "engine_loaded"]


def sharded_inside(func: Callable[..., Any]) -> str | None:
    """The engine managing a module or parameter inside ``func``'s call (a description such as
    ``"FSDP2 (fully_shard) on attn1"``), or ``None``."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    units = _fsdp_classes()
    zero3 = "deepspeed" in sys.modules  # ZeRO-3 marks its parameters with ``ds_id``
    for owner in modules_of(func):
        stack = [owner]
        while stack:  # flat, no names: under 1 us a module; names only for a hit
            module = stack.pop()
            if zero3:
                for p in module._parameters.values():
                    if p is not None and "ds_id" in p.__dict__:
                        return f"DeepSpeed ZeRO-3 on {_name(owner, module) or type(owner).__name__}"
            for child in module._modules.values():
                if child is None:
                    continue
                if units and isinstance(child, units):
                    engine = next(label for cls, label in _FSDP_LABELS if isinstance(child, cls))
                    return f"{engine} on {_name(owner, child)}"
                stack.append(child)
    return None


def engine_loaded() -> bool:
    """Whether a sharding engine could be managing modules anywhere: a process group, and FSDP or
    DeepSpeed imported. For calls whose modules :func:`modules_of` cannot see (a sampler's denoiser,
    reached through attributes of objects that are not modules)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return any(name in sys.modules for name in (
        "torch.distributed.fsdp", "torch.distributed._composable.fsdp", "deepspeed"))


def _name(owner: torch.nn.Module, module: torch.nn.Module) -> str:
    return next((n for n, m in owner.named_modules() if m is module), "")


def modules_of(func: Callable[..., Any]) -> Iterator[torch.nn.Module]:
    """The modules ``func`` evidently calls: itself, its ``__self__``, a ``functools.partial``'s
    function and arguments, and the modules its closure cells hold."""
    owner = getattr(func, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(func, "__closure__", None) is None:
        yield owner  # upstream's ``self._forward``
        return
    seen: set[int] = set()
    stack: list[Any] = [func]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            yield obj
            continue
        if isinstance(obj, functools.partial):
            stack += [obj.func, *obj.args, *obj.keywords.values()]
            continue
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            stack.append(owner)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value):
                stack.append(value)


@functools.lru_cache(maxsize=None)
def _fsdp_classes() -> tuple[type, ...]:
    """FSDP2's ``FSDPModule`` and FSDP1's ``FullyShardedDataParallel``, those this torch has."""
    found = []
    try:
        from torch.distributed.fsdp import FSDPModule as fsdp2  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule as fsdp2  # torch 2.4, 2.5
        except ImportError:
            fsdp2 = None
    if fsdp2 is not None:
        found.append((fsdp2, "FSDP2 (fully_shard)"))
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as fsdp1
        found.append((fsdp1, "FSDP1 (FullyShardedDataParallel)"))
    except ImportError:
        pass
    _FSDP_LABELS[:] = found
    return tuple(cls for cls, _ in found)


_FSDP_LABELS: list[tuple[type, str]] = []  # filled by _fsdp_classes
