"""The ``torch.enable_grad()`` blocks that code other than gradpatch's holds open during a ``grad_steps``
call (guidance that differentiates through the step: DPS, guided-diffusion's ``cond_fn_with_grad``).

A step evaluated inside one is recorded as the code asks, also in the cut steps
(:func:`gradpatch.sampling.run.run_step`): the guidance's ``torch.autograd.grad`` needs its graph.
What the cut then changes is the mode the outermost block restores when it exits: grad off while the
cut lasts, on once step N-K-1 ended, at which moment :attr:`Regions.on_close` opens the window
(:mod:`gradpatch.sampling.steps.window`) over what the block computed from the cut evaluations.

While at least one such call is active, ``enable_grad.__enter__``/``__exit__`` are patched at class
level (reference counted); in every other context they run torch's own code. Blocks entered by
gradpatch's own code are not counted.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from contextvars import ContextVar
from typing import Any, Callable, Iterator

from torch.autograd import grad_mode


class Regions:
    """The blocks open now in one call (outermost first), and what to run when the last one exits."""

    def __init__(self) -> None:
        self.open: list[Any] = []
        self.on_close: Callable[[], None] | None = None

    def restore_on_exit(self, mode: bool) -> None:
        """Make the outermost open block put grad ``mode`` back when it exits."""
        if self.open and hasattr(self.open[0], "prev"):
            self.open[0].prev = mode


_current: ContextVar[Regions | None] = ContextVar("gradpatch_grad_regions", default=None)
_ORIGINAL: dict[str, Callable[..., Any]] = {"__enter__": grad_mode.enable_grad.__enter__, "__exit__": grad_mode.enable_grad.__exit__}


def _enter(self: Any) -> None:
    regions = _current.get()
    out = _ORIGINAL["__enter__"](self)
    if regions is not None and not str(sys._getframe(1).f_globals.get("__name__", "")).startswith("gradpatch"):
        self.__dict__["_gradpatch_region"] = regions
        regions.open.append(self)
    return out


def _exit(self: Any, *exc: Any) -> None:
    regions = self.__dict__.pop("_gradpatch_region", None)
    out = _ORIGINAL["__exit__"](self, *exc)
    if regions is not None:
        if any(r is self for r in regions.open):
            regions.open = [r for r in regions.open if r is not self]
        if not regions.open and regions.on_close is not None:
            on_close, regions.on_close = regions.on_close, None
            on_close()
    return out


_lock = threading.Lock()
_users = 0


@contextlib.contextmanager
def tracking(regions: Regions) -> Iterator[None]:
    """Count the blocks entered in this context into ``regions`` for the duration of the block."""
    global _users
    with _lock:
        if _users == 0:
            for name, ours in (("__enter__", _enter), ("__exit__", _exit)):
                _ORIGINAL[name] = vars(grad_mode.enable_grad)[name]  # whatever is there now
                setattr(grad_mode.enable_grad, name, ours)
        _users += 1
    token = _current.set(regions)
    try:
        yield
    finally:
        _current.reset(token)
        with _lock:
            _users -= 1
            if _users == 0:
                for name, ours in (("__enter__", _enter), ("__exit__", _exit)):
                    if vars(grad_mode.enable_grad).get(name) is ours:
                        setattr(grad_mode.enable_grad, name, _ORIGINAL[name])
