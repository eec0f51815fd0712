"""What copy on write (:mod:`gradpatch.sampling.generic.copy_on_write`) holds of a tensor saved for
backward: :class:`Saved` (packed by the call's own hooks) and :class:`Through` (saved through another
pair of hooks), each keeping a copy once the tensor is about to be written; and the storage a tensor
lives on, by which writes find them."""
from __future__ import annotations

import weakref

import torch


class Saved:
    """A tensor saved for backward, by reference, until a write makes it keep a copy."""

    __slots__ = ("tensor", "version", "copy", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version
        self.copy: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self.copy is not None:
            return self.copy
        if self.tensor._version != self.version:
            raise RuntimeError("gradpatch.differentiable: a tensor saved for backward was modified in place by a "
                               "write gradpatch did not see: one that torch does not dispatch through "
                               "__torch_function__ (a .data copy, a C++ extension), or one the step made only after "
                               "its first evaluations, which wrote nothing saved (later ones run unwatched); its "
                               "gradient cannot be computed. Make that write out of place")
        return self.tensor

    def protect(self) -> None:
        """Keep a copy: the tensor is about to be written."""
        if self.copy is None:
            with torch.no_grad():
                self.copy = self.value().detach().clone()


class Through:
    """A tensor saved through another pair of saved-tensor hooks (the caller's, or the sampler's own
    ``save_on_cpu``), held weakly: those hooks keep what they keep (a copy on the CPU, or the tensor
    itself). If they kept the tensor itself and it is written, the copy taken before the write is
    what backward gets."""

    __slots__ = ("ref", "version", "key", "copy", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ref, self.version, self.key = weakref.ref(tensor), tensor._version, storage_key(tensor)
        self.copy: torch.Tensor | None = None

    def protect(self) -> None:
        tensor = self.ref()
        if self.copy is None and tensor is not None and tensor._version == self.version:
            with torch.no_grad():
                self.copy = tensor.detach().clone()

    def value(self, unpacked: torch.Tensor) -> torch.Tensor:
        """What backward gets, given what the other hooks unpacked."""
        if self.key is None or storage_key(unpacked) != self.key:
            return unpacked  # they kept a copy of their own (moved to the CPU and back, recomputed)
        if self.copy is not None:
            return self.copy
        if unpacked._version != self.version:
            raise RuntimeError("gradpatch.differentiable: a tensor saved for backward (through saved-tensor hooks "
                               "that keep it by reference) was modified in place by an operation that gradpatch "
                               "did not see; its gradient cannot be computed")
        return unpacked


def storage_pointer(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    pointer = storage_pointer(tensor)
    return (tensor.device, pointer) if pointer else None
