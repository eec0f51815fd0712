"""Differentiable diffusers pipelines: ``cache=False`` on every ``@torch.no_grad()`` ``__call__``.

Installing walks ``DiffusionPipeline``'s subclasses and gives it an ``__init_subclass__``, so classes
defined later (lazily imported, community, your own) are patched when created. A class whose *own*
``__call__`` is ``@torch.no_grad()`` (recognised by the code object of torch's decorator and the
``no_grad`` in its closure, not by name) gets a ``__call__`` that also takes, keyword-only,
``cache: bool = True``, ``grad_steps``, ``checkpoint_steps`` (see :mod:`gradpatch.sampling.runner`):

* ``cache=True`` calls the original object: same code path, bitwise-equal outputs.
* ``cache=False`` runs the undecorated body with gradients on. ``output_type`` must be ``"pt"`` or
  ``"latent"``: ``"pil"``/``"np"`` (the usual default) leave torch, so ValueError. Hooks installed by
  ``model.enable_cache(config)`` (FasterCache, FirstBlockCache, PyramidAttentionBroadcast, TaylorSeer,
  MagCache, TextKVCache, SeaCache) reuse tensors of earlier steps whatever the grad mode; for the call
  they pass through (same hook objects, order and state afterwards). ``eval()`` is a no-op on every
  component: modes stay as the caller set them. ``@torch.no_grad()`` helpers named ``encode*``,
  ``decode*``, ``vae_decode*`` (or ``_``-prefixed) run undecorated inside such a call only; others
  (``enhance_prompt``: discrete text) and ``with torch.no_grad():`` blocks in a body still cut the graph.
  A sub-pipeline or ``super().__call__`` reached from the body without ``cache=`` continues the graph.
* ``grad_steps``/``checkpoint_steps``: for the call, the ``forward`` of each denoiser component (named
  ``unet``, ``transformer``, ``prior``, ``controlnet``, optionally ``_<n>``) is wrapped so each
  evaluation goes through :func:`~gradpatch.sampling.runner.run_step` (no such component: an error,
  not a silent no-op); ``scheduler.step`` is never inside a checkpoint. Wrappers live on the
  instances for the call: one pipeline instance must not run two such calls concurrently. How a
  call's step is located: :mod:`gradpatch.sampling.diffusers_run`.

Left alone unless ``cache=False`` is asked for (then :class:`NotDifferentiableError`): ONNX pipelines,
classes whose own ``__call__`` is not ``no_grad``-decorated, and cache hooks that rewired the model
beyond its forward chain (SeaCache on Cosmos 3: ``disable_cache()`` first). ``ModularPipeline`` is not
a ``DiffusionPipeline`` (its blocks use ``with torch.no_grad()`` in-body): a second patch only makes its
``__call__(cache=False)`` an error (:func:`guard_modular_call`).
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable

import torch

from gradpatch.errors import NotDifferentiableError, RevertWarning, complain
from gradpatch.sampling.diffusers_run import differentiable_run, in_call, inside
from gradpatch.sampling._bytecode import grad_mode_wrapper
from gradpatch.sampling.options import (check_flag, check_keywords, note_cached_call, sampling_options,
                                        step_budget, swallowed_keywords)
from gradpatch.sampling.runner import active_options, recording

__all__ = ["NotDifferentiableError", "guard_modular_call", "no_grad_body", "patch_pipeline_hierarchy"]

_NEW = ("cache", "grad_steps", "checkpoint_steps")
_HELPER = re.compile(r"_?(encode|decode|vae_decode)")
def no_grad_body(fn: object) -> Callable[..., Any] | None:
    """The function under ``@torch.no_grad()`` if ``fn`` is exactly that decorator's wrapper, else None."""
    if not grad_mode_wrapper(fn) or not hasattr(fn, "__wrapped__"):
        return None
    cells = {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__)}  # type: ignore[attr-defined]
    no_grad = isinstance(getattr(cells.get("ctx_factory"), "__self__", None), torch.no_grad)  # a bound clone
    body = cells.get("func")
    # torch wraps a generator function in generator_context, anything else in decorate_context: only
    # the latter is a pipeline's no_grad __call__.
    return body if no_grad and body is fn.__wrapped__ and not inspect.isgeneratorfunction(body) else None  # type: ignore[attr-defined]


def _signature(original: Callable[..., Any]) -> inspect.Signature | None:
    """The original parameters plus the three keyword-only ones (before ``**kwargs``), for help()/IDEs."""
    P = inspect.Parameter
    new = [P(name, P.KEYWORD_ONLY, default=default, annotation=annotation) for name, default, annotation
           in (("cache", True, bool), ("grad_steps", None, "int | None"), ("checkpoint_steps", False, "bool | str"))]
    try:
        sig = inspect.signature(original)
        params = [p for p in sig.parameters.values() if p.name not in _NEW]
        tail = [p for p in params if p.kind is P.VAR_KEYWORD]
        return sig.replace(parameters=[p for p in params if p not in tail] + new + tail)
    except (TypeError, ValueError):
        return None


def _check_output_type(body: Callable[..., Any], pipe: object, args: tuple, kwargs: dict) -> None:
    try:
        bound = inspect.signature(body).bind(pipe, *args, **kwargs)
    except TypeError:
        return  # bad arguments: the call itself reports them
    bound.apply_defaults()
    output_type = bound.arguments.get("output_type", "pt")
    if output_type not in ("pt", "latent"):
        raise ValueError(f"{type(pipe).__name__}(cache=False) keeps the graph only for tensor outputs; "
                         f"output_type={output_type!r} converts to PIL/numpy and cuts it. "
                         "Pass output_type='pt' (decoded) or 'latent'.")


