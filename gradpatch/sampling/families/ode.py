"""Differentiable ODE samplers: a ``@torch.no_grad()`` ``sample`` that integrates with torchdiffeq's
``odeint`` through a module global (F5-TTS ``CFM.sample``, E2-TTS ``E2TTS.sample``, DiffRhythm's copy).

For a ``cache=False`` call (:mod:`gradpatch.sampling.contract`) the undecorated body runs under
:func:`~gradpatch.sampling.run.differentiable` and :func:`~gradpatch.sampling.run.text_cache_off`; with
``grad_steps`` or ``checkpoint_steps`` the module's solver global is shadowed for the call by
:func:`~gradpatch.sampling.steps.odeint.stepped_odeint`, which numbers the solver steps.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Callable, TypeVar

from gradpatch.sampling.contract import sampler_entry
from gradpatch.sampling.run import differentiable, text_cache_off
from gradpatch.sampling.shadows import shadow
from gradpatch.sampling.steps.odeint import stepped_odeint

T = TypeVar("T")


def differentiable_sampler(original: Callable[..., T], *, denoiser: str = "transformer",
                           solver: str = "odeint") -> Callable[..., T]:
    """Fix factory for a ``@torch.no_grad()`` sampler method ``sample(self, ...)`` that calls
    ``self.eval()``, evaluates ``self.<denoiser>`` and integrates with its module's global ``<solver>``
    (torchdiffeq's ``odeint``): F5-TTS ``CFM.sample``, E2-TTS ``E2TTS.sample``.

    The replacement follows :mod:`gradpatch.sampling.contract`: ``cache=True`` calls the original as it
    is; ``cache=False`` runs the undecorated body under :func:`differentiable` and
    :func:`text_cache_off`, with ``grad_steps`` or ``checkpoint_steps`` the solver global shadowed by
    :func:`stepped_odeint`. A new object per call.
    """
    raw = inspect.unwrap(original)
    module = sys.modules.get(getattr(raw, "__module__", ""), None)

    def run(this: Any, outer: Any, args: tuple, kwargs: dict) -> Any:
        self, options = args[0], this.options
        with contextlib.ExitStack() as stack:
            stack.enter_context(differentiable(self, this))
            stack.enter_context(text_cache_off(getattr(self, denoiser, None)))
            if (options.grad_steps is not None or options.checkpoint_steps) and callable(getattr(module, solver, None)):
                stack.enter_context(shadow(module, solver, stepped_odeint))
            return raw(*args, **kwargs)

    return sampler_entry(original, run, family="ode", describe=lambda args: f"{type(args[0]).__name__}.sample",
                         accepted=None, expected=f"no denoiser evaluation went through gradpatch's run_step (the "
                         f"body did not call {raw.__module__}.{solver})")
