"""Differentiable diffusers Modular Pipelines: ``ModularPipeline.__call__(cache=False)``.

A modular pipeline (``diffusers.modular_pipelines``) is not a ``DiffusionPipeline``: its ``__call__``
runs ``self._blocks(self, state)`` inside an in-body ``with torch.no_grad():``, and every block class
(``ModularPipelineBlocks`` subclasses: sequential, conditional, loop wrappers and the sub-blocks a loop
runs as ``block(components, block_state, i=i, t=t)``) decorates its own ``__call__`` with
``@torch.no_grad()``. Two fixes, both needed:

* :func:`modular_call` for ``ModularPipeline.__call__``: ``cache`` (default True: the original object,
  bitwise), ``grad_steps``, ``checkpoint_steps`` (:mod:`gradpatch.sampling.contract`). ``cache=False``
  runs a copy of ``__call__`` with its ``with torch.no_grad():`` lifted
  (:func:`gradpatch.sampling.lifting.lift.lift_no_grad`) inside
  :func:`gradpatch.sampling.families.diffusers_run.differentiable_run`: grad on, ``eval()`` a no-op on
  every ``torch.nn.Module`` component (those of the blocks and any set with ``update_components``),
  cache hooks passed through. Outputs stay what the blocks return: ``output_type="pil"``/``"np"``
  images leave torch (ask ``output="latents"`` or ``output_type="pt"``).
* :func:`patch_block_hierarchy` for ``ModularPipelineBlocks.__init_subclass__`` (which the base
  inherits): every block class defined so far and each one defined later whose *own* ``__call__`` is
  ``@torch.no_grad()`` gets a ``__call__`` that runs the undecorated body while a ``cache=False`` call
  of a modular pipeline records in this context, and the original otherwise (a block called on its own,
  or by a ``cache=True`` call, is upstream's). Each class's own ``loop_step`` is wrapped to note the loop
  iteration it runs. Revert restores every class it touched. Blocks without the decorator, and
  ``with torch.no_grad():`` written inside a block's body, are left alone (they cut the graph as written).

Steps. ``grad_steps``/``checkpoint_steps`` wrap the ``forward`` of each denoiser component (named
``unet``, ``transformer``, ``prior``, ``controlnet``, optionally ``_<n>``) for the call, as for
``DiffusionPipeline``. A denoiser evaluation belongs to the iteration of the innermost
``LoopSequentialPipelineBlocks.loop_step`` running it: the loops diffusers ships call
``self.loop_step(components, block_state, i=i, t=t)`` over ``enumerate(block_state.timesteps)``, so the
step is ``i`` of ``len(block_state.timesteps)`` (checked: ``t`` is ``timesteps[i]``). For
``grad_steps``, an evaluation outside a loop iteration, in a loop whose iterations are not denoising
steps (chunk loops passing ``k=``), or in a second loop of the same call raises RuntimeError instead of
counting the wrong steps; ``checkpoint_steps`` alone needs no position.
"""
from __future__ import annotations

import functools
import inspect
from contextvars import ContextVar
from typing import Any, Callable, NamedTuple

import torch

from gradpatch.errors import NotDifferentiableError
from gradpatch.sampling.contract import accepted_keywords, sampler_entry
from gradpatch.sampling.families.diffusers_run import differentiable_run, in_call
from gradpatch.sampling.families.hierarchy import Hierarchy, Replace
from gradpatch.sampling.lifting.bytecode import no_grad_body
from gradpatch.sampling.lifting.lift import LiftError, lift_no_grad
from gradpatch.sampling.options import SamplingOptions
from gradpatch.sampling.run import SamplingRun, recording

FAMILY = "diffusers-modular"

__all__ = ["modular_call", "patch_block_hierarchy", "running"]

#: Modular pipelines whose ``cache=False`` calls run in this context, outermost first.
_calls: ContextVar[tuple[object, ...]] = ContextVar("gradpatch_modular_calls", default=())


class _Iteration(NamedTuple):
    """One ``loop_step`` call in progress: the loop block, its block state and keyword arguments."""

    block: object
    state: object
    kwargs: dict

    def position(self) -> tuple[int, int] | str:
        """``(i, len(timesteps))``, or why the iteration is not a step of a denoising loop."""
        i, timesteps = self.kwargs.get("i"), getattr(self.state, "timesteps", None)
        if isinstance(i, bool) or not isinstance(i, int) or timesteps is None:
            return f"its loop_step got {sorted(self.kwargs)} and block_state.timesteps is " \
                   f"{'missing' if timesteps is None else 'there'} (expected i=, t= over block_state.timesteps)"
        try:
            total = len(timesteps)
            t = self.kwargs.get("t", timesteps[i] if 0 <= i < total else None)
            if not 0 <= i < total or not bool(torch.as_tensor(timesteps[i] == t).all()):
                return f"its iteration i={i} is not timesteps[{i}] of {total}"
        except (TypeError, RuntimeError, IndexError) as error:
            return f"its timesteps cannot be read ({error})"
        return i, total


_iterations: ContextVar[tuple[_Iteration, ...]] = ContextVar("gradpatch_modular_iterations", default=())


def running() -> bool:
    """Whether a modular pipeline's ``cache=False`` call records a graph in this context (also while
    ``grad_steps`` has grad off in its early steps)."""
    return bool(_calls.get()) and recording()


