"""Differentiable diffusers pipelines: ``cache=False`` on every ``@torch.no_grad()`` ``__call__``.

Installing walks ``DiffusionPipeline``'s subclasses and gives it an ``__init_subclass__``, so classes
defined later (lazily imported, community, your own) are patched when created. A class whose *own*
``__call__`` is ``@torch.no_grad()`` (recognised by the code object of torch's decorator and the
``no_grad`` in its closure, not by name) gets a ``__call__`` that also takes, keyword-only,
``cache: bool = True``, ``grad_steps``, ``checkpoint_steps`` (see :mod:`gradpatch.sampling.run`):

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
  evaluation goes through :func:`~gradpatch.sampling.run.run_step` (no such component: an error,
  not a silent no-op); ``scheduler.step`` is never inside a checkpoint. Wrappers live on the
  instances for the call: one pipeline instance must not run two such calls concurrently. How a
  call's step is located: :mod:`gradpatch.sampling.families.diffusers_run`.

Left alone unless ``cache=False`` is asked for (then :class:`NotDifferentiableError`): ONNX pipelines,
classes whose own ``__call__`` is not ``no_grad``-decorated, and cache hooks that rewired the model
beyond its forward chain (SeaCache on Cosmos 3: ``disable_cache()`` first). ``ModularPipeline`` is not
a ``DiffusionPipeline``: :mod:`gradpatch.sampling.families.diffusers_modular`.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable


from gradpatch.errors import NotDifferentiableError
from gradpatch.sampling.contract import accepted_keywords, sampler_entry
from gradpatch.sampling.families.diffusers_run import differentiable_run, in_call
from gradpatch.sampling.families.hierarchy import Replace, hierarchy_fix
from gradpatch.sampling.lifting.bytecode import no_grad_body
from gradpatch.sampling.run import SamplingRun, recording

FAMILY = "diffusers"

__all__ = ["NotDifferentiableError", "no_grad_body", "patch_pipeline_hierarchy"]

_HELPER = re.compile(r"_?(encode|decode|vae_decode)")


def _readable(function: Callable[..., Any]) -> bool:
    try:
        inspect.signature(function)
    except (TypeError, ValueError):
        return False
    return True


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
    def run(this: SamplingRun, outer: SamplingRun | None, args: tuple, kwargs: dict) -> Any:
        pipe = args[0]
        if outer is not None and in_call(pipe):  # super().__call__ from a subclass's body: already set up
            return body(*args, **kwargs)
        _check_output_type(body, pipe, args[1:], kwargs)
        with differentiable_run(pipe, this):
            return body(*args, **kwargs)

    return sampler_entry(original, run, family=FAMILY, describe=lambda args: f"{type(args[0]).__name__}.__call__",
                         accepted=accepted_keywords(body),
                         expected="no denoiser evaluation went through gradpatch's run_step")


def _guarded_call(original: Callable[..., Any], reason: str) -> Callable[..., Any]:
    return sampler_entry(original, None, family=FAMILY, describe=lambda args: f"{type(args[0]).__name__}",
                         refusal=reason)


def _helper(original: Callable[..., Any], body: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def helper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return (body if in_call(self) and recording() else original)(self, *args, **kwargs)

    return helper


def _patch_class(cls: type, replace: Replace) -> None:
    original = vars(cls).get("__call__")
    if inspect.isfunction(original) and _readable(original) and "cache" not in inspect.signature(original).parameters \
            and not hasattr(original, "__gradpatch_original__"):  # a __call__ with its own ``cache``: theirs
        body = None if getattr(cls, "_is_onnx", False) else no_grad_body(original)
        reason = "ONNX pipelines run numpy" if getattr(cls, "_is_onnx", False) else \
            "its __call__ is not decorated with @torch.no_grad(): no undecorated body to run"
        replace(cls, "__call__", original,
                _guarded_call(original, reason) if body is None else _differentiable_call(original, body))
    for name, value in list(vars(cls).items()):
        body = no_grad_body(value) if _HELPER.match(name) else None
        if body is not None:
            replace(cls, name, value, _helper(value, body))


patch_pipeline_hierarchy = hierarchy_fix(_patch_class)
"""The fix factory for ``DiffusionPipeline.__init_subclass__``, which the base class inherits (the
engine passes the inherited method, bound to the base). Patches every pipeline class defined so
far and returns the ``__init_subclass__`` that patches each one defined later; the engine calls its
``__gradpatch_revert__`` when it removes it again (:mod:`gradpatch.sampling.families.hierarchy`)."""

