"""What the fast path's forward saves for backward (:mod:`gradpatch.checkpointing.recompute`, **Memory**).

That forward builds the block's graph only to read which leaves the outputs depend on, then drops it;
the node it makes recomputes the block in backward. Dropping the graph frees its saved tensors only if
nothing else holds the graph: a reference cycle through it (module hooks registered with
``register_multi_grad_hook``, as torch's ``ModTracker``/``MemTracker`` do on every module's inputs and
outputs) kept every saved activation of the block until the garbage collector ran. Under the hooks of
:func:`forward_saves` the graph saves nothing worth holding, whatever holds it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import Tensor


__all__ = ["forward_saves"]

_hooks_enabled: Callable[[], bool] = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled",
                                             lambda: True)


def forward_saves() -> Any:
    """Saved-tensor hooks for the fast path's forward: each tensor dropped as it is saved (the pack hook
    is ``id``, from C: no Python frame, the tensor not kept), so an activation lives as long as the
    forward uses it, as in torch's non-reentrant checkpoint. Where saved-tensor hooks are disabled
    (``torch.autograd.graph.disable_saved_tensors_hooks``) none: the graph holds what it saves, as
    without this."""
    if not _hooks_enabled():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(id, _dropped)


def _dropped(packed: Any) -> Tensor:
    raise RuntimeError(
        "checkpoint: a tensor computed inside a checkpointed block reached backward other than through "
        "the block's return value (stored on the side, in an attribute or a list, while the block ran): "
        "the block keeps only its inputs and recomputes its outputs, so that tensor's graph has nothing "
        "saved. Return it from the block, or run the block without recompute "
        "(gradpatch.checkpoint_policy_scope(\"never\"), GRADPATCH_CHECKPOINT=never or its own flag=False)")
