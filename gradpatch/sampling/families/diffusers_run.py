"""One ``cache=False`` run of a diffusers pipeline: grad mode, cache hooks, denoiser steps.

:func:`differentiable_run` is what :mod:`gradpatch.sampling.families.diffusers` enters around a pipeline's
undecorated ``__call__`` body: grad on and ``eval()`` a no-op on every component
(:func:`gradpatch.sampling.run.differentiable`), cache hooks passed through, and, for
``grad_steps``/``checkpoint_steps``, each denoiser ``forward`` routed through
:func:`gradpatch.sampling.run.run_step` at the step it belongs to.

Step index. A loop runs over ``scheduler.timesteps`` or a suffix of it (img2img strength), calls
``scheduler.step`` once per iteration and the denoisers one or more times (split CFG, controlnet;
Heun and PNDM repeat timestep values). Counting denoiser calls overcounts split CFG and matching
timestep values fails on repeats and rescaling (``t / 1000``), so a call's step is ``start`` + the
number of ``pipe.scheduler.step`` calls so far, of ``len(scheduler.timesteps)``. ``start`` is
``scheduler.begin_index`` if set; else 0 for schedulers that have ``set_begin_index`` (pipelines starting
mid-schedule set it); else (DDIM, DDPM, PNDM) the first call's ``timestep`` position. Each
``scheduler.step`` is checked against the timestep assumed: a mismatch, or a loop that never steps
``pipe.scheduler``, raises RuntimeError instead of truncating at the wrong step.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

from gradpatch.errors import NotDifferentiableError
from gradpatch.sampling.options import SamplingOptions
from gradpatch.sampling.run import SamplingRun, differentiable, run_step

_DENOISER = re.compile(r"(unet|transformer|prior|controlnet)(_\d+)?")
_CACHE_HOOK_MODULES = frozenset(f"diffusers.hooks.{name}" for name in (
    "faster_cache", "first_block_cache", "pyramid_attention_broadcast", "taylorseer_cache", "mag_cache",
    "text_kv_cache", "sea_cache"))
_MISSING = object()
#: The pipelines whose ``cache=False`` calls are running in this context, outermost first.
inside: ContextVar[tuple[object, ...]] = ContextVar("gradpatch_diffusers_pipes", default=())


def in_call(pipe: object) -> bool:
    """Whether ``pipe`` is running a ``cache=False`` call in this context."""
    return any(p is pipe for p in inside.get())


def _cache_hook_refs(modules: list[torch.nn.Module]) -> list[Any]:
    """The ``HookFunctionReference`` of every cache hook registered under ``modules``."""
    from diffusers.hooks.hooks import ModelHook

    refs: list[Any] = []
    registries = {id(r): r for m in modules for s in m.modules() if (r := getattr(s, "_diffusers_hook", None))}
    for registry in registries.values():
        fn_refs = getattr(registry, "_fn_refs", [None] * len(registry._hook_order))
        for name, ref in zip(registry._hook_order, fn_refs):
            hook = registry.hooks[name]
            if type(hook).__module__ not in _CACHE_HOOK_MODULES:
                continue  # offloading, layerwise casting, context parallel: not caches, kept
            if ref is None or type(hook).deinitalize_hook is not ModelHook.deinitalize_hook:
                raise NotDifferentiableError(f"cache hook {type(hook).__name__} changed the model beyond its "
                                             "forward chain and cannot be bypassed; call disable_cache() first")
            refs.append(ref)
    return refs


@contextlib.contextmanager
def _bypassed(refs: list[Any]) -> Iterator[None]:
    """Cache hooks pass-through; re-entrant, so a checkpoint recompute in backward can enter it again."""
    saved = [(ref, ref.pre_forward, ref.forward, ref.post_forward) for ref in refs]
    for ref in refs:
        ref.pre_forward, ref.post_forward = (lambda m, *a, **k: (a, k)), (lambda m, output: output)
        if ref.original_forward is not None:  # the hook replaced forward (new_forward): skip it
            ref.forward = ref.original_forward
    try:
        yield
    finally:
        for ref, pre, forward, post in reversed(saved):
            ref.pre_forward, ref.forward, ref.post_forward = pre, forward, post


@contextlib.contextmanager
def _wrapped(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """``owner.name = make(owner.name)`` for the block, unless an enclosing pipeline call did it already
    (a sub-pipeline sharing the component); restored only if still ours (accelerate's offload hooks
    may re-wrap ``forward`` at the end of a call: theirs is kept)."""
    previous, inner = vars(owner).get(name, _MISSING), getattr(owner, name)
    if getattr(inner, "_gradpatch_step", False):
        yield
        return
    ours = make(inner)
    ours._gradpatch_step = True  # type: ignore[attr-defined]
    setattr(owner, name, ours)
    try:
        yield
    finally:
        if vars(owner).get(name) is ours:
            delattr(owner, name) if previous is _MISSING else setattr(owner, name, previous)


def _timestep(fn: Callable[..., Any], args: tuple, kwargs: dict) -> float | None:
    """The (first) value of the ``timestep`` argument of ``fn(*args, **kwargs)``, if any."""
    try:
        t = inspect.signature(fn).bind_partial(*args, **kwargs).arguments.get("timestep")
        return None if t is None else float(torch.as_tensor(t).flatten()[0].item())
    except (TypeError, ValueError, IndexError, RuntimeError):
        return None


class _Steps:
    """Locates denoiser calls in the loop: ``start`` + ``scheduler.step`` calls (module docstring)."""

    def __init__(self, pipe: Any, options: SamplingOptions) -> None:
        self.name, self.options, self.scheduler = type(pipe).__name__, options, getattr(pipe, "scheduler", None)
        self.start: int | None = None
        self.done, self.calls, self.timesteps = 0, 0, torch.empty(0)

    def position(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[int, int]:
        self.calls += 1
        if self.options.grad_steps is None:
            return 0, 1  # checkpoint_steps only: the position does not matter
        if self.start is None:
            if getattr(self.scheduler, "timesteps", None) is None:
                raise RuntimeError(f"grad_steps: {self.name} has no pipe.scheduler with timesteps set")
            assert self.scheduler is not None  # (checked just above)
            self.timesteps = torch.as_tensor(self.scheduler.timesteps).detach().cpu()
            self.start = getattr(self.scheduler, "begin_index", None)
            if not isinstance(self.start, int):
                t = None if hasattr(self.scheduler, "set_begin_index") else _timestep(forward, args, kwargs)
                hits: torch.Tensor | list[int] = (self.timesteps == t).nonzero() if t is not None else []
                self.start = int(hits[0]) if len(hits) else 0
        if self.start + self.done >= len(self.timesteps):
            raise RuntimeError(f"grad_steps: a denoiser call after the last of {len(self.timesteps)} steps; "
                               f"{self.name} does not step pipe.scheduler once per iteration")
        return self.start + self.done, len(self.timesteps)

    def stepping(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(inner)  # keeps inspect.signature: pipelines look for ``eta``/``generator`` in it
        def step(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            t = _timestep(inner, args, kwargs) if self.start is not None else None
            at = self.start + self.done if self.start is not None else 0
            if t is not None and not (at < len(self.timesteps) and self.timesteps[at] == t):
                raise RuntimeError(f"grad_steps: could not locate the denoising steps of {self.name}: "
                                   f"scheduler.step got timestep {t}, expected {self.timesteps[at:at + 1].tolist()}")
            self.done += 1
            return out

        return step

    def finish(self) -> None:
        """Called when the body returned: a loop that never stepped ``pipe.scheduler`` is an error."""
        if self.options.grad_steps is not None and self.calls > 1 and self.done == 0:
            raise RuntimeError(f"grad_steps: {self.name} never called pipe.scheduler.step, so its denoising "
                               "steps could not be located")


@contextlib.contextmanager
def differentiable_run(pipe: Any, run: SamplingRun, locate: Callable[[Any, SamplingOptions], Any] = _Steps
                       ) -> Iterator[None]:
    """The context of one ``cache=False`` call of ``pipe`` under ``run`` (module docstring); restores
    everything. ``locate(pipe, options)`` gives the object that locates each denoiser call's step, like
    :class:`_Steps`: ``position``, ``scheduler`` (whose ``step`` it wraps with ``stepping``; None:
    not wrapped), ``name`` and ``finish`` (modular pipelines count loop iterations instead)."""
    options = run.options
    named = {name: m for name, m in vars(pipe).items() if isinstance(m, torch.nn.Module)}
    modules = list({id(m): m for m in named.values()}.values())
    refs = _cache_hook_refs(modules)

    def stepped(steps: _Steps) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(inner: Callable[..., Any]) -> Callable[..., Any]:
            def evaluate(*args: Any, **kwargs: Any) -> Any:
                with _bypassed(refs):  # also when checkpoint recomputes it in backward, after the call
                    return inner(*args, **kwargs)

            @functools.wraps(inner)
            def forward(*args: Any, **kwargs: Any) -> Any:
                return run_step(*steps.position(inner, args, kwargs), evaluate, *args, **kwargs)

            return forward

        return make

    steps = locate(pipe, options) if options.grad_steps is not None or options.checkpoint_steps else None
    if steps is not None and not any(map(_DENOISER.fullmatch, named)):  # the options would do nothing
        raise NotDifferentiableError(f"grad_steps/checkpoint_steps: {steps.name} has no denoiser component "
                                     f"named like {_DENOISER.pattern} (it has {sorted(named)})")
    with contextlib.ExitStack() as stack:
        stack.enter_context(differentiable(modules, run))  # grad on, eval() a no-op per module
        stack.enter_context(_bypassed(refs))
        if steps is not None:
            if callable(getattr(steps.scheduler, "step", None)):
                stack.enter_context(_wrapped(steps.scheduler, "step", steps.stepping))
            for name in filter(_DENOISER.fullmatch, named):
                stack.enter_context(_wrapped(named[name], "forward", stepped(steps)))
        stack.callback(inside.reset, inside.set(inside.get() + (pipe,)))
        yield
    if steps is not None:
        steps.finish()  # (not reached when the body raised)
