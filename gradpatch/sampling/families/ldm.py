"""Differentiable native samplers of the CompVis latent-diffusion family (``ldm``, AudioLDM 1/2,
AudioSR, ...): ``DDIMSampler``, ``PLMSSampler``, ``DPMSolverSampler``, ``DDPM``/``LatentDiffusion``.

These codebases decorate nearly every method of a sampling call with ``@torch.no_grad()``: the public
entry point (``DDIMSampler.sample``), the loop it calls (``ddim_sampling``), the step (``p_sample_ddim``)
and the decoder (``decode_first_stage``). The fixes here are declared per method in ``patches/``, each
method recognised by its own fingerprint; a target is one :class:`~gradpatch.patching.patch.Patch` naming
one of these factories:

``entry`` (public entry points: ``DDIMSampler.sample``/``decode``/``stochastic_encode``,
``LatentDiffusion.sample``/``p_sample_loop``/``sample_log``/``decode_first_stage``/...)
    Adds keyword-only ``cache: bool = True``, ``grad_steps=None``, ``checkpoint_steps=False``.
    ``cache=True`` calls the original decorated method: upstream's call, bitwise the same outputs.
    ``cache=False`` runs the undecorated body under :func:`gradpatch.sampling.run.differentiable`:
    grad on (also under an outer ``no_grad``), the diffusion model's ``eval()`` a no-op (modes as the
    caller set them). While it runs, every method declared ``inner``/``step_*`` runs its undecorated
    body too, and an entry point reached from the body *without* ``cache=`` (``sample_log`` creating a
    ``DDIMSampler`` and calling its ``sample``) continues the same graph with the same options; cache=True
    calls elsewhere (other threads, other tasks) are unaffected. Raises RuntimeError inside
    ``torch.inference_mode()``, while an EMA scope of the model is active (see ``guard_ema_scope``), and
    when ``grad_steps``/``checkpoint_steps`` were asked for but no denoiser evaluation went through them.
``lifted_entry``
    ``entry`` for a method whose body holds ``with torch.no_grad():`` (audioldm2's
    ``decode_first_stage``): ``cache=False`` runs :func:`gradpatch.sampling.lifting.lift.lift_no_grad`'s copy. Recognise
    it with :class:`gradpatch.sampling.lifting.lift.Liftable` so a source that cannot be lifted is skipped and reported.
``inner`` (``ddim_sampling``, ``plms_sampling``, ``get_input``, ...)
    The original, except inside a ``cache=False`` call with grad enabled, where the undecorated body.
``step_by_index`` / ``step_by_timestep`` (``p_sample_ddim``, ``p_sample_plms``; ``p_sample``)
    ``inner``, and the call marks one sampling step. A step is one call of this method, counted as
    actually taken: the position is read from the call itself, as steps left after this one: the
    ``index`` argument for DDIM/PLMS (upstream passes ``total_steps - i - 1``, whatever S+1 count its
    schedule produced), the ``t`` argument for ancestral sampling (``reversed(range(T))``).
``refuse_cache_false``, ``guard_ema_scope``, ``buffers_follow_model``
    In :mod:`gradpatch.sampling.families.ldm_guards`: ``generate_sample*`` refuse ``cache=False``; EMA weight
    swaps and ``cache=False`` graphs exclude each other; sampler buffers follow the model's device.
``step_factory``, ``at_step``
    For step boundaries with other signatures (a fix module defines ``my_step = step_factory(...)``).

Memory options. With ``grad_steps``/``checkpoint_steps``, for the duration of the call, the model's
``apply_model`` (``model.model.forward`` for a pixel-space ``DDPM`` without one) is shadowed on the
instance, in the caller's context only, so that each evaluation made inside a step goes through
:func:`gradpatch.sampling.run.run_step`: ``grad_steps=K`` runs the evaluations of every step with
K or more steps left under ``no_grad`` (the last K build the graph); ``checkpoint_steps=True``
recomputes each evaluation in backward. Only the network evaluation is inside the recomputed region:
the update of ``x``, PLMS's ``old_eps``, classifier-free guidance's combination and the schedules
stay outside, so a recompute never advances sampler state. A step that evaluates the model twice
(audioldm2's DDIM: unconditional, then conditional) runs both evaluations at that step's position.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

from gradpatch.errors import NotDifferentiableError
from gradpatch.sampling.families.ldm_uncovered import warn_uncovered
from gradpatch.sampling.lifting.bytecode import no_grad_body
from gradpatch.sampling.contract import accepted_keywords, sampler_entry
from gradpatch.sampling.run import SamplingRun, current, differentiable, recording, run_step
from gradpatch.sampling.shadows import shadow

_steps_left: ContextVar[Callable[[], int] | None] = ContextVar("gradpatch_ldm_step", default=None)

# Models in a cache=False call, and models inside an EMA scope that swapped weights: id -> count.
_lock = threading.Lock()
sampling_models: dict[int, int] = {}
ema_models: dict[int, int] = {}
FAMILY = "ldm"

EMA_MESSAGE = (
    "{what} while {model}.ema_scope() is active: ema_scope swaps the EMA weights in with .data.copy_ "
    "and copies the live ones back on exit, so a graph built inside it and backpropagated after it "
    "(or built outside and backpropagated inside) gets wrong gradients with no error. Sample with "
    "cache=False outside ema_scope (the live weights); to differentiate through the EMA weights, copy "
    "them into a model of their own: ema = copy.deepcopy(model); model.model_ema.copy_to(ema.model)."
)


def active_run() -> SamplingRun | None:
    """The ``cache=False`` call of this family in progress in this context, if it records a graph."""
    run = current.get()
    return run if run is not None and run.family == FAMILY and recording() else None


def _diffusion_model(obj: Any) -> Any:
    """The ``DDPM``/``LatentDiffusion`` behind ``obj``: itself, or a sampler's ``.model``."""
    if hasattr(obj, "apply_model") or hasattr(obj, "ema_scope"):
        return obj
    inner = getattr(obj, "model", None)
    if hasattr(inner, "apply_model") or hasattr(inner, "ema_scope"):
        return inner
    return obj if isinstance(obj, torch.nn.Module) else None


