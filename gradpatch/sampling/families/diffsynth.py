"""Differentiable DiffSynth-Studio pipelines: ``cache=False`` on every ``@torch.no_grad()`` ``__call__``.

Every pipeline of ``diffsynth`` (2.x: Wan, Qwen-Image, FLUX.1/2, Z-Image, ... about 25 classes) derives
from ``diffsynth.diffusion.base_pipeline.BasePipeline`` and decorates its own ``__call__`` with
``@torch.no_grad()``. One patch covers the hierarchy (:mod:`gradpatch.sampling.families.hierarchy`):
the classes defined when it is applied and every one defined later (the user's own included). A class
whose *own* ``__call__`` is ``@torch.no_grad()`` gets one that also takes, keyword-only,
``cache: bool = True``, ``grad_steps``, ``checkpoint_steps`` (:mod:`gradpatch.sampling.contract`):

* ``cache=True`` calls the original object: the same code path, bitwise-equal outputs.
* ``cache=False`` runs the undecorated body with gradients on (``eval()`` a no-op on the pipeline and
  its components) and returns what the body returns. **Outputs that leave torch.** Most image
  pipelines end in ``self.vae_output_to_image(...)`` (PIL), video ones in ``vae_output_to_video`` (a
  list of PIL images): no graph can come out of those. A pipeline whose ``__call__`` takes
  ``output_type`` (``WanVideoPipeline``) with a value other than ``"floatpoint"`` is refused before
  anything runs (ValueError); a body that returned no tensor at all (PIL, numpy, lists of them) raises
  :class:`~gradpatch.errors.NotDifferentiableError` naming what it returned and what to do: ask for the
  tensor output (``output_type="floatpoint"``), let that instance keep the decoded tensor
  (``pipe.vae_output_to_image = lambda image, **kw: image``; ``vae_output_to_video`` likewise), or
  call the pieces (units, ``model_fn``, the VAE). Never a silently detached image.
* ``grad_steps=K`` counts iterations of the denoising loop, ``for progress_id, timestep in
  enumerate(progress_bar_cmd(self.scheduler.timesteps))``: the call's ``progress_bar_cmd`` (tqdm or
  the caller's) is wrapped, and iterating over ``pipe.scheduler.timesteps`` through it marks step
  ``i`` of ``len(timesteps)``; the latent entering iteration N-K carries no graph. A body running a
  second such loop (two-stage pipelines) is refused for ``grad_steps`` (RuntimeError).
  ``checkpoint_steps`` recomputes each denoiser evaluation, one ``pipe.model_fn(...)`` call (CFG: two
  per iteration, as the body makes them); the scheduler's ``step`` is never inside a checkpoint. A
  pipeline with no ``model_fn`` (its loop inside a unit: ``MiniMaxMusic3Pipeline``) cannot take either
  option: NotDifferentiableError.

A class whose own ``__call__`` is not ``@torch.no_grad()`` (``YuE2Pipeline``: ``inference_mode``) is
refused for ``cache=False`` (NotDifferentiableError) and unchanged otherwise. The ``model_fn`` wrapper
is an instance attribute for the call: one pipeline instance must not run two such calls concurrently.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterable, Iterator

from gradpatch.errors import NotDifferentiableError
from gradpatch.sampling.contract import accepted_keywords, sampler_entry
from gradpatch.sampling.families.hierarchy import Replace, hierarchy_fix
from gradpatch.sampling.lifting.bytecode import no_grad_body
from gradpatch.sampling.run import SamplingRun, current, differentiable, run_step
from gradpatch.sampling.shadows import shadow

FAMILY = "diffsynth"

__all__ = ["patch_pipeline_hierarchy"]


class _Loop:
    """Where the body's denoising loop is: iteration ``index`` of ``total`` (-1 outside the loop)."""

    def __init__(self, pipe: Any, run: SamplingRun) -> None:
        self.pipe, self.run, self.index, self.total, self.loops = pipe, run, -1, 0, 0

    def progress(self, user: Callable[..., Any]) -> Callable[..., Any]:
        """The ``progress_bar_cmd`` the body gets: the caller's, marking iterations of the loop."""

        @functools.wraps(user)
        def progress_bar_cmd(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
            bar = user(iterable, *args, **kwargs)
            if iterable is None or iterable is not getattr(self.pipe.scheduler, "timesteps", None):
                return bar
            return self._marked(bar, len(iterable))  # type: ignore[arg-type]  # (a tensor of timesteps)

        return progress_bar_cmd

    def _marked(self, bar: Iterable[Any], total: int) -> Iterator[Any]:
        self.loops += 1
        if self.loops > 1 and self.run.options.grad_steps is not None:
            raise RuntimeError(f"grad_steps: {type(self.pipe).__name__} runs a second denoising loop; the last K "
                               "steps of the call cannot be told apart. Use checkpoint_steps, or call its stages")
        self.total = total
        try:
            for self.index, item in enumerate(bar):
                yield item
        finally:
            self.index = -1

    def evaluations(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """The stand-in of ``pipe.model_fn``: each call in the loop is an evaluation of its step."""

        @functools.wraps(inner)
        def model_fn(*args: Any, **kwargs: Any) -> Any:
            if current.get() is None or self.index < 0:  # another context, or outside the loop
                return inner(*args, **kwargs)
            return run_step(self.index, self.total, inner, *args, **kwargs)

        return model_fn


def _bind(body: Callable[..., Any], args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    try:
        return inspect.signature(body).bind(*args, **kwargs)
    except TypeError:
        return None  # bad arguments: the call itself reports them


def _holds_tensor(out: Any, depth: int = 0) -> bool:
    import torch

    if isinstance(out, torch.Tensor):
        return True
    if depth < 3 and isinstance(out, (list, tuple)):
        return any(_holds_tensor(item, depth + 1) for item in out)
    if depth < 3 and isinstance(out, dict):
        return any(_holds_tensor(item, depth + 1) for item in out.values())
    return False


def _what(out: Any) -> str:
    if isinstance(out, (list, tuple)) and out:
        return f"a {type(out).__name__} of {type(out[0]).__module__}.{type(out[0]).__qualname__}"
    return f"{type(out).__module__}.{type(out).__qualname__}"


def _leaves_torch(name: str, out: Any) -> NotDifferentiableError:
    return NotDifferentiableError(
        f"{name}(cache=False) returned {_what(out)}: its __call__ converts the decoded tensor to PIL images "
        "or numpy at its end (BasePipeline.vae_output_to_image / vae_output_to_video), which carries no graph. "
        "Ask for the tensor output where the pipeline has one (WanVideoPipeline: output_type='floatpoint'), let "
        "this instance keep the decoded tensor (pipe.vae_output_to_image = lambda image, **kw: image; "
        "vae_output_to_video likewise), or call its pieces (units, model_fn, the VAE) yourself")


def _differentiable_call(original: Callable[..., Any], body: Callable[..., Any]) -> Callable[..., Any]:
    def run(this: SamplingRun, outer: SamplingRun | None, args: tuple, kwargs: dict) -> Any:
        import torch

        pipe, name = args[0], type(args[0]).__name__
        bound = _bind(body, args, kwargs)
        output_type = bound.arguments.get("output_type", "floatpoint") if bound is not None else "floatpoint"
        if output_type != "floatpoint":
            raise ValueError(f"{name}(cache=False) keeps the graph only for tensor outputs; output_type="
                             f"{output_type!r} converts to PIL images and cuts it. Pass output_type='floatpoint'.")
        options = this.options
        loop = _Loop(pipe, this)
        stepped = options.grad_steps is not None or options.checkpoint_steps
        if stepped:
            if not callable(vars(pipe).get("model_fn", getattr(pipe, "model_fn", None))):
                raise NotDifferentiableError(f"grad_steps/checkpoint_steps: {name} has no model_fn (its denoising "
                                             "loop is not the pipeline's own), so its steps cannot be located")
            if bound is None or "progress_bar_cmd" not in inspect.signature(body).parameters:
                raise NotDifferentiableError(f"grad_steps/checkpoint_steps: {name}.__call__ takes no "
                                             "progress_bar_cmd, so its denoising loop cannot be located")
            default = inspect.signature(body).parameters["progress_bar_cmd"].default
            bound.arguments["progress_bar_cmd"] = loop.progress(bound.arguments.get("progress_bar_cmd", default))
            args, kwargs = bound.args, bound.kwargs
        modules = [pipe] + [m for m in vars(pipe).get("_modules", {}).values() if isinstance(m, torch.nn.Module)]
        with contextlib.ExitStack() as stack:
            stack.enter_context(differentiable(modules, this))
            if stepped:
                stack.enter_context(shadow(pipe, "model_fn", loop.evaluations))
            out = body(*args, **kwargs)
        if not _holds_tensor(out):
            raise _leaves_torch(name, out)
        return out

    return sampler_entry(original, run, family=FAMILY, describe=lambda args: f"{type(args[0]).__name__}.__call__",
                         accepted=accepted_keywords(body),
                         expected="no call of pipe.model_fn inside the denoising loop went through gradpatch")


def _patch_class(cls: type, replace: Replace) -> None:
    original = vars(cls).get("__call__")
    if not inspect.isfunction(original) or hasattr(original, "__gradpatch_original__"):
        return
    try:
        if "cache" in inspect.signature(original).parameters:  # a __call__ with its own ``cache``: theirs
            return
    except (TypeError, ValueError):
        return
    body = no_grad_body(original)
    if body is None:
        replace(cls, "__call__", original, sampler_entry(
            original, None, family=FAMILY, describe=lambda args: type(args[0]).__name__,
            refusal="its __call__ is not decorated with @torch.no_grad() (inference_mode, or none): "
                    "no undecorated body to run"))
    else:
        replace(cls, "__call__", original, _differentiable_call(original, body))


patch_pipeline_hierarchy = hierarchy_fix(_patch_class)
"""The fix factory for ``BasePipeline.__init_subclass__`` (inherited; see
:func:`gradpatch.sampling.families.hierarchy.hierarchy_fix`)."""
