"""The values of the keywords every patched sampler takes, ``cache``, ``grad_steps`` (also a range
``(lo, hi)``, drawn per call: :meth:`SamplingOptions.drawn`), ``checkpoint_steps`` (also
``"budget:<size>"`` and ``"peak:<size>"``), and their validation: a wrong type is a TypeError (``cache="False"`` is not read
by truth value), a value out of range a ValueError. When each is
checked, defaults, joining and misspellings: :mod:`gradpatch.sampling.contract`. Torch-free.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Callable


def _step_count(value: Any, what: str) -> int:
    """``value`` as a positive ``int``: an ``int``, a NumPy integer or an integer tensor of one element;
    a ``bool``, a float or a string is a TypeError, below 1 a ValueError. ``what``: the message's start."""
    try:  # int, numpy integers, 0-d integer tensors; not bool (True is no step count), floats, strings
        if isinstance(value, bool) or str(getattr(value, "dtype", "")) == "torch.bool":
            raise TypeError
        steps = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}, not {value!r} ({type(value).__name__})") from None
    if steps < 1:
        raise ValueError(f"{what}, not {value!r}")
    return steps


def grad_steps_range(value: Any) -> tuple[int, int] | None:
    """``grad_steps=(lo, hi)`` checked: a tuple (or list) of two positive integers, ``lo <= hi``; None
    when ``value`` is not a tuple or list (a single step count, checked by :class:`SamplingOptions`)."""
    if not isinstance(value, (tuple, list)):
        return None
    what = f"grad_steps=(lo, hi) must be two positive integers with lo <= hi (a graph through the last K " \
           f"steps, K drawn in [lo, hi]), not {value!r}"
    if len(value) != 2:
        raise TypeError(what)
    try:
        lo, hi = (_step_count(v, what) for v in value)
    except TypeError:
        raise TypeError(what) from None
    except ValueError:
        raise ValueError(what) from None
    if lo > hi:
        raise ValueError(what)
    return lo, hi


@dataclass(frozen=True)
class SamplingOptions:
    """The memory options of one ``cache=False`` call. ``grad_steps`` is None or a positive integral
    number: an ``int``, a NumPy integer or an integer tensor of one element (stored as ``int``); a
    ``bool``, a float or a string is a TypeError. A range ``(lo, hi)`` is stored in
    ``grad_steps_range`` (``grad_steps`` None) until :meth:`drawn` picks the call's K."""

    grad_steps: int | None = None
    checkpoint_steps: bool = False
    step_budget: int | None = None
    """Bytes of ``checkpoint_steps="budget:<size>"`` (``checkpoint_steps`` is then True)."""
    step_peak: int | None = None
    """Bytes of ``checkpoint_steps="peak:<size>"`` (``checkpoint_steps`` is then True)."""
    grad_steps_range: tuple[int, int] | None = None
    """``grad_steps=(lo, hi)``: K is drawn per call, uniformly in ``[lo, hi]``, both ends included."""

    def __post_init__(self) -> None:
        span = grad_steps_range(self.grad_steps)
        if span is not None:
            object.__setattr__(self, "grad_steps", None)
            object.__setattr__(self, "grad_steps_range", span)
        elif self.grad_steps is not None:
            object.__setattr__(self, "grad_steps", _step_count(
                self.grad_steps, "grad_steps must be a positive integer, a range (lo, hi) or None"))
        if self.grad_steps_range is not None:
            object.__setattr__(self, "grad_steps_range", grad_steps_range(tuple(self.grad_steps_range)))

    @property
    def truncates(self) -> bool:
        """Whether ``grad_steps`` was given (a count or a range)."""
        return self.grad_steps is not None or self.grad_steps_range is not None

    def drawn(self, generator: Any = None) -> SamplingOptions:
        """These options with ``grad_steps`` drawn from ``grad_steps_range`` (itself where there is no
        range, or a K already drawn): K uniform in ``[lo, hi]``, both ends included, by
        ``torch.randint`` from ``generator`` (a ``torch.Generator``) or else torch's default generator,
        so ``torch.manual_seed`` reproduces it. ``lo == hi`` draws nothing (no generator advances)."""
        if self.grad_steps_range is None or self.grad_steps is not None:
            return self
        lo, hi = self.grad_steps_range
        if lo == hi:
            return replace(self, grad_steps=lo)
        import torch  # imported already by every sampler that takes grad_steps

        if not isinstance(generator, torch.Generator):
            generator = None
        device = generator.device if generator is not None else "cpu"
        return replace(self, grad_steps=int(torch.randint(lo, hi + 1, (1,), generator=generator, device=device)))