def _differentiable_call(original: Callable[..., Any], body: Callable[..., Any]) -> Callable[..., Any]:
    accepted = swallowed_keywords(body)

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        explicit = "cache" in kwargs
        cache = kwargs.pop("cache", True)
        grad_steps, checkpoint_steps = kwargs.pop("grad_steps", None), kwargs.pop("checkpoint_steps", False)
        check_keywords(kwargs, accepted, f"{type(self).__name__}.__call__")
        outer = active_options()
        if not explicit and grad_steps is None and not checkpoint_steps and outer is not None and inside.get():
            if in_call(self):  # super().__call__ from a subclass's body: already set up
                return body(self, *args, **kwargs)
            cache, options = False, outer  # a sub-pipeline of a cache=False call continues its graph
        else:
            options = sampling_options(cache, grad_steps, checkpoint_steps)
        if cache:
            note_cached_call(f"{type(self).__name__}.__call__", self)
            return original(self, *args, **kwargs)
        _check_output_type(body, self, args, kwargs)
        with differentiable_run(self, options):
            return body(self, *args, **kwargs)

    __call__.__signature__ = _signature(original)  # type: ignore[attr-defined]
    return __call__


def _guarded_call(original: Callable[..., Any], reason: str) -> Callable[..., Any]:
    accepted = swallowed_keywords(original)

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Without this, ``**kwargs`` in many signatures would swallow cache=False silently.
        if "cache" in kwargs:
            check_flag("cache", kwargs["cache"])
        if "checkpoint_steps" in kwargs:
            step_budget(kwargs["checkpoint_steps"])
        if kwargs.get("cache", True) is False or kwargs.get("grad_steps") is not None \
                or kwargs.get("checkpoint_steps") or ("cache" not in kwargs and inside.get()):
            raise NotDifferentiableError(f"{type(self).__name__} cannot run with cache=False: {reason}")
        for name in _NEW:
            kwargs.pop(name, None)
        check_keywords(kwargs, accepted, f"{type(self).__name__}.__call__")
        return original(self, *args, **kwargs)

    return __call__


def _helper(original: Callable[..., Any], body: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def helper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return (body if in_call(self) and recording() else original)(self, *args, **kwargs)

    return helper


class _Hierarchy:
    """What one installation touched, so that revert restores exactly those objects."""

    def __init__(self, base: type) -> None:
        self.base, self.active = base, True
        self.touched: list[tuple[type, str, object, object]] = []

        def __init_subclass__(cls: type, **kwargs: Any) -> None:
            super(base, cls).__init_subclass__(**kwargs)
            if self.active:
                self.patch_class(cls)

        self.hook = classmethod(__init_subclass__)

    def _set(self, cls: type, name: str, original: Any, replacement: Any) -> None:
        replacement.__gradpatch_original__ = original
        setattr(cls, name, replacement)
        self.touched.append((cls, name, original, replacement))

    def patch_class(self, cls: type) -> None:
        original = vars(cls).get("__call__")
        sig = _signature(original) if inspect.isfunction(original) else None
        if sig is not None and "cache" not in inspect.signature(original).parameters \
                and not hasattr(original, "__gradpatch_original__"):  # a __call__ with its own ``cache``: theirs
            body = None if getattr(cls, "_is_onnx", False) else no_grad_body(original)
            reason = "ONNX pipelines run numpy" if getattr(cls, "_is_onnx", False) else \
                "its __call__ is not decorated with @torch.no_grad(): no undecorated body to run"
            self._set(cls, "__call__", original,
                      _guarded_call(original, reason) if body is None else _differentiable_call(original, body))
        for name, value in list(vars(cls).items()):
            body = no_grad_body(value) if _HELPER.match(name) else None
            if body is not None:
                self._set(cls, name, value, _helper(value, body))

    def install(self) -> None:
        pending, seen = [self.base], set()
        while pending:
            for cls in pending.pop().__subclasses__():
                if cls not in seen:
                    seen.add(cls)
                    self.patch_class(cls)
                    pending.append(cls)

    def revert(self) -> None:
        """Called by the engine after it removed ``__init_subclass__`` from the base class."""
        self.active = False
        for cls, name, original, replacement in reversed(self.touched):
            if vars(cls).get(name) is replacement:
                setattr(cls, name, original)
            else:
                complain(RevertWarning, f"gradpatch: not reverting {cls.__qualname__}.{name}: replaced since")
        self.touched.clear()


def patch_pipeline_hierarchy(inherited: Any) -> classmethod:
    """The fix factory for ``DiffusionPipeline.__init_subclass__``, which the base class inherits (the
    engine passes the inherited method, bound to the base). Patches every pipeline class defined so
    far and returns the ``__init_subclass__`` that patches each one defined later; the engine calls its
    ``__gradpatch_revert__`` when it removes it again."""
    state = _Hierarchy(inherited.__self__)
    try:
        state.install()
    except BaseException:
        state.revert()  # the engine records the failure; leave nothing half-patched
        raise
    state.hook.__gradpatch_revert__ = state.revert  # type: ignore[attr-defined]
    return state.hook


def guard_modular_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """The fix factory for ``ModularPipeline.__call__``: an error for cache=False, otherwise unchanged."""
    return _guarded_call(original, "modular pipelines run their blocks under an in-body torch.no_grad()")