def _denoiser(model: Any) -> tuple[Any, str] | None:
    """Where the network is evaluated: ``model.apply_model``, else ``model.model.forward``."""
    if model is None:
        return None
    if callable(getattr(model, "apply_model", None)):
        return model, "apply_model"
    wrapper = getattr(model, "model", None)
    return (wrapper, "forward") if isinstance(wrapper, torch.nn.Module) else None


def _stepped(real: Callable[..., Any]) -> Callable[..., Any]:
    def evaluate(*args: Any, **kwargs: Any) -> Any:
        left, run = _steps_left.get(), current.get()
        if left is None or run is None or run.family != FAMILY:
            return real(*args, **kwargs)  # outside a step, or a cache=True call in another context
        remaining = left() if run.options.grad_steps is not None else 0
        return run_step(0, remaining + 1, real, *args, **kwargs)  # no_grad iff remaining >= grad_steps

    return evaluate


@contextlib.contextmanager
def counted(table: dict[int, int], key: int) -> Iterator[None]:
    with _lock:
        table[key] = table.get(key, 0) + 1
    try:
        yield
    finally:
        with _lock:
            table[key] -= 1
            if not table[key]:
                del table[key]


@contextlib.contextmanager
def _differentiable_call(owner: Any, name: str, run: SamplingRun) -> Iterator[SamplingRun]:
    model = _diffusion_model(owner)
    if model is not None and id(model) in ema_models:
        raise RuntimeError(EMA_MESSAGE.format(what=f"{type(owner).__name__}.{name}(cache=False)",
                                              model=type(model).__name__))
    for obj in {id(owner): owner, id(model): model}.values():
        warn_uncovered(obj)
    options = run.options
    with contextlib.ExitStack() as stack:
        stack.enter_context(differentiable(model, run))
        if model is not None:
            stack.enter_context(counted(sampling_models, id(model)))
        if options.grad_steps is not None or options.checkpoint_steps:
            where = _denoiser(model)
            if where is None:
                raise NotDifferentiableError(f"grad_steps/checkpoint_steps: {type(owner).__name__} has no "
                                             "diffusion model with apply_model or a model.model network")
            run.enter(stack, functools.partial(shadow, *where, _stepped))
        yield run


