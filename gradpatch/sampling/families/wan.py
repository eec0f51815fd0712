"""Wan2.2 (GitHub Wan-Video/Wan2.2, package ``wan``): ``generate`` with ``cache=False``, and Wan-Animate's
motion encoder checkpoint made non-reentrant.

**generate.** ``WanT2V.generate``, ``WanI2V.generate``, ``WanTI2V.t2v``/``i2v``, ``WanS2V.generate`` and
``WanAnimate.generate`` run their sampling loop inside one multi-item ``with (torch.amp.autocast(...),
torch.no_grad(), no_sync_low_noise(), ...):``. The fix (:func:`generate`) takes, keyword-only,
``cache: bool = True``, ``grad_steps``, ``checkpoint_steps`` (:mod:`gradpatch.sampling.contract`):
``cache=True`` is upstream's call; ``cache=False`` runs a copy of the method without its ``no_grad``
items (:func:`gradpatch.sampling.lifting.lift.lift_no_grad`: autocast and ``no_sync`` stay), gradients on,
``eval()`` a no-op, and returns what it returns (the decoded video tensor). A denoiser evaluation is one
``forward`` of the pipeline's noise model (``low_noise_model``/``high_noise_model``, ``model``,
``noise_model``; classifier-free guidance calls it twice per step); the step it belongs to is counted by
the timestep ``t`` it receives (a new value starts the next step; the schedulers' timesteps are strictly
decreasing) out of ``sampling_steps``. ``grad_steps=K``: the latent entering step N-K carries no graph;
a call running more than ``sampling_steps`` steps (S2V and Animate generate several clips) raises
RuntimeError for ``grad_steps`` (``checkpoint_steps`` alone works). Text encoding (T5, on CPU with
``t5_cpu``) and the VAE run with gradients too.

**Motion encoder.** ``Generator.get_motion`` calls ``torch.utils.checkpoint.checkpoint(self.enc.enc_motion,
img, use_reentrant=True)`` on face frames that never require grad: the reentrant checkpoint then records
nothing, and the motion encoder's parameters get no gradient when trained (torch only warns "None of the
inputs have requires_grad=True"). :func:`motion_non_reentrant` runs the method's own code with that call
non-reentrant (``use_reentrant=False``): the encoder is still recomputed in backward and its parameters
get their gradients. DiffSynth-Studio's copy (``diffsynth.models.wan_video_animate_adapter``) is the same.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
from contextvars import ContextVar
from typing import Any, Callable

from gradpatch.sampling.contract import accepted_keywords, sampler_entry
from gradpatch.sampling.run import SamplingRun, current, differentiable, run_step
from gradpatch.sampling.shadows import shadow

FAMILY = "wan"
DENOISERS = ("low_noise_model", "high_noise_model", "model", "noise_model")
"""The attributes of a Wan pipeline holding its denoisers."""

__all__ = ["DENOISERS", "generate", "motion_non_reentrant"]

_inside: ContextVar[tuple[object, ...]] = ContextVar("gradpatch_wan_pipes", default=())


class _Steps:
    """Step ``index`` of ``total``, advanced by each new timestep value a denoiser receives."""

    def __init__(self, name: str, total: int, grad_steps: int | None) -> None:
        self.name, self.total, self.grad_steps, self.index = name, total, grad_steps, -1
        self.last: Any = None

    def position(self, args: tuple, kwargs: dict) -> tuple[int, int]:
        t: Any = kwargs.get("t", args[1] if len(args) > 1 else None)
        value = float(t.flatten()[0].item()) if hasattr(t, "flatten") else t
        if value != self.last or self.index < 0:
            self.index, self.last = self.index + 1, value
        if self.grad_steps is None:
            return 0, 1  # checkpoint_steps only: the position does not matter
        if self.index >= self.total:
            raise RuntimeError(f"grad_steps: {self.name} ran more than sampling_steps={self.total} steps "
                               "(several clips); the last K steps cannot be told apart. Use checkpoint_steps")
        return self.index, self.total

    def forward(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if current.get() is None:  # another context: upstream's forward
                return inner(*args, **kwargs)
            return run_step(*self.position(args, kwargs), inner, *args, **kwargs)

        return forward


def generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """The fix factory for a Wan pipeline's ``generate`` (or ``t2v``/``i2v``): module docstring."""
    import torch

    from gradpatch.sampling.lifting.lift import lift_no_grad

    body = lift_no_grad(original)
    signature = inspect.signature(original)

    def run(this: SamplingRun, outer: SamplingRun | None, args: tuple, kwargs: dict) -> Any:
        pipe = args[0]
        if outer is not None and any(p is pipe for p in _inside.get()):  # generate calling t2v: set up already
            return body(*args, **kwargs)
        name = f"{type(pipe).__name__}.{original.__name__}"
        options = this.options
        denoisers = [m for m in (getattr(pipe, a, None) for a in DENOISERS) if isinstance(m, torch.nn.Module)]
        modules = [m for m in vars(pipe).values() if isinstance(m, torch.nn.Module)]
        with contextlib.ExitStack() as stack:
            stack.enter_context(differentiable(modules, this))
            if options.grad_steps is not None or options.checkpoint_steps:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                steps = _Steps(name, int(bound.arguments.get("sampling_steps", 0)), options.grad_steps)
                for denoiser in {id(m): m for m in denoisers}.values():
                    stack.enter_context(shadow(denoiser, "forward", steps.forward))
            stack.callback(_inside.reset, _inside.set(_inside.get() + (pipe,)))
            return body(*args, **kwargs)

    return sampler_entry(original, run, family=FAMILY,
                         describe=lambda args: f"{type(args[0]).__name__}.{original.__name__}",
                         accepted=accepted_keywords(original),
                         expected=f"no forward of the pipeline's denoisers ({', '.join(DENOISERS)}) went through "
                                  "gradpatch")


class _View:
    """A module seen with some attributes replaced (``torch`` whose ``utils.checkpoint.checkpoint`` is
    non-reentrant), everything else read through from the real one at each access."""

    def __init__(self, real: Any, replaced: dict[str, Any]) -> None:
        self.__dict__.update(_real=real, _replaced=replaced)

    def __getattr__(self, name: str) -> Any:
        replaced = self.__dict__["_replaced"]
        return replaced[name] if name in replaced else getattr(self.__dict__["_real"], name)


def _non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: Any = None,
                              **kwargs: Any) -> Any:
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def motion_non_reentrant(original: Callable[..., Any]) -> Callable[..., Any]:
    """The fix factory for ``Generator.get_motion``: its own code, with ``torch.utils.checkpoint.checkpoint``
    non-reentrant (the module's globals read at each call, only ``torch`` seen through a view)."""
    import torch

    view = _View(torch, {"utils": _View(torch.utils, {"checkpoint": _View(
        torch.utils.checkpoint, {"checkpoint": _non_reentrant_checkpoint})})})
    raw = inspect.unwrap(original)

    @functools.wraps(original)
    def get_motion(*args: Any, **kwargs: Any) -> Any:
        copy = types.FunctionType(raw.__code__, {**raw.__globals__, "torch": view}, raw.__name__,
                                  raw.__defaults__, raw.__closure__)
        copy.__kwdefaults__ = raw.__kwdefaults__
        return copy(*args, **kwargs)

    return get_motion
