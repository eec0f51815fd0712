"""What a sampler's autograd graph holds between forward and backward, measured independently of
gradpatch (tests of ``checkpoint_steps``; also imported by the background interpreters of the
release checks)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def saved_bytes_at_backward(model: torch.nn.Module, run: Callable[[], object]) -> tuple[object, int]:
    """``run()``'s result, and the bytes of the distinct storages autograd had saved for backward and
    still held when backward began (parameters excluded): what the graph keeps between forward and
    backward. Storages saved only for a while (a checkpointed evaluation's own graph, freed when it
    returned) do not count; a checkpoint's own saved-tensor hooks hide what they save."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict = {}
    held: list[int] = []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and not held:
            seen[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        # Detached: a saved output returned as itself would hold its own node (grad_fn -> saved
        # variable -> this tensor), a cycle that keeps a finished evaluation's graph alive.
        return tensor.detach()

    def unpack(tensor):
        if not held:  # the first unpack: the forward is over, nothing freed yet
            held.append(sum(size for ref, size in seen.values() if not ref.expired()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = run()
    return out, held[0] if held else 0
