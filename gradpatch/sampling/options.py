"""The values of the keywords every patched sampler takes, ``cache``, ``grad_steps``,
``checkpoint_steps`` (also ``"budget:<size>"``), and their validation: a wrong type is a TypeError
(``cache="False"`` is not read by truth value), a value out of range a ValueError. When each is
checked, defaults, joining and misspellings: :mod:`gradpatch.sampling.contract`. Torch-free.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable



@dataclass(frozen=True)
class SamplingOptions:
    """The memory options of one ``cache=False`` call. ``grad_steps`` is None or a positive integral
    number: an ``int``, a NumPy integer or an integer tensor of one element (stored as ``int``); a
    ``bool``, a float or a string is a TypeError."""

    grad_steps: int | None = None
    checkpoint_steps: bool = False
    step_budget: int | None = None
    """Bytes of ``checkpoint_steps="budget:<size>"`` (``checkpoint_steps`` is then True)."""

    def __post_init__(self) -> None:
        if self.grad_steps is None:
            return
        steps = self.grad_steps
        try:  # int, numpy integers, 0-d integer tensors; not bool (True is no step count), floats, strings
            if isinstance(steps, bool) or str(getattr(steps, "dtype", "")) == "torch.bool":
                raise TypeError
            steps = operator.index(steps)
        except TypeError:
            raise TypeError(f"grad_steps must be a positive integer or None, not {steps!r} "
                            f"({type(steps).__name__})") from None
        if steps < 1:
            raise ValueError(f"grad_steps must be a positive integer or None, not {steps!r}")
        object.__setattr__(self, "grad_steps", steps)


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
    ``"budget:512MiB"``, ``"budget:2GB"``, ``"budget:1.5e9"``); None for True or False. A bad size is
    a ValueError; another string (``"yes"``, read by truth value) or type a TypeError."""
    if not isinstance(checkpoint_steps, str):
        check_flag("checkpoint_steps", checkpoint_steps)
        return None
    from gradpatch.settings import EXAMPLE, PREFIX, budget_bytes, is_budget

    text = checkpoint_steps.strip()
    if not is_budget(text):
        raise TypeError(f"checkpoint_steps must be True or False, or a string 'budget:<size>' ({EXAMPLE!r}), "
                        f"not {checkpoint_steps!r} (str)")
    try:
        return budget_bytes(PREFIX + text[len(PREFIX):].strip())
    except ValueError as error:
        raise ValueError(f"checkpoint_steps={checkpoint_steps!r}: {error}") from None
