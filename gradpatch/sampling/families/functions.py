"""Differentiable sampler *functions*: ``sample_*(model, x, ...)`` decorated with ``@torch.no_grad()``.

k-diffusion's ``k_diffusion.sampling.sample_*`` (and the copy stable-audio-tools vendors) and
stable-audio-tools' own samplers take the denoiser as their first argument, ``model``, and step through
a schedule in one loop, ``for i in trange(len(sigmas) - 1)`` (or ``tqdm(...)``). The fix gives each
one the interface of :mod:`gradpatch.sampling.run`, keyword-only:

* ``cache=True`` (default): the original function, called as it is (no graph, bitwise-equal output).
* ``cache=False``: the undecorated body inside :func:`~gradpatch.sampling.run.differentiable`
  (gradients on, also under an outer ``no_grad``; ``inference_mode`` refused). Gradients reach the
  denoiser's parameters and every differentiable input (``x``, tensors in ``extra_args``). The
  caller's train/eval modes are kept: these samplers never call ``eval()``.
* ``grad_steps=K``: a graph only through the last K steps, where a step is one iteration of the
  sampler's loop and N its length: grad is off from the first step until the last evaluation of step
  N-K-1 returns, so the latent entering step N-K is detached (the noise ``x`` gets no gradient) and
  Heun, DPM-2, DPM++ 2S and DPM++ SDE (two evaluations per step) and RK4 (four) are counted in steps,
  not calls. Multistep methods (LMS, DPM++ 2M, 3M SDE) reuse earlier steps' denoised outputs, which
  are then constants.
* ``checkpoint_steps=True``: each denoiser evaluation is recomputed in backward instead of stored.

How the step is known. For a call with ``grad_steps``, the ``model`` argument is replaced by a wrapper
that runs each evaluation through :func:`~gradpatch.sampling.run.run_step`, and the progress-bar
globals of the sampler's module (``trange``, ``tqdm``) are shadowed, for the call and in the caller's
context only, by versions that record the loop index as the loop runs and the loop's length when it
starts (a ``zip`` with no length is read into a list first). Matching sigma values would misattribute
Heun's second evaluation (made at ``sigmas[i + 1]``) and the callback comes between a step's two
evaluations, so neither is used. An evaluation made before the loop starts, or a second loop in one
call, raises instead of truncating at a guessed step. ``checkpoint_steps`` alone needs no step index:
only the ``model`` wrapper is used.

Nesting. A patched sampler called without ``cache=`` inside another patched sampler's ``cache=False``
call (stable-audio-tools' ``sample_diffusion`` calling the vendored k-diffusion samplers) follows the
outer call's options: gradients flow through both, and the inner sampler counts the steps. The unit
run under ``no_grad`` or checkpointed is then the inner sampler's ``model`` argument, whatever the outer
call wrapped around the user's denoiser: for ``sample_diffusion``'s k-diffusion types that is
``VDenoiser(model)``, so in the first N-K steps its skip term ``x * c_skip`` carries no gradient to the
noise either (parameter gradients are unaffected). An outer ``model`` wrapper passes evaluations the
inner one already handles straight through, also in a checkpoint recompute.

Counted steps. The stable-audio-tools forks' Euler and v-diffusion samplers (ThinkSound, AudioX,
SongBloom: :func:`counted_step_sampler`) evaluate ``model`` exactly once per iteration of a loop of
``steps`` iterations, which SongBloom runs over a plain ``zip``/``range`` unless ``prog_bar=True``: there the
step is the evaluation's index and N the ``steps`` argument (``len(sigmas) - 1`` where stable-audio-tools
0.0.19's copy is given ``sigmas`` instead). An evaluation beyond the N-th, or a
``grad_steps`` call that ends after fewer, raises RuntimeError instead of cutting at a wrong step.

Adaptive samplers (``sample_dpm_fast``, ``sample_dpm_adaptive``) take ``cache`` and
``checkpoint_steps``; their step count is decided as they go (``dpm_adaptive`` accepts or rejects
steps by ``float(error)``), so ``grad_steps`` is refused with a ValueError. Gradients flow along the
path taken; the choice of path is not differentiable.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import sys
from contextvars import ContextVar
from typing import Any, Callable, Iterator, TypeVar


from gradpatch.sampling.contract import sampler_entry
from gradpatch.sampling.options import SamplingOptions
from gradpatch.sampling.run import differentiable, run_step
from gradpatch.sampling.shadows import shadow

T = TypeVar("T")
_PROGRESS = ("trange", "tqdm")  # the loop helpers these samplers iterate over


class _Loop:
    """The step loop of one patched sampler call: its length once started, the current index."""

    def __init__(self, sampler: str, modules: tuple[str, ...]) -> None:
        self.sampler, self.modules = sampler, modules
        self.step, self.total = -1, None  # type: int, int | None

    def start(self, total: int) -> None:
        if self.total is not None:
            raise RuntimeError(f"{self.sampler}: grad_steps counts the iterations of one step loop, but the "
                               "sampler started a second one; use checkpoint_steps instead")
        self.total = total


_loop: ContextVar[_Loop | None] = ContextVar("gradpatch_sampler_loop", default=None)
_evaluating: ContextVar[bool] = ContextVar("gradpatch_sampler_evaluating", default=False)


class _Tracked:
    """A progress bar whose iteration tells ``loop`` which step is running."""

    def __init__(self, bar: Any, loop: _Loop) -> None:
        self._bar, self._loop = bar, loop

    def __iter__(self) -> Iterator[Any]:
        self._loop.start(len(self._bar))
        for index, item in enumerate(self._bar):
            self._loop.step = index
            yield item

    def __len__(self) -> int:
        return len(self._bar)

    def __enter__(self) -> Any:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._bar.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


def _progress(module: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``trange``/``tqdm`` of ``module`` that, inside a stepped call of a sampler of ``module`` in this
    context, tracks the loop; anywhere else it is the original."""

    @functools.wraps(original)
    def progress(*args: Any, **kwargs: Any) -> Any:
        loop = _loop.get()
        if loop is None or module not in loop.modules:
            return original(*args, **kwargs)
        if args and not hasattr(args[0], "__len__") and not hasattr(args[0], "__index__"):
            args = (list(args[0]),) + args[1:]  # tqdm(zip(t[:-1], t[1:])): finite, known length
        return _Tracked(original(*args, **kwargs), loop)

    return progress


