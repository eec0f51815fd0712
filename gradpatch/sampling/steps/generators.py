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
    bound: list[tuple[torch.nn.Module, str, torch.Generator]] = []
    found = reachable((args, kwargs, fn), bound=bound)
    return Replayed(fn, found, bound) if found else fn  # type: ignore[return-value]


class Replayed:
    """``fn`` whose recompute draws from the ``torch.Generator`` objects it reaches (arguments, closure,
    the modules of a bound method) as the forward did: their states are taken before the forward, set
    for each recompute and put back after it (the caller's generators go on from where the forward
    left them). torch's checkpoint replays only the global RNG. A module attribute that held one of them
    in the forward and holds another object since (a sampler reseeding per step) is set back to it for
    the recompute."""

    __slots__ = ("fn", "generators", "states", "ran", "bound")

    def __init__(self, fn: Callable[..., Any], generators: list[torch.Generator],
                 bound: list[tuple[torch.nn.Module, str, torch.Generator]] = ()) -> None:  # type: ignore[assignment]
        self.fn, self.generators, self.ran, self.bound = fn, generators, False, bound
        self.states = [g.get_state() for g in generators]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ran:  # the forward
            self.ran = True
            return self.fn(*args, **kwargs)
        now = [g.get_state() for g in self.generators]
        for g, state in zip(self.generators, self.states):
            g.set_state(state)
        swaps = [(m, k, g, m.__dict__.get(k, _MISSING)) for m, k, g in self.bound if m.__dict__.get(k) is not g]
        for m, k, g, _ in swaps:
            m.__dict__[k] = g
        try:
            return self.fn(*args, **kwargs)
        finally:
            for m, k, _, value in reversed(swaps):
                if value is _MISSING:
                    m.__dict__.pop(k, None)
                else:
                    m.__dict__[k] = value
            for g, state in zip(self.generators, now):
                g.set_state(state)


_MISSING = object()


def reachable(root: Any, known: dict | None = None, bound: list | None = None) -> list[torch.Generator]:
    """The generators reachable from ``root``. A module's generators are its and its submodules'
    attributes that are generators, and those reachable from their attributes that are partials.

    ``known``: a dict that lives as long as one ``cache=False`` call (``SamplingRun.known``; also taken
    from the step's :class:`gradpatch.sampling.steps.inputs.AsWas` when the walk meets it), where which
    attributes of a module's subtree those are is noted at the call's first evaluation and read again at
    the next ones (walking a UNet's ~500 modules per evaluation cost a quarter of its time): a generator
    reassigned is seen; one set on an attribute that held none at the first evaluation, or on a submodule
    registered since, is not (as :mod:`gradpatch.sampling.steps.inputs` finds buffers).

    ``bound``: gets ``(module, attribute name, generator)`` for each generator a module attribute holds."""
    found: dict[int, torch.Generator] = {}
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(root, 0)]
    while todo:
        obj, depth = todo.pop()
        kind = type(obj)
        if issubclass(kind, torch.Generator):
            found[id(obj)] = obj
        if id(obj) in seen or depth > 6 or issubclass(kind, _OPAQUE):
            continue
        seen.add(id(obj))
        if issubclass(kind, torch.nn.Module):
            items = _held(obj, seen) if known is None else _noted(obj, known)
            todo += [(v, depth + 1) for _, _, v in items]
            if bound is not None:
                bound += [item for item in items if issubclass(type(item[2]), torch.Generator)]
        elif issubclass(kind, (tuple, list)):
            todo += [(v, depth + 1) for v in obj]
        elif issubclass(kind, dict):
            todo += [(v, depth + 1) for v in obj.values()]
        elif issubclass(kind, functools.partial):
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
            if callable(inner) and kind.__module__.startswith("gradpatch."):
                todo.append((inner, depth + 1))
                if known is None:  # AsWas: the call's notes
                    known = getattr(obj, "known", None)
    return list(found.values())


# Types never walked. Checked with issubclass on the type: isinstance against torch.Generator runs a
# Python __instancecheck__ (torch's custom-class metaclass), 5 us a call, which made the walk of a
# UNet's module attributes cost a third of a sampler step's forward.
_OPAQUE = (torch.Tensor, torch.Generator, str, bytes, int, float, type)
_HELD = (torch.Generator, functools.partial)


def _held(module: torch.nn.Module, seen: set[int]) -> list[tuple[torch.nn.Module, str, Any]]:
    """``(submodule, attribute name, value)`` of the generators and partials held as attributes by
    ``module`` and its submodules, skipping the submodules (and so their subtrees) already walked; marks
    those it walks as seen."""
    out: list[tuple[torch.nn.Module, str, Any]] = []
    stack = [module]
    while stack:
        m = stack.pop()
        found = [(m, k, v) for k, v in m.__dict__.items() if issubclass(type(v), _HELD)]
        if found:
            out += found
        for child in m._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return out


def _noted(module: torch.nn.Module, known: dict) -> list[tuple[torch.nn.Module, str, Any]]:
    """:func:`_held` through ``known``: the attributes found at the first call, read now."""
    entry = known.get(("generators", id(module)))
    if entry is None or entry[0] is not module:
        out = _held(module, set())
        known[("generators", id(module))] = (module, [(m, k) for m, k, _ in out])
        return out
    return [(m, k, v) for m, k in entry[1] if issubclass(type(v := m.__dict__.get(k)), _HELD)]
