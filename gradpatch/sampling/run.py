"""Differentiable sampling: what every fix of a ``@torch.no_grad()`` sampler shares.

A patched sampler takes ``cache: bool = True``. ``cache=True`` calls the original, unchanged: no graph,
``self.eval()``, caches reused, the same outputs bit for bit. ``cache=False`` runs the undecorated body
inside :func:`differentiable`: gradients enabled (also under an outer ``no_grad``), the model's
``eval()`` a no-op so train/eval modes stay as the caller set them (dropout stays on for a student in
train mode), and the memory options below visible to :func:`run_step`, which the fixes call around
each denoiser evaluation. Caches that reuse one step's tensors in later steps are bypassed
(:func:`text_cache_off`). Everything is restored on exit, also when sampling raises. ``cache=False``
inside :func:`torch.inference_mode` raises: no graph can be recorded there. The attribute shadows act
only in the context (thread, task) of the ``cache=False`` call, so concurrent ``cache=True`` calls on
the same model are unaffected.

Memory. Backpropagating through N steps keeps N copies of the denoiser's activations. Two keyword-only
options bound that (used with ``cache=False``):

* ``grad_steps=K``: a graph only through the last K steps (truncated backpropagation, as in DRaFT-K
  and AlignProp): grad is off from the first evaluation of step 0 until the last evaluation of step
  N-K-1 returns, so those evaluations and the state updates between them are not recorded; from then
  until the sampler's code is back at the top of its loop, whatever is computed from those evaluations
  is not recorded either, and from there until step N-K starts everything is, the latent a constant
  (:mod:`gradpatch.sampling.steps.window`). Gradients equal those of the same loop with ``x = x.detach()``
  at the top of the loop body before step N-K: the initial noise gets none, a pre-net applied to the
  latent before step N-K (``x = pre(x); v = step(x)``) and the conditioning prepared for it get theirs;
  what the sampler computes before its first step (conditioning) and inputs used in the last K steps or
  after the loop (F5 pastes ``cond`` into the output) too. Guidance that differentiates through the step
  inside its own ``torch.enable_grad()`` keeps working (:mod:`gradpatch.sampling.steps.regions`). ``K >= N``
  is the plain run. ``grad_steps=(lo, hi)`` (randomized truncation, AlignProp) is this with K drawn once
  per call, uniformly in ``[lo, hi]`` inclusive, before the run starts (:mod:`gradpatch.sampling.contract`,
  rule 1): the run only ever sees the drawn K.
* ``checkpoint_steps=True``: each denoiser evaluation is recomputed during backward instead of stored
  (through the fixed checkpoint's node, which replays the RNG, so dropout agrees), so saved memory
  grows by about one latent per step instead of one set of activations, at the cost of a second
  forward per evaluation (:mod:`gradpatch.sampling.steps.checkpoint`: gradpatch's block checkpoints
  inside an evaluation run plainly, so nothing is recomputed twice). Gradients equal the plain run's
  (up to the order floating-point contributions are summed). The recompute happens after the
  call returned; it re-enters the call's shadows (:meth:`SamplingRun.active`), so it too sees caches
  off, and the step's inputs as the forward saw them, also buffers the sampler refilled in place since
  (:mod:`gradpatch.sampling.steps.inputs`). Never wrap a scheduler's ``step`` this way: schedulers keep
  state a recompute would advance twice.
* ``checkpoint_steps="budget:<size>"``: keep the graphs of as many evaluations as fit in ``<size>``
  bytes (``"budget:512MiB"``), measured per evaluation, and recompute the others
  (:mod:`gradpatch.sampling.steps.budget`). Gradients equal the plain run's.
* ``checkpoint_steps="peak:<size>"``: keep the step's peak (the call's forward and the backward of a loss
  on its output) within ``<size>`` bytes, keeping the evaluations a plan learnt from earlier calls of the
  same shapes allows (:mod:`gradpatch.sampling.steps.peak`). Gradients equal the plain run's.

ODE samplers (F5-TTS, E2-TTS): :mod:`gradpatch.sampling.families.ode`.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, TypeVar

import torch
import torch.utils.checkpoint

from gradpatch.checkpointing.compat import sequence_nr
from gradpatch.sampling.options import SamplingOptions
from gradpatch.sampling.shadows import shadow
from gradpatch.sampling.steps import checkpoint as step_checkpoint, inputs as step_inputs
from gradpatch.sampling.steps.regions import Regions, tracking

T = TypeVar("T")


@dataclass
class SamplingRun:
    """One ``cache=False`` call in progress: its options, how many denoiser evaluations went through
    :func:`run_step` (a fix can check that its options took effect), and the scopes (attribute
    shadows) that hold while it is active, which a checkpoint recompute during backward re-enters."""

    options: SamplingOptions
    family: str = ""  # which family's entry started it (gradpatch.sampling.contract, rule 3)
    evaluations: int = 0
    joined: bool = False  # a sampler continued this call with its own run (contract, rule 3)
    parent: SamplingRun | None = field(default=None, repr=False)  # the call this one continues, if any
    family_state: Any = field(default=None, repr=False)  # what the family keeps for the call
    budget: Any = field(default=None, repr=False)  # checkpoint_steps="budget:<size>": a StepBudget
    peak: Any = field(default=None, repr=False)  # checkpoint_steps="peak:<size>": a steps.peak.StepPeak
    cut: bool = False  # grad_steps: grad is off from the first step until step N-K-1 ends
    fast: bool = True  # checkpoint_steps: evaluations try the fixed checkpoint's node (steps.checkpoint)
    tried: bool = False  # checkpoint_steps: an evaluation tried that node (the first holds its saves)
    keep: Callable[[torch.Tensor], Any] | None = None  # copy on write's hold, where the call has it (steps.inputs)
    known: dict = field(default_factory=dict, repr=False)  # steps.inputs: the submodules holding buffers
    scopes: list[Callable[[], ContextManager[Any]]] = field(default_factory=list, repr=False)

    window: Any = None  # grad_steps: the steps.window.Window between steps N-K-1 and N-K, while open
    regions: Any = field(default_factory=Regions, repr=False)  # grad_steps: enable_grad blocks

    def open_window(self, tainted: Any, caller: Any = None, since: int | None = None) -> None:
        from gradpatch.sampling.steps.window import Window

        self.regions.on_close = None
        self.window = Window(tainted, caller, since)
        self.window.__enter__()

    def close_window(self, starting: str | None = None) -> None:
        """Exit the window; ``starting``: step N-K starts (the window may refuse what it saw)."""
        if self.window is not None:
            window, self.window = self.window, None
            window.__exit__(None, None, None)
            try:
                if starting is not None:
                    window.check(starting)
            finally:
                window.close()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this run current and its scopes hold, for the duration of the block."""
        token = current.set(self)
        if self.parent is not None:
            self.parent.joined = True
        try:
            with contextlib.ExitStack() as stack:
                if self.options.grad_steps is not None:
                    stack.enter_context(tracking(self.regions))
                for scope in self.scopes:
                    stack.enter_context(scope())
                stack.callback(self.close_window)
                yield
        finally:
            current.reset(token)

    def recomputed(self, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
        """``fn(*args, **kwargs)`` recomputed in backward (:mod:`gradpatch.sampling.steps.checkpoint`);
        once an evaluation could not take the fixed checkpoint's node, the rest of the call go straight
        to the hook path."""
        out, self.fast = step_checkpoint.recomputed(fn, args, kwargs, self.fast, hold=not self.tried)
        self.tried = True
        return out

    def enter(self, stack: contextlib.ExitStack, scope: Callable[[], ContextManager[Any]]) -> None:
        """Enter ``scope`` now (on ``stack``) and on every later :meth:`active`."""
        self.scopes.append(scope)
        stack.enter_context(scope())


current: ContextVar[SamplingRun | None] = ContextVar("gradpatch_sampling", default=None)


def active_options() -> SamplingOptions | None:
    """The options of the ``cache=False`` call in progress in this context, if any."""
    run = current.get()
    return None if run is None else run.options


def _keep_mode(model: Any, real_eval: Callable[[], Any]) -> Callable[[], Any]:
    def eval() -> Any:  # noqa: A001 - stands in for Module.eval
        return model if current.get() is not None else real_eval()

    return eval


def _no_cache(forward: Callable[..., T]) -> Callable[..., T]:
    def call(*args: Any, **kwargs: Any) -> T:
        if "cache" in kwargs and current.get() is not None:
            kwargs["cache"] = False
        return forward(*args, **kwargs)

    return call


def _no_clear(clear: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: None if current.get() is not None else clear(*args, **kwargs)


@contextlib.contextmanager
def differentiable(model: object | None, options: SamplingOptions | SamplingRun) -> Iterator[SamplingRun]:
    """Grad on, ``model.eval()`` a no-op and ``options`` (or the run ``options``) active, for the
    duration of the block; ``model`` may be a list of models.

    Yields the :class:`SamplingRun`. The ``eval`` shadow is an instance attribute of each model only
    (submodules are untouched) and is removed on exit, also when the block raises.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError("cache=False records a graph, which torch.inference_mode() forbids; call the "
                           "sampler outside inference_mode (no_grad is fine: cache=False enables grad)")
    run = options if isinstance(options, SamplingRun) else SamplingRun(options)
    for each in model if isinstance(model, list) else [model]:
        if each is not None:
            run.scopes.append(functools.partial(shadow, each, "eval", functools.partial(_keep_mode, each)))
    with run.active(), torch.enable_grad():
        yield run


@contextlib.contextmanager
def text_cache_off(denoiser: object) -> Iterator[None]:
    """While a ``cache=False`` call is active, calls of ``denoiser`` that pass ``cache=`` get
    ``cache=False`` and ``denoiser.clear_cache()`` does nothing (nothing was cached, and F5 >= 1.1.20
    would otherwise create its lazy thread-local cache, which ``copy.deepcopy`` cannot copy).

    A cache reused across steps holds a tensor computed once, under the first step's graph; with
    gradients on it goes stale across backward calls, and a per-step checkpoint recompute reads it
    instead of computing it (``CheckpointError``). Denoisers that take no ``cache`` are unaffected.
    """
    run = current.get()
    if run is None or not isinstance(denoiser, torch.nn.Module):
        yield
        return
    with contextlib.ExitStack() as stack:
        run.enter(stack, functools.partial(shadow, denoiser, "forward", _no_cache))
        if callable(getattr(denoiser, "clear_cache", None)):
            run.enter(stack, functools.partial(shadow, denoiser, "clear_cache", _no_clear))
        yield


def recording() -> bool:
    """Whether this context records a graph: grad on, or off only because ``grad_steps`` cut the early
    steps (fixes that run their bodies only while grad is on must keep doing so in those steps)."""
    run = current.get()
    return torch.is_grad_enabled() or (run is not None and run.cut)


def run_step(step: int, total: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Evaluate the denoiser for step ``step`` (0-based) of ``total`` under the active options.

    Outside a ``cache=False`` call, or with grad disabled, this is ``fn(*args, **kwargs)``. A
    checkpointed evaluation is recomputed during backward, after the call returned: the recompute
    re-enters the run (:meth:`SamplingRun.active`), so it sees the same shadows (e.g. the backbone's
    cache still off) as the forward did.
    """
    run = current.get()
    if run is None or not (torch.is_grad_enabled() or run.cut):
        return fn(*args, **kwargs)
    counted: SamplingRun | None = run
    while counted is not None:  # a joined call's evaluations count for the calls it continues too
        counted.evaluations += 1
        counted = counted.parent
    options = run.options
    first = total - options.grad_steps if options.grad_steps is not None else 0
    if step < first:
        # Not recorded (module docstring; gradpatch.sampling.steps.window, after step N-K-1; steps.regions, guidance).
        run.close_window()
        guided, since = bool(run.regions.open), sequence_nr()
        if guided:
            run.regions.restore_on_exit(False)
        else:
            torch._C._set_grad_enabled(False)
        run.cut = True
        out = fn(*args, **kwargs)
        if step == first - 1:
            run.cut = False
            caller = sys._getframe(1)
            if guided:  # the window opens when the guidance's block exits, over what it computed since
                run.regions.restore_on_exit(True)
                run.regions.on_close = functools.partial(run.open_window, out, caller, since)
            else:
                torch._C._set_grad_enabled(True)
                run.open_window(out, caller)
        return out
    if run.regions.on_close is not None:  # step N-K inside the guidance's block that ran step N-K-1
        run.regions.on_close()
    if run.window is not None:
        args, kwargs = run.window.detached((args, kwargs))
        run.close_window(f"gradpatch (grad_steps={options.grad_steps}, step {step} of {total})")
    if run.cut:  # a step at or after N-K whose predecessor did not end the cut (steps skipped)
        torch._C._set_grad_enabled(True)
        run.cut = False
    if options.checkpoint_steps:
        as_was = step_inputs.AsWas(fn, args, kwargs, run.keep, run.known)  # recomputes see the inputs as they were

        def replay(*args: Any, **kwargs: Any) -> T:  # the recompute in backward runs outside the call
            if current.get() is run:
                return as_was(*args, **kwargs)
            with run.active():
                return as_was(*args, **kwargs)

        if options.step_budget is not None:
            from gradpatch.sampling.steps import budget as step_budget

            run.budget = run.budget or step_budget.StepBudget(options.step_budget)
            out = step_budget.evaluate(run.budget, replay, args, kwargs, run.recomputed)
        elif options.step_peak is not None:
            from gradpatch.sampling.steps import peak as step_peak

            state = run  # a joined call's evaluations belong to the call it continues
            while state.peak is None and state.parent is not None:
                state = state.parent
            if state.peak is None:  # not started by a sampler entry: recomputed (the smallest peak)
                state.peak = step_peak.StepPeak(options.step_peak, phase="unplanned")
            out = step_peak.evaluate(state.peak, replay, args, kwargs, run.recomputed, (step, total))
        else:
            out = run.recomputed(replay, args, kwargs)
        as_was.mark()
        return out
    return fn(*args, **kwargs)
