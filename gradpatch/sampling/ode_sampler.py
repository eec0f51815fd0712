"""Differentiable ODE samplers: a ``@torch.no_grad()`` ``sample`` that integrates with torchdiffeq's
``odeint`` through a module global (F5-TTS ``CFM.sample``, E2-TTS ``E2TTS.sample``, DiffRhythm's copy).

ODE samplers (F5-TTS, E2-TTS) call ``torchdiffeq.odeint(fn, y0, t, ...)`` through a module global. For
a ``cache=False`` call with either option, :func:`differentiable_sampler` shadows that global with
:func:`stepped_odeint` for the duration of the call (shared and reference counted like the other
shadows, and acting only in the caller's context). It hands torchdiffeq a right-hand side that learns
the solver step from torchdiffeq's ``callback_step`` (called once before each step, so midpoint and RK4
evaluations, which fall inside or at the end of the interval, are attributed without guessing from
``t``) and runs every evaluation through :func:`run_step`. Nothing is shadowed for plain calls.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from typing import Any, Callable, TypeVar

import torch

from gradpatch.sampling.options import (SamplingOptions, check_keywords, note_cached_call, sampling_options,
                                        swallowed_keywords)
from gradpatch.sampling.runner import _current, _shadow, _with_keywords, differentiable, run_step, text_cache_off

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
        run = _current.get()
        if run is None or (run.options.grad_steps is None and not run.options.checkpoint_steps):
            return original(func, y0, t, *args, **kwargs)
        if getattr(original, "__name__", "") == "odeint_adjoint":
            raise RuntimeError("grad_steps/checkpoint_steps cannot act on torchdiffeq's odeint_adjoint: its forward "
                               "runs without grad and its backward solves the adjoint ODE, so no step's graph is "
                               "kept or cut (its memory is already constant in the number of steps). Call it "
                               "without these options, or integrate with torchdiffeq.odeint")
        return original(_Stepped(func, _total_steps(t, kwargs, run.options)), y0, t, *args, **kwargs)

    return odeint


def differentiable_sampler(original: Callable[..., T], *, denoiser: str = "transformer",
                           solver: str = "odeint") -> Callable[..., T]:
    """Fix factory for a ``@torch.no_grad()`` sampler method ``sample(self, ...)`` that calls
    ``self.eval()``, evaluates ``self.<denoiser>`` and integrates with its module's global ``<solver>``
    (torchdiffeq's ``odeint``): F5-TTS ``CFM.sample``, E2-TTS ``E2TTS.sample``.

    The replacement takes ``cache=True`` (the original, called as it is) or ``cache=False`` (the
    undecorated body under :func:`differentiable` and :func:`text_cache_off`; with ``grad_steps`` or
    ``checkpoint_steps`` the solver global shadowed by :func:`stepped_odeint`). If those options were
    asked for and no evaluation went through :func:`run_step` (a body that no longer calls the solver
    global), it raises rather than return a graph that silently ignored them. A new object per call.
    """
    raw = inspect.unwrap(original)
    module = sys.modules.get(getattr(raw, "__module__", ""), None)
    accepted = swallowed_keywords(original)

    @functools.wraps(original)
    def sample(self: Any, *args: Any, cache: bool = True, grad_steps: int | None = None,
               checkpoint_steps: bool = False, **kwargs: Any) -> T:
        options = sampling_options(cache, grad_steps, checkpoint_steps)
        check_keywords(kwargs, accepted, f"{type(self).__name__}.sample")
        if cache:
            note_cached_call(f"{type(self).__name__}.sample", self)
            return original(self, *args, **kwargs)
        with contextlib.ExitStack() as stack:
            run = stack.enter_context(differentiable(self, options))
            stack.enter_context(text_cache_off(getattr(self, denoiser, None)))
            if (options.grad_steps is not None or checkpoint_steps) and callable(getattr(module, solver, None)):
                stack.enter_context(_shadow(module, solver, stepped_odeint))
            out = raw(self, *args, **kwargs)
        if (grad_steps is not None or checkpoint_steps) and run.evaluations == 0:
            raise RuntimeError(f"{type(self).__name__}.sample: grad_steps/checkpoint_steps had no effect: no "
                               f"denoiser evaluation went through gradpatch's run_step (the body did not "
                               f"call {raw.__module__}.{solver})")
        return out

    sample.__signature__ = _with_keywords(inspect.signature(original))  # type: ignore[attr-defined]
    return sample
