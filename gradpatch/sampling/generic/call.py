"""The machinery behind :func:`gradpatch.differentiable` (documented there): one call of any sampler.

A ``cache=False`` call runs the original object, decorators and all, with, for its duration and in
its context only: the sampler's grad-off constructs inert (:mod:`gradpatch.sampling.generic.gradoff`), in-place
writes copy-on-write (:mod:`gradpatch.sampling.generic.copy_on_write`), the ``step`` routed through
:func:`~gradpatch.sampling.run.run_step` (counted: call ``i`` is step ``i``) and the train/eval flags
of the modules involved put back on exit. A generator is resumed the same way each time, and the
caller's grad mode holds at every ``yield``; so is an ``async def`` sampler's coroutine
(:mod:`gradpatch.sampling._coroutine`). Callables passed in as arguments are the caller's code: their
grad-off constructs are honoured. Inference tensors in what it returns or yields are cloned
into normal ones. If gradients could flow (grad on, something requires grad) but nothing returned
carries a graph, it raises :class:`~gradpatch.errors.NotDifferentiableError` instead of returning it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from typing import Any, Callable, Iterator

import torch

from gradpatch.errors import NotDifferentiableError
from gradpatch.sampling.generic import gradoff
from gradpatch.sampling.generic.copy_on_write import CopyOnWrite
from gradpatch.sampling.generic.coroutine import awaited
from gradpatch.sampling.generic.unwatched import Unwatched
from gradpatch.sampling.run import SamplingRun, current, run_step
from gradpatch.sampling.shadows import shadow
from gradpatch.sampling.steps.odeint import stepped_odeint
from gradpatch.sampling.values import clean, codes, cut_by_callbacks, describe, overriding_classes, tensors, user_codes

FAMILY = "generic"
# A step whose first recorded evaluations make copy on write do nothing (no copy kept: nothing saved was
# written) runs its later ones unwatched (gradpatch.sampling.generic.unwatched). Two: a buffer refill
# into what the previous evaluation saved shows in the second one.
WATCHED_EVALUATIONS = 2


def _start(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:  # the boundary of a call
    return fn(*args, **kwargs)


def _resume(gen: Any, how: str, value: Any) -> Any:  # the boundary of a generator's resumption
    return getattr(gen, how)(value) if how != "throw" else gen.throw(value)


gradoff.BOUNDARY.update({_start.__code__, _resume.__code__, *(  # and a checkpoint's recompute
    c for c in run_step.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "replay")})


class Sampler:
    """What :func:`gradpatch.differentiable` was told: the function, ``step`` and ``steps``."""

    def __init__(self, fn: Callable[..., Any], step: Any, steps: Any, where: str) -> None:
        self.fn, self.step, self.steps, self.where = fn, step, steps, where
        self.user = False  # the callable form: without step=, grad_steps/checkpoint_steps may be left to a
        # catalogued sampler the call reaches (gradpatch.sampling.contract, rule 3)
        self.codes = codes(fn)
        self.signature: inspect.Signature | None
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None

    def _lookup(self, name: str, bound: inspect.BoundArguments | None, owner: Any) -> Any:
        head, *rest = name.split(".")
        if bound is not None and head in self.signature.parameters:  # type: ignore[union-attr]
            bound.apply_defaults()
            value = bound.arguments[head]
        elif head == "self" and owner is not None:
            value = owner
        elif owner is not None and hasattr(owner, head):
            value = getattr(owner, head)
        elif head in vars(sys.modules.get(getattr(self.fn, "__module__", None) or "") or types.SimpleNamespace()):
            value = vars(sys.modules[self.fn.__module__])[head]  # a global of the sampler's module (odeint)
        else:
            raise NotDifferentiableError(f"gradpatch.differentiable({self.where}): {name!r} is neither an argument "
                                         "of the sampler, an attribute of its object nor a global of its module")
        for part in rest:
            value = getattr(value, part)
        return value

    def total(self, bound: inspect.BoundArguments | None, owner: Any) -> int:
        steps = self.steps(bound.arguments if bound else {}) if callable(self.steps) else \
            self._lookup(self.steps, bound, owner)
        return int(steps)

    def ode(self) -> bool:
        """Whether ``step`` is torchdiffeq's ``odeint`` as the sampler's module names it: then the solver
        numbers the steps (:func:`~gradpatch.sampling.families.ode.stepped_odeint`) and ``t`` gives N."""
        module = sys.modules.get(getattr(self.fn, "__module__", None) or "")
        step = vars(module).get(self.step) if isinstance(self.step, str) and module is not None else self.step
        return str(getattr(step, "__module__", "")).startswith("torchdiffeq") and callable(step)

    def target(self, bound: inspect.BoundArguments | None, owner: Any) -> tuple[Any, str]:
        """``(object, attribute)`` to shadow so that every call of the step goes through gradpatch."""
        step = self._lookup(self.step, bound, owner) if isinstance(self.step, str) else self.step
        if isinstance(step, torch.nn.Module):
            return step, "forward"
        if inspect.ismethod(step):
            return step.__self__, step.__name__
        module = sys.modules.get(getattr(self.fn, "__module__", None) or "")
        for name, value in vars(module or types.SimpleNamespace()).items():
            if value is step:
                return module, name
        raise NotDifferentiableError(f"gradpatch.differentiable({self.where}): step={self.step!r} must be a "
                                     "module, a bound method, or a function the sampler's module names")


class _Run:
    """The step count of one call, and its copy-on-write state."""

    def __init__(self, sampler: Sampler, total: int | None, first: int, cow: CopyOnWrite) -> None:
        self.sampler, self.total, self.cow, self.count, self.inside = sampler, total, cow, 0, False
        self.first = first  # the first recorded step (grad_steps)
        self.live: Any = None  # the call's gradoff.Call
        # Recorded evaluations of the step still to run watched by copy on write before they run without it
        # (gradpatch.sampling.generic.unwatched); None once copy on write acted inside one: watched for good.
        self.watch_left: int | None = WATCHED_EVALUATIONS

    def step(self, real: Callable[..., Any], args: tuple, kwargs: dict, recomputed: Any) -> Any:
        index, self.count = self.count, self.count + 1
        if self.total is not None and index >= self.total:
            raise RuntimeError(f"gradpatch.differentiable({self.sampler.where}): grad_steps: step was called "
                               f"more than the {self.total} times steps says; step must be what one sampler step "
                               "calls once (pass the method one step calls, or use checkpoint_steps)")
        fn = self._as_was(real, args, kwargs) if recomputed else real  # else evaluated once, now
        self.inside = True
        try:
            if self.watch_left == 0:
                with Unwatched(self.cow, hooks=not recomputed and not self.cow.acted):
                    return clean(run_step(index, self.total or 0, fn, *args, **kwargs))  # clean: no mode to ask
            else:
                recorded, acted = torch.is_grad_enabled() and index >= self.first, self.cow.acted
                out = run_step(index, self.total or 0, fn, *args, **kwargs)
                if self.watch_left is not None and recorded and torch.is_grad_enabled():
                    self.watch_left = None if self.cow.acted != acted else self.watch_left - 1
            return clean(out)
        finally:
            self.inside = False

    def _as_was(self, real: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[..., Any]:
        """``real`` on the inputs as they are now, also in a checkpoint recompute (checkpoint_steps)."""
        with torch._C.DisableTorchFunction():  # gradpatch's own reads, not the sampler's torch calls
            held = {id(a): (self.cow.hold(a), a.requires_grad) for a in (*args, *kwargs.values())
                    if isinstance(a, torch.Tensor)}

        def was(x: Any) -> Any:  # an input as it was, requires_grad included (a buffer refilled later may
            if id(x) not in held:  # have gained it), or the recompute saves other tensors (CheckpointError)
                return x
            saved, requires_grad = held[id(x)]
            value = saved.value()
            return value if value is x and x.requires_grad == requires_grad else \
                value.detach().requires_grad_(requires_grad)

        def evaluate(*a: Any, **k: Any) -> Any:  # in a checkpoint recompute: the inputs as they were
            return real(*(was(x) for x in a), **{n: was(x) for n, x in k.items()})

        return evaluate


def _stepped(real: Callable[..., Any]) -> Callable[..., Any]:
    """The step's stand-in: each call in a call's context (not nested in a step, nor in a sampler that
    joined the call and counts its own steps) is one step."""

    def step(*args: Any, **kwargs: Any) -> Any:
        state = current.get()
        run = state.family_state if state is not None and state.family == FAMILY else None
        if state is None or run is None or run.inside:
            return real(*args, **kwargs)  # elsewhere, or inside a step (CFG calling forward twice)
        return run.step(real, args, kwargs, state.options.checkpoint_steps)

    return step


@contextlib.contextmanager
def _modes_kept(objects: list[Any]) -> Iterator[None]:
    modules = {id(m): m for o in objects if isinstance(o, torch.nn.Module) for m in o.modules()}
    flags = [(m, m.training) for m in modules.values()]
    try:
        yield
    finally:
        for module, flag in flags:
            if module.training is not flag:
                module.training = flag
        for root in {id(o): o for o in objects if isinstance(o, torch.nn.Module)}.values():
            _new_children_follow(root, modules)


def _new_children_follow(parent: Any, known: dict[int, Any]) -> None:
    """A module the call attached to the caller's tree (imagen rebuilds ``self.unets`` each call) takes
    its parent's mode, as the caller's ``train()``/``eval()`` would have given it: the sampler's own
    ``train()`` calls were no-ops during the call."""
    for child in parent.children():
        if id(child) not in known:
            child.training = parent.training
        _new_children_follow(child, known)


def call(sampler: Sampler, original: Callable[..., Any], args: tuple, kwargs: dict, owner: Any,
         state: SamplingRun) -> Any:
    """One ``cache=False`` call of ``original(*args, **kwargs)`` under ``state`` (module docstring)."""
    options = state.options
    where = sampler.where
    # Without step=, only a catalogued sampler joining the call (contract, rule 3) can apply the options:
    # checked when the call returns.
    unrouted = (options.grad_steps is not None or options.checkpoint_steps) and sampler.step is None
    if unrouted and not sampler.user:  # a catalogued sampler declares its step (imagen: options per stage)
        raise ValueError(f"gradpatch.differentiable({where}): grad_steps and checkpoint_steps need step=, what one "
                         "sampler step calls (a module, a method, or the name of an attribute or argument)")
    ode = sampler.step is not None and sampler.ode()
    if options.grad_steps is not None and sampler.steps is None and not ode and not unrouted:
        raise ValueError(f"gradpatch.differentiable({where}): grad_steps needs steps=, the argument holding the "
                         "number of steps")
    bound = None
    if sampler.signature is not None and (sampler.step is not None or sampler.steps is not None):
        bound = sampler.signature.bind(*args, **kwargs)
    total = sampler.total(bound, owner) if options.grad_steps is not None and not ode and not unrouted else None
    cow = CopyOnWrite()
    first = total - options.grad_steps if total is not None and options.grad_steps is not None else 0
    run = _Run(sampler, total, first, cow)
    state.family_state = run
    live = gradoff.Call(where, sampler.codes, user_codes([list(args), kwargs], owner) - sampler.codes,
                        overriding_classes([owner, sampler.step, list(args), kwargs]))
    run.live = live
    state.scopes.append(functools.partial(gradoff.active, live))
    grad = torch.is_grad_enabled()
    wanted = grad and any(t.requires_grad for t in tensors([owner, sampler.step, list(args), kwargs]))

    target = sampler.target(bound, owner) if sampler.step is not None else None

    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if target is not None:  # the step's shadow, only while the sampler runs (not between a generator's items)
                stack.enter_context(shadow(*target, stepped_odeint if ode else _stepped))
            stack.enter_context(state.active())
            # Off under torch.func.grad and disable_saved_tensors_hooks: no copy on write (torch's check).
            if torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]  # (C binding)
                stack.enter_context(cow.hooks())
            stack.enter_context(cow)
            stack.enter_context(torch.set_grad_enabled(grad))  # puts the caller's mode back (grad_steps cuts)
            yield

    def finish(out: Any) -> Any:
        if unrouted and not state.joined:
            raise ValueError(f"gradpatch.differentiable({where}): grad_steps and checkpoint_steps need step=, what "
                             "one sampler step calls (a module, a method, or the name of an attribute or argument), "
                             "unless the call reaches a catalogued sampler, which applies them to its own steps")
        if total is not None and run.count != total and not state.joined:
            raise RuntimeError(f"gradpatch.differentiable({where}): grad_steps: step was called {run.count} times, "
                               f"but steps says {total}; the last K steps cannot be told apart. Pass as step what "
                               "one sampler step calls once, or use checkpoint_steps")
        if options.checkpoint_steps and state.evaluations == 0 and not unrouted:
            raise RuntimeError(f"gradpatch.differentiable({where}): checkpoint_steps had no effect: step was never "
                               "called")
        if ode and options.grad_steps is not None and state.evaluations == 0:
            raise RuntimeError(f"gradpatch.differentiable({where}): grad_steps had no effect: the sampler never "
                               f"called the solver through its module's global {sampler.step!r} (it calls "
                               "torchdiffeq.odeint by attribute, or another solver), so no step could be cut. Pass as "
                               "step what it calls")
        if wanted and not any(t.requires_grad for t in tensors(out)):
            if live.honoured:
                raise NotDifferentiableError(cut_by_callbacks(where, out, live.honoured))
            raise NotDifferentiableError(f"gradpatch.differentiable({where}) returned {describe(out)}; gradients "
                                         "cannot flow through it. Return the tensor itself (convert it afterwards)")
        return clean(out)

    with contextlib.ExitStack() as stack:
        stack.enter_context(_modes_kept([owner, sampler.step if not isinstance(sampler.step, str) else None]))
        with entered():
            out = _start(original, args, kwargs)
        if inspect.isgenerator(out):
            return _generator(out, entered, stack.pop_all())
        if inspect.iscoroutine(out):  # an async def sampler: each resumption inside the call's context
            return awaited(out, entered, stack.pop_all(), finish)

    return finish(out)


def _generator(gen: Any, entered: Callable[[], Any], stack: contextlib.ExitStack) -> Iterator[Any]:
    with stack:
        how, value = "send", None
        while True:
            try:
                with entered():
                    item = _resume(gen, how, value)
            except StopIteration as stop:
                return stop.value
            try:
                how, value = "send", (yield clean(item))  # the caller's grad mode holds here
            except GeneratorExit:
                gen.close()
                raise
            except BaseException as error:  # noqa: BLE001 - passed on to the sampler, as torch's wrapper does
                how, value = "throw", error
