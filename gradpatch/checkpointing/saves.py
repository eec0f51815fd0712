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

from gradpatch.checkpointing.compat import top_saved_tensors_hooks

__all__ = ["Held", "forward_saves"]

_hooks_enabled: Callable[[], bool] = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled",
                                             lambda: True)


class Held:
    """What a forward run with ``reuse`` saved: each tensor and its version, by position. :meth:`settle`
    hands them to the saved-tensor hooks that were in force around the call (a caller's ``save_on_cpu``,
    ``gradpatch.differentiable``'s copy on write, torch's checkpoint's) once the caller keeps the graph,
    so that it is saved as it would have been; never before, since the fast path mostly drops them (an
    offload of every activation for nothing)."""

    __slots__ = ("items", "outer")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.outer = top_saved_tensors_hooks() if _hooks_enabled() else None

    def pack(self, tensor: Tensor) -> int:
        self.items.append((tensor, tensor._version))
        return len(self.items) - 1

    def unpack(self, index: int) -> Tensor:
        tensor, version = self.items[index]
        if version is None:  # settled: the caller's hooks have it
            return self.outer[1](tensor)  # type: ignore[index]
        if tensor._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a tensor of shape {tuple(tensor.shape)} saved at version {version} is at version "
                f"{tensor._version} (inside a step that gradpatch's checkpoint ran and kept)")
        return tensor

    def settle(self) -> None:
        outer = self.outer
        if outer is None:
            return
        for i, (tensor, version) in enumerate(self.items):
            if tensor._version == version:  # detached: a tensor saved as itself would tie its node into a cycle
                self.items[i] = (outer[0](tensor.detach()), None)

    def clear(self) -> None:
        self.items.clear()


def forward_saves(held: Held | None) -> Any:
    """Saved-tensor hooks for the fast path's forward. ``held is None``: each tensor dropped as it is
    saved (the pack hook is ``id``, from C: no Python frame, the tensor not kept), so an activation lives
    as long as the forward uses it, as in torch's non-reentrant checkpoint. Otherwise (a caller that keeps
    the forward's graph when the node cannot take the call): each tensor held in ``held``, which the
    caller clears once the node is made or settles if it keeps the graph. Where saved-tensor hooks are
    disabled (``torch.autograd.graph.disable_saved_tensors_hooks``) none: the graph holds what it saves,
    as without this."""
    if not _hooks_enabled():
        return contextlib.nullcontext()
    if held is None:
        return torch.autograd.graph.saved_tensors_hooks(id, _dropped)
    return torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack)


def _dropped(packed: Any) -> Tensor:
    raise RuntimeError(
        "checkpoint: a tensor computed inside a checkpointed block reached backward other than through "
        "the block's return value (stored on the side, in an attribute or a list, while the block ran): "
        "the block keeps only its inputs and recomputes its outputs, so that tensor's graph has nothing "
        "saved. Return it from the block, or run the block without recompute "
        "(gradpatch.checkpoint_policy_scope(\"never\"), GRADPATCH_CHECKPOINT=never or its own flag=False)")