class _Loops:
    """Locates denoiser calls by loop iteration (module docstring); the interface of
    :func:`~gradpatch.sampling.families.diffusers_run.differentiable_run`'s ``locate``."""

    scheduler = None  # scheduler.step is not what counts here

    def __init__(self, pipe: Any, options: SamplingOptions) -> None:
        self.name, self.options = type(pipe).__name__, options
        self.loop: _Iteration | None = None  # the first iteration located: its loop is the one counted
        self.last = 0

    def position(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[int, int]:
        if self.options.grad_steps is None:
            return 0, 1  # checkpoint_steps only: the position does not matter
        stack = _iterations.get()
        if not stack:
            raise RuntimeError(f"grad_steps: {self.name} evaluated a denoiser outside the iterations of a loop "
                               "block (LoopSequentialPipelineBlocks.loop_step): its step cannot be told")
        here = stack[-1]
        where = here.position()
        if isinstance(where, str):
            raise RuntimeError(f"grad_steps: {self.name} evaluated a denoiser in an iteration of "
                               f"{type(here.block).__name__}, which is not a denoising loop: {where}")
        if self.loop is None:
            self.loop = here
        elif here.block is not self.loop.block or here.state is not self.loop.state or where[0] < self.last:
            raise RuntimeError(f"grad_steps: {self.name} ran a second denoising loop "
                               f"({type(here.block).__name__} after {type(self.loop.block).__name__}); "
                               "grad_steps counts the iterations of one loop. Use checkpoint_steps, or call "
                               "the loops as separate pipelines")
        self.last = where[0]
        return where

    def finish(self) -> None:
        self.loop = None


def _block_call(original: Callable[..., Any], body: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return (body if running() else original)(self, *args, **kwargs)

    return __call__


def _loop_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def loop_step(self: Any, components: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        if not _calls.get():
            return original(self, components, state, *args, **kwargs)
        token = _iterations.set(_iterations.get() + (_Iteration(self, state, kwargs),))
        try:
            return original(self, components, state, *args, **kwargs)
        finally:
            _iterations.reset(token)

    return loop_step


def _patch_block_class(cls: type, replace: Replace) -> None:
    call = vars(cls).get("__call__")
    body = None if hasattr(call, "__gradpatch_original__") else no_grad_body(call)
    if call is not None and body is not None:
        replace(cls, "__call__", call, _block_call(call, body))
    step = vars(cls).get("loop_step")
    if inspect.isfunction(step) and not hasattr(step, "__gradpatch_original__"):
        replace(cls, "loop_step", step, _loop_step(step))


_installed: list[Hierarchy] = []  # installations of the block hierarchy patch (active until reverted)


def patch_block_hierarchy(inherited: Any) -> classmethod:
    """The fix factory for ``ModularPipelineBlocks.__init_subclass__``, which the base class inherits
    (the engine passes the inherited method, bound to the base): patches every block class defined so
    far and returns the ``__init_subclass__`` that patches each one defined later; the engine calls its
    ``__gradpatch_revert__`` when it removes it again."""
    state = Hierarchy(inherited.__self__, _patch_block_class)
    try:
        _patch_block_class(state.base, state.replace)  # the base's own __call__ too
        state.install()
    except BaseException:
        state.revert()  # the engine records the failure; leave nothing half-patched
        raise
    _installed[:] = [h for h in _installed if h.active] + [state]
    state.hook.__gradpatch_revert__ = state.revert  # type: ignore[attr-defined]
    return state.hook


def modular_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """The fix factory for ``ModularPipeline.__call__`` (module docstring). A ``__call__`` whose in-body
    ``no_grad`` cannot be lifted (source missing or edited since import) gets a ``cache=False`` that
    raises :class:`~gradpatch.errors.NotDifferentiableError` instead of being ignored by its
    ``**kwargs``; so does a call while the block hierarchy is not patched (excluded, or unknown code)."""
    try:
        body = lift_no_grad(original)
    except LiftError as error:
        return sampler_entry(original, None, family=FAMILY, describe=lambda args: f"{type(args[0]).__name__}",
                             refusal=f"its in-body torch.no_grad() cannot be lifted: {error}")

    def run(this: SamplingRun, outer: SamplingRun | None, args: tuple, kwargs: dict) -> Any:
        pipe = args[0]
        if not any(h.active for h in _installed):
            raise NotDifferentiableError(f"{type(pipe).__name__}(cache=False): the blocks' @torch.no_grad() "
                                         "__call__ are not patched (patch 'diffusers.modular_pipelines.blocks' "
                                         "not applied: see gradpatch.report()), so nothing would get a gradient")
        if outer is not None and in_call(pipe):  # super().__call__ from a subclass's body: already set up
            return body(*args, **kwargs)
        token = _calls.set(_calls.get() + (pipe,))
        try:
            with differentiable_run(pipe, this, locate=_Loops):
                return body(*args, **kwargs)
        finally:
            _calls.reset(token)

    return sampler_entry(original, run, family=FAMILY, describe=lambda args: f"{type(args[0]).__name__}.__call__",
                         accepted=accepted_keywords(body),
                         expected="no denoiser evaluation (a component named unet, transformer, prior or "
                                  "controlnet) went through gradpatch's run_step")
