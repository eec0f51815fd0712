"""The ``torch.Generator`` objects a denoiser evaluation reaches, replayed in its recompute: torch's
checkpoint replays only the global RNG, so a step drawing from an explicit generator (a seeded sampler)
would draw other numbers in backward than in its forward."""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


def wrap(fn: Callable[..., T], args: tuple, kwargs: dict) -> Callable[..., T]:
    """``fn``, replaying the generators it reaches (arguments, closure, the modules of a bound method) in
    every call after the first; ``fn`` itself when it reaches none."""
    found = reachable((args, kwargs, fn))
    return Replayed(fn, found) if found else fn  # type: ignore[return-value]


class Replayed:
    """``fn`` whose recompute draws from the ``torch.Generator`` objects it reaches (arguments, closure,
    the modules of a bound method) as the forward did: their states are taken before the forward, set
    for each recompute and put back after it (the caller's generators go on from where the forward
    left them). torch's checkpoint replays only the global RNG."""

    __slots__ = ("fn", "generators", "states", "ran")

    def __init__(self, fn: Callable[..., Any], generators: list[torch.Generator]) -> None:
        self.fn, self.generators, self.ran = fn, generators, False
        self.states = [g.get_state() for g in generators]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ran:  # the forward
            self.ran = True
            return self.fn(*args, **kwargs)
        now = [g.get_state() for g in self.generators]
        for g, state in zip(self.generators, self.states):
            g.set_state(state)
        try:
            return self.fn(*args, **kwargs)
        finally:
            for g, state in zip(self.generators, now):
                g.set_state(state)


def reachable(root: Any) -> list[torch.Generator]:
    found: dict[int, torch.Generator] = {}
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(root, 0)]
    while todo:
        obj, depth = todo.pop()
        if isinstance(obj, torch.Generator):
            found[id(obj)] = obj
        if id(obj) in seen or depth > 6 or isinstance(obj, (torch.Tensor, torch.Generator, str, bytes, int, float,
                                                            type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            todo += [(v, depth + 1) for m in obj.modules() for v in vars(m).values()
                     if isinstance(v, (torch.Generator, functools.partial))]
        elif isinstance(obj, (tuple, list)):
            todo += [(v, depth + 1) for v in obj]
        elif isinstance(obj, dict):
            todo += [(v, depth + 1) for v in obj.values()]
        elif isinstance(obj, functools.partial):
            todo += [(obj.func, depth + 1), (obj.args, depth + 1), (obj.keywords, depth + 1)]
        elif hasattr(obj, "__self__") and hasattr(obj, "__func__"):  # a bound method
            todo += [(obj.__self__, depth + 1), (obj.__func__, depth + 1)]
        elif callable(obj):
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    todo.append((cell.cell_contents, depth + 1))
                except ValueError:  # an empty cell
                    pass
            inner = getattr(obj, "fn", None)  # gradpatch's own wrappers (Replayed, inputs.AsWas)
            if callable(inner) and type(obj).__module__.startswith("gradpatch."):
                todo.append((inner, depth + 1))
    return list(found.values())
