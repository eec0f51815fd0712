"""Storages resized in place, for the ``peak:<size>`` recorder (:mod:`gradpatch.checkpointing.budget.timeline`).

FSDP all-gathers a module's parameters into storages it keeps, and frees them, with
``UntypedStorage.resize_``, which no dispatch mode sees (torch's ``MemTracker`` wraps it for the same
reason). While a step is recorded or a plan is being made (:func:`planning`, from the plan's first
measuring step until its own step is recorded), the method is wrapped, around whatever was there
before: each resize is passed to the recordings in progress (``recording.resized``), and the storages
it grew are noted, so that a recording that could only start at a step's first checkpointed block
counts those grown before it (:func:`grown`: FSDP's root parameters, all-gathered as the forward began). Otherwise the
method is torch's own, or what a tool wrapped on top of this one left there.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator

import torch

_ABSENT = object()
_state: dict[str, Any] = {"lock": threading.Lock(), "replaced": _ABSENT, "inner": None, "planning": False}
_following: list[Any] = []  # the recordings in progress
_grown: dict[int, tuple[Any, int]] = {}  # id -> (weak reference to a storage grown in place, its size)
_inside = threading.local()


def planning(on: bool) -> None:
    """Whether a plan is being made: resizes are watched from its first steps."""
    if _state["planning"] is on:
        return
    _state["planning"] = on
    _watch()


def follow(recording: Any) -> None:
    """Pass each resize to ``recording.resized(storage, old, new)`` until :func:`leave`."""
    with _state["lock"]:
        _following.append(recording)
    _watch()


def leave(recording: Any) -> None:
    with _state["lock"]:
        if recording in _following:
            _following.remove(recording)
    _watch()


def grown() -> Iterator[tuple[Any, int]]:
    """(storage, bytes) of each storage grown in place since resizes were watched, still that size."""
    for ref, size in list(_grown.values()):
        storage = ref()
        if storage is not None and storage.nbytes() == size:
            yield storage, size


def _watch() -> None:
    """Wrap ``UntypedStorage.resize_`` while following or planning; put back what was there after."""
    with _state["lock"]:
        wanted = bool(_following) or _state["planning"]
        current = torch.UntypedStorage.__dict__.get("resize_", _ABSENT)
        if wanted and current is not _resize:
            _state["replaced"], _state["inner"] = current, torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign, assignment]
        elif not wanted and current is _resize:  # (if wrapped on top since, as MemTracker does: left to it)
            _grown.clear()
            if _state["replaced"] is _ABSENT:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = _state["replaced"]  # type: ignore[method-assign]


def _resize(storage: Any, size: int) -> Any:
    if getattr(_inside, "on", False):  # re-entered through a wrapper put on top of this one
        return torch._C.StorageBase.resize_(storage, size)  # type: ignore[attr-defined]
    old = storage.nbytes()
    _inside.on = True
    try:
        out = _state["inner"](storage, size)
    finally:
        _inside.on = False
    new = storage.nbytes()
    if new != old and (_following or _state["planning"]):
        if new > 0:
            _grown[id(storage)] = (weakref.ref(storage), new)
        else:
            _grown.pop(id(storage), None)
        for recording in list(_following):
            recording.resized(storage, old, new)
    return out