OPTIONS = ("cache", "grad_steps", "checkpoint_steps")
"""The keywords every patched sampler takes."""


#: Callables told of each patched-sampler call that runs the original (``cache=True``, the default)
#: while grad mode is on: ``observer(sampler_name, owner)``, ``owner`` the sampler's object or its
#: first argument. The doctor listens while it watches a step (such a call's output has no graph);
#: empty otherwise, which costs one truth test per call.
cached_call_observers: list[Callable[[str, Any], None]] = []


def note_cached_call(name: str, owner: Any) -> None:
    """Tell :data:`cached_call_observers` that ``name`` ran with ``cache=True`` under grad mode."""
    if not cached_call_observers:
        return
    import torch  # imported already by every sampler fix that calls this

    if torch.is_grad_enabled():
        for observer in list(cached_call_observers):
            observer(name, owner)


def check_flag(name: str, value: object) -> None:
    """TypeError unless ``value`` is a boolean (``bool`` or ``numpy.bool_``): ``cache="False"`` or
    ``cache=0`` would otherwise be read by truth value, silently choosing the other code path."""
    if not (isinstance(value, bool) or type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")):
        raise TypeError(f"{name} must be True or False, not {value!r} ({type(value).__name__})")


def step_budget(checkpoint_steps: object) -> int | None:
    """The bytes of ``checkpoint_steps="budget:<size>"`` (sizes as for the checkpoint policy:
    ``"budget:512MiB"``, ``"budget:2GB"``, ``"budget:1.5e9"``); None for True, False or
    ``"peak:<size>"`` (:func:`step_peak`). A bad size is a ValueError; another string (``"yes"``, read
    by truth value) or type a TypeError."""
    from gradpatch.settings import PREFIX, is_peak

    text = _step_size(checkpoint_steps)
    if text is None or is_peak(text):
        return None
    return _bytes(checkpoint_steps, PREFIX, text)


def step_peak(checkpoint_steps: object) -> int | None:
    """The bytes of ``checkpoint_steps="peak:<size>"`` (the step's peak, sizes as for
    :func:`step_budget`: ``"peak:40MiB"``); None for True, False or ``"budget:<size>"``; errors as
    :func:`step_budget`'s."""
    from gradpatch.settings import PEAK_PREFIX, is_peak

    text = _step_size(checkpoint_steps)
    if text is None or not is_peak(text):
        return None
    return _bytes(checkpoint_steps, PEAK_PREFIX, text)


def _step_size(checkpoint_steps: object) -> str | None:
    """``checkpoint_steps`` stripped if it is a ``"budget:"`` or ``"peak:"`` string; None for a boolean;
    TypeError otherwise."""
    if not isinstance(checkpoint_steps, str):
        check_flag("checkpoint_steps", checkpoint_steps)
        return None
    from gradpatch.settings import EXAMPLE, PEAK_EXAMPLE, is_budget, is_peak

    text = checkpoint_steps.strip()
    if not (is_budget(text) or is_peak(text)):
        raise TypeError(f"checkpoint_steps must be True or False, or a string 'budget:<size>' ({EXAMPLE!r}) or "
                        f"'peak:<size>' ({PEAK_EXAMPLE!r}), not {checkpoint_steps!r} (str)")
    return text


def _bytes(checkpoint_steps: object, prefix: str, text: str) -> int:
    from gradpatch.settings import parse_size

    try:
        return parse_size(text[len(prefix):].strip())
    except ValueError as error:
        raise ValueError(f"checkpoint_steps={checkpoint_steps!r}: {error}") from None
