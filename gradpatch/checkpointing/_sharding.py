"""Which checkpointed calls a sharding engine manages from inside, for the checkpoint fix.

FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``) and DeepSpeed ZeRO-3 gather a module's
parameters in hooks around that module's own forward, release them after it, and tie their backward
work (gathering again, reducing the gradients, releasing) to hooks and nodes on the graph that forward
builds. A module they manage *inside* a checkpointed call therefore needs its backward to run through
the graph its forward built, in order: the fast path (:mod:`gradpatch.checkpointing._recompute`) drops that
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
(about 1 us a module on CPU).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch

__all__ = ["sharded_inside", "modules_of"]


def sharded_inside(func: Callable[..., Any]) -> str | None:
    """The engine managing a module or parameter inside ``func``'s call (a description such as
    ``"FSDP2 (fully_shard) on attn1"``), or ``None``."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    fsdp2, fsdp1 = _fsdp_classes()
    for owner in modules_of(func):
        for name, module in owner.named_modules():
            if name and fsdp2 is not None and isinstance(module, fsdp2):
                return f"FSDP2 (fully_shard) on {name}"
            if name and fsdp1 is not None and isinstance(module, fsdp1):
                return f"FSDP1 (FullyShardedDataParallel) on {name}"
            for pname, p in module._parameters.items():
                if p is not None and hasattr(p, "ds_id"):
                    return f"DeepSpeed ZeRO-3 on {'.'.join(x for x in (name, pname) if x)}"
    return None


def modules_of(func: Callable[..., Any]) -> Iterator[torch.nn.Module]:
    """The modules ``func`` evidently calls: itself, its ``__self__``, a ``functools.partial``'s
    function and arguments, and the modules its closure cells hold."""
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
            if isinstance(value, (torch.nn.Module, functools.partial)) or callable(value):
                stack.append(value)


@functools.lru_cache(maxsize=None)
def _fsdp_classes() -> tuple[type | None, type | None]:
    """(FSDP2's ``FSDPModule``, FSDP1's ``FullyShardedDataParallel``), ``None`` where absent."""
    try:
        from torch.distributed.fsdp import FSDPModule as fsdp2  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule as fsdp2  # torch 2.4, 2.5
        except ImportError:
            fsdp2 = None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as fsdp1
    except ImportError:
        fsdp1 = None
    return fsdp2, fsdp1