def _entry(original: Callable[..., Any], body: Callable[..., Any]) -> Callable[..., Any]:
    name = getattr(original, "__name__", "method")

    def run(this: SamplingRun, outer: SamplingRun | None, args: tuple, kwargs: dict) -> Any:
        if outer is not None and outer.family == FAMILY:
            return body(*args, **kwargs)  # reached from a cache=False call of this family: continue its graph
        with _differentiable_call(args[0], name, this):
            return body(*args, **kwargs)

    return sampler_entry(original, run, family=FAMILY, describe=lambda args: f"{type(args[0]).__name__}.{name}",
                         accepted=accepted_keywords(body),
                         expected="no denoiser evaluation happened inside a sampling step of this call")


def _decorated_body(original: Callable[..., Any]) -> Callable[..., Any]:
    body = no_grad_body(original)
    if body is None:
        raise TypeError(f"{getattr(original, '__qualname__', original)!r} is not decorated with "
                        "@torch.no_grad(): nothing to unwrap (declare it with lifted_entry if its body "
                        "holds the no_grad)")
    return body


def entry(original: Callable[..., Any]) -> Callable[..., Any]:
    """Fix factory: a ``@torch.no_grad()`` public entry point (module docstring). A new object per call."""
    return _entry(original, _decorated_body(original))


def lifted_entry(original: Callable[..., Any]) -> Callable[..., Any]:
    """Fix factory: an entry point whose body has an in-body ``with torch.no_grad():``; ``cache=False``
    runs the lifted copy (decorators, if any, are not re-applied: the copy is the undecorated body)."""
    from gradpatch.sampling.lifting.lift import lift_no_grad

    return _entry(original, lift_no_grad(original))


@contextlib.contextmanager
def at_step(steps_left: Callable[[], int]) -> Iterator[None]:
    """Mark the block as one sampling step, for step boundaries the factories below do not cover.

    ``steps_left()`` returns how many steps come after this one (0 for the last); it is called only
    when ``grad_steps`` is set, at the first model evaluation of the block. Every evaluation of the
    diffusion model's ``apply_model`` inside the block runs at this position. Outside a ``cache=False``
    call of this family the block is unaffected.
    """
    token = _steps_left.set(steps_left)
    try:
        yield
    finally:
        _steps_left.reset(token)


Factory = Callable[[Callable[..., Any]], Callable[..., Any]]


def step_factory(steps_left: Callable[[inspect.BoundArguments], int] | None) -> Factory:
    """A fix factory for methods reached from an entry point: inside a ``cache=False`` call with grad
    on, the method runs its undecorated body (a method without ``@torch.no_grad()`` runs as it is) and,
    if ``steps_left`` is given, each call is one sampling step at the position ``steps_left(bound)``
    computes from the call's bound arguments (defaults applied on demand); elsewhere the original runs.
    The step factories below are built with it; a codebase with another step signature can define its
    own in a fix module (``my_step = step_factory(lambda bound: ...)``) and name it in ``patches/``."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        body = no_grad_body(original) or original
        signature = inspect.signature(body)

        @functools.wraps(original)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if active_run() is None:
                return original(self, *args, **kwargs)
            if steps_left is None:
                return body(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            with at_step(lambda: steps_left(bound)):
                return body(self, *args, **kwargs)

        return method

    return factory


def _argument(bound: inspect.BoundArguments, name: str) -> Any:
    if name not in bound.arguments:
        bound.apply_defaults()
    return bound.arguments[name]


inner = step_factory(None)
inner.__doc__ = "Fix factory: a ``@torch.no_grad()`` method reached from an entry point (module docstring)."

step_by_index = step_factory(lambda bound: int(_argument(bound, "index")))
step_by_index.__doc__ = """Fix factory: a sampling step whose ``index`` argument counts the steps left
after it (DDIM's ``p_sample_ddim``, PLMS's ``p_sample_plms``)."""

step_by_timestep = step_factory(lambda bound: int(torch.as_tensor(_argument(bound, "t")).reshape(-1)[0]))
step_by_timestep.__doc__ = """Fix factory: an ancestral sampling step whose ``t`` argument (a tensor of
equal timesteps, or an int) counts the steps left after it (``DDPM.p_sample``, ``LatentDiffusion.p_sample``;
their loops run ``reversed(range(T))``)."""
