"""Instance-attribute shadows: ``obj.<name>`` replaced for the duration of a block, shared by
concurrent users (reference counted) and put back exactly (or removed) when the last one leaves, unless
someone replaced it meanwhile. A shadowed object's copies and pickles (``copy.deepcopy``,
``torch.save``) leave the shadows out (:class:`_OwnState`). What a shadow does, and in which context it
acts, is its maker's: :mod:`gradpatch.sampling.run` makes ``eval``, ``forward`` and ``clear_cache``
shadows that act only where a ``cache=False`` call is active.
"""
from __future__ import annotations

import functools
import os
import threading
import types
from typing import Any, Callable

# Instance-attribute shadows. One shadow per (object, name) is shared by concurrent calls (reference
# counted) and acts only in contexts where a cache=False call is active: another thread sampling the
# same model with cache=True at the same time still gets the real eval(), cache and clear_cache().
# They are invisible to copies: while an object holds one, its __getstate__ (which copy.copy,
# copy.deepcopy, pickle, torch.save, dill and cloudpickle ask) leaves them out of the state.
_lock = threading.Lock()
_shadows: dict[tuple[int, str], list[Any]] = {}  # key -> [users, had_own, own_value, installed]


def _reset_lock_in_child() -> None:  # a fork while another thread held it must not deadlock the child
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_in_child)


class shadow:
    """``obj.<name>`` is ``make(<its value>)`` for the block: an instance attribute, put back (or
    removed) when the last concurrent user leaves, unless someone replaced it meanwhile. Each is
    entered once. (A class, not a generator-based context manager: a checkpointed sampler step's
    recompute enters its call's shadows again.)"""

    __slots__ = ("obj", "name", "make", "state", "entry")

    def __init__(self, obj: object, name: str, make: Callable[[Any], Any]) -> None:
        self.obj, self.name, self.make = obj, name, make
        hide = name != "__getstate__" and not isinstance(obj, (types.ModuleType, type))
        self.state = shadow(obj, "__getstate__", functools.partial(_OwnState, obj)) if hide else None
        self.entry: list[Any] | None = None

    def __enter__(self) -> None:
        if self.entry is not None:
            raise RuntimeError("a shadow is entered once; make another for another block")
        obj, name = self.obj, self.name
        if self.state is not None:
            self.state.__enter__()
        try:
            with _lock:
                entry = _shadows.get((id(obj), name))
                if entry is None:
                    own = vars(obj)
                    installed = self.make(getattr(obj, name, None) if name == "__getstate__" else getattr(obj, name))
                    entry = _shadows[(id(obj), name)] = [0, name in own, own.get(name), installed]
                    object.__setattr__(obj, name, installed)
                entry[0] += 1
        except BaseException:
            if self.state is not None:
                self.state.__exit__(None, None, None)
            raise
        self.entry = entry

    def __exit__(self, *exc: object) -> None:
        obj, name, entry = self.obj, self.name, self.entry
        assert entry is not None
        try:
            with _lock:
                entry[0] -= 1
                if entry[0] == 0:
                    del _shadows[(id(obj), name)]
                    if vars(obj).get(name) is entry[3]:  # else someone replaced it meanwhile: theirs stays
                        object.__setattr__(obj, name, entry[2]) if entry[1] else object.__delattr__(obj, name)
        finally:
            if self.state is not None:
                self.state.__exit__(*exc)


class _OwnState:
    """``obj.__getstate__`` while ``obj`` holds shadows: the state its own ``__getstate__`` gives, each
    shadow replaced by the attribute it stands in for (or left out), so that a copy or a pickle taken
    during a call is its own object afterwards, computing with its own weights."""

    def __init__(self, obj: object, own: Callable[[], Any] | None) -> None:
        self.obj, self.own = obj, own

    def __call__(self) -> Any:
        state = self.own() if self.own is not None else dict(vars(self.obj))
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):  # (dict, slots)
            return self._without_shadows(state[0]), state[1]
        return self._without_shadows(state) if isinstance(state, dict) else state

    def _without_shadows(self, state: dict) -> dict:
        with _lock:
            mine = [(name, entry) for (key, name), entry in _shadows.items() if key == id(self.obj)]
        state = dict(state)
        for name, (_, had_own, own, installed) in mine:
            if state.get(name) is installed:
                if had_own:
                    state[name] = own
                else:
                    del state[name]
        return state