class _SteppedModel:
    """The ``model`` argument, with each evaluation run through :func:`run_step` at the loop's step."""

    def __init__(self, model: Callable[..., Any], loop: _Loop, options: SamplingOptions, counted: bool = False) -> None:
        self.model, self.loop, self.options, self.counted = model, loop, options, counted

    def _evaluate(self, *args: Any, **kwargs: Any) -> Any:
        token = _evaluating.set(True)  # also set in a checkpoint recompute: outer wrappers pass through
        try:
            return self.model(*args, **kwargs)
        finally:
            _evaluating.reset(token)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _evaluating.get():  # an inner patched sampler's evaluation: it counted the step
            return self.model(*args, **kwargs)
        loop = self.loop
        if self.counted:  # one evaluation per step: this evaluation's index is the step
            loop.step += 1
            if loop.total is not None and loop.step >= loop.total:
                raise RuntimeError(f"{loop.sampler}: evaluated the model more than once per step (evaluation "
                                   f"{loop.step + 1} of {loop.total} steps), which grad_steps cannot count")
        if self.options.grad_steps is not None and loop.total is None:
            raise RuntimeError(f"{loop.sampler}: grad_steps needs every denoiser evaluation inside the "
                               "sampler's step loop, but the model was called before the loop started; "
                               "use checkpoint_steps instead")
        return run_step(max(loop.step, 0), loop.total or 0, self._evaluate, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the denoiser's other attributes (inner_model, ...)
        return getattr(self.__dict__["model"], name)


def _steps(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: grad_steps counts the `steps` steps of the call, but steps={value!r} is not an "
                         "integer; pass steps as an int") from None


def _sampler(original: Callable[..., T], *, adaptive: bool, counted: bool = False) -> Callable[..., T]:
    raw = inspect.unwrap(original)
    signature = inspect.signature(raw)
    name = f"{raw.__module__}.{raw.__qualname__}"
    module = sys.modules.get(raw.__module__)
    progress = tuple(n for n in _PROGRESS if callable(getattr(module, n, None)))

    def run(this: Any, outer: Any, args: tuple, kwargs: dict) -> Any:
        options = this.options
        if adaptive and options.grad_steps is not None:
            raise ValueError(f"{name} chooses its steps as it goes, so grad_steps (the last K of N steps) has "
                             "no fixed N; it supports cache=False and checkpoint_steps=True: use those")
        stepped = options.grad_steps is not None or options.checkpoint_steps
        with contextlib.ExitStack() as stack:
            if outer is None or outer.family != "functions":  # else: a sampler of this family continues its run
                stack.enter_context(differentiable(None, this))
            if stepped:
                bound = signature.bind(*args, **kwargs)
                loop = _Loop(name, (raw.__module__,))
                if counted and options.grad_steps is not None:
                    bound.apply_defaults()
                    steps, sigmas = bound.arguments.get("steps"), bound.arguments.get("sigmas")
                    loop.start(_steps(name, len(sigmas) - 1 if steps is None and sigmas is not None else steps))
                bound.arguments["model"] = _SteppedModel(bound.arguments["model"], loop, options, counted)
                args, kwargs = bound.args, bound.kwargs
                if counted and options.grad_steps is not None:
                    out = raw(*args, **kwargs)
                    if loop.step + 1 != loop.total:
                        raise RuntimeError(f"{name}: evaluated the model {loop.step + 1} times for steps="
                                           f"{loop.total}; grad_steps needs one evaluation per step")
                    return out
                if options.grad_steps is not None and module is not None:
                    for global_name in progress:
                        stack.enter_context(shadow(module, global_name, functools.partial(_progress, raw.__module__)))
                    token = _loop.set(loop)
                    stack.callback(_loop.reset, token)
            return raw(*args, **kwargs)

    return sampler_entry(original, run, family="functions", describe=lambda args: name,
                         owner=lambda args, kwargs: args[0] if args else kwargs.get("model"),
                         expected="the denoiser was never evaluated through gradpatch's run_step")


def fixed_step_sampler(original: Callable[..., T]) -> Callable[..., T]:
    """Fix factory for a ``@torch.no_grad()`` sampler function whose steps are the iterations of one
    ``trange``/``tqdm`` loop of its module (k-diffusion's fixed-schedule samplers, stable-audio-tools'
    samplers and ``sample_diffusion``). A new object per call."""
    return _sampler(original, adaptive=False)


def counted_step_sampler(original: Callable[..., T]) -> Callable[..., T]:
    """Fix factory for a ``@torch.no_grad()`` sampler function evaluating ``model`` once per step, for
    ``steps`` steps (the stable-audio-tools forks' ``sample_discrete_euler``, ``sample`` and SongBloom's
    ``sample_discrete_euler_with_temperature``, whose loops need not go through a progress bar). Its
    ``__module__`` is gradpatch's: the members of that family are recognised together, and a member
    already replaced counts as the definition gradpatch recognised before replacing it."""
    fixed = _sampler(original, adaptive=False, counted=True)
    fixed.__module__ = __name__
    return fixed


def adaptive_sampler(original: Callable[..., T]) -> Callable[..., T]:
    """Fix factory for a ``@torch.no_grad()`` sampler function that chooses its steps as it goes
    (k-diffusion's ``sample_dpm_fast``, ``sample_dpm_adaptive``): ``cache`` and ``checkpoint_steps``;
    ``grad_steps`` raises ValueError."""
    return _sampler(original, adaptive=True)
