"""Solver steps for torchdiffeq's ``odeint``: a right-hand side that knows which solver step it is in,
so that ``grad_steps`` and ``checkpoint_steps`` can act per step of an ODE sampler (F5-TTS, E2-TTS,
and ``gradpatch.differentiable(..., step="odeint")``).

:func:`stepped_odeint` wraps a module's ``odeint`` global for the duration of a ``cache=False`` call
(shared and reference counted like the other shadows, acting only in the caller's context). It hands
torchdiffeq a right-hand side that learns the solver step from torchdiffeq's ``callback_step`` (called
once before each step, so midpoint and RK4 evaluations, which fall inside or at the end of the
interval, are attributed without guessing from ``t``) and runs every evaluation through
:func:`~gradpatch.sampling.run.run_step`. Nothing is shadowed for plain calls.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

from gradpatch.sampling.options import SamplingOptions
from gradpatch.sampling.run import current, run_step

T = TypeVar("T")

FIXED_GRID_METHODS = frozenset({"euler", "midpoint", "rk4", "heun2", "heun3",
                                "explicit_adams", "implicit_adams", "fixed_adams"})
"""torchdiffeq methods that take exactly one step per interval of the ``t`` they are given."""


class _Stepped:
    """An ODE right-hand side that knows its solver step from torchdiffeq's ``callback_step``."""

    def __init__(self, func: Callable[..., Any], total: int) -> None:
        self.func, self.total, self.step = func, total, -1

    def __call__(self, t: torch.Tensor, y: Any) -> Any:
        # Adaptive solvers evaluate once before their first step (initial step size): count it as step 0.
        return run_step(max(self.step, 0), self.total, self.func, t, y)

    def callback_step(self, t0: torch.Tensor, y0: Any, dt: torch.Tensor) -> None:
        self.step += 1
        getattr(self.func, "callback_step", lambda *args: None)(t0, y0, dt)  # the user's own, if any

    def __getattr__(self, name: str) -> Any:  # the user's other callbacks, if any
        return getattr(self.__dict__["func"], name)


def _total_steps(t: torch.Tensor, kwargs: dict[str, Any], options: SamplingOptions) -> int:
    if options.grad_steps is None:
        return 0
    method, solver = kwargs.get("method"), kwargs.get("options") or {}
    if (method not in FIXED_GRID_METHODS or "step_size" in solver or "grid_constructor" in solver
            or kwargs.get("event_fn") is not None):
        raise ValueError(f"grad_steps needs a fixed-grid solver stepping on the time points given "
                         f"({', '.join(sorted(FIXED_GRID_METHODS))}); this sampler calls odeint with "
                         f"method={method!r}, options={solver!r}. Use checkpoint_steps instead.")
    return len(t) - 1


def stepped_odeint(original: Callable[..., T]) -> Callable[..., T]:
    """``odeint`` (torchdiffeq's signature) that numbers solver steps for :func:`run_step` while a
    ``cache=False`` call with ``grad_steps`` or ``checkpoint_steps`` is active in this context, and
    calls ``original`` straight through otherwise."""

    @functools.wraps(original)
    def odeint(func: Callable[..., Any], y0: Any, t: torch.Tensor, *args: Any, **kwargs: Any) -> T:
        run = current.get()
        if run is None or (run.options.grad_steps is None and not run.options.checkpoint_steps):
            return original(func, y0, t, *args, **kwargs)
        if getattr(original, "__name__", "") == "odeint_adjoint":
            raise RuntimeError("grad_steps/checkpoint_steps cannot act on torchdiffeq's odeint_adjoint: its forward "
                               "runs without grad and its backward solves the adjoint ODE, so no step's graph is "
                               "kept or cut (its memory is already constant in the number of steps). Call it "
                               "without these options, or integrate with torchdiffeq.odeint")
        return original(_Stepped(func, _total_steps(t, kwargs, run.options)), y0, t, *args, **kwargs)

    return odeint
