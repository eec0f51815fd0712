"""Fixed drop-in for the OpenAI/CompVis ``checkpoint(func, inputs, params, flag)`` family.

Upstream's ``CheckpointFunction`` (guided-diffusion, latent-diffusion, AudioLDM 1/2, sgm)
differentiates every input and parameter it is given, so frozen parameters raise "does not require
grad"; it breaks on ``None`` and integer inputs, misses tensors ``func`` reaches undeclared, replays
neither dropout RNG nor CPU autocast, drops second-order terms, runs parameter hooks twice and
cannot backward twice. Here gradients equal those of ``func(*inputs)`` without checkpointing, by one
of two paths per call.

**Fast path** (``_Recompute``; every upstream call in practice). ``func`` runs once without building
a graph, as upstream does under ``no_grad``, but in grad mode with the inputs detached and the
declared trainable parameters set to ``requires_grad=False`` meanwhile: an output that still
requires grad means ``func`` read a differentiable tensor it did not declare (closure, hook, LoRA
module that is not a child), and the call is redone, RNG rewound, on the graph path. Otherwise one
autograd node takes the input tensors and trainable parameters; backward replays CPU/CUDA RNG and
autocast state, recomputes, and differentiates what requires grad, returning parameter gradients as
ordinary node outputs (``autograd.grad``, ``backward(inputs=...)``, DDP and tensor hooks see each
once). Under ``create_graph=True`` it recomputes from views of the saved inputs, keeping gradients
connected, and notes where the parameters live, so later passes (MAML's outer backward) recompute
with them even if fast weights were swapped into the modules since. What a module's method declared
is remembered, as iterating ``module.parameters()`` costs as much as all other bookkeeping; a stale
list is harmless, since the probe catches any trainable tensor it misses and the call is redone with
the caller's.

**Graph path**: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, for undeclared tensors
(remembered per module and function), outputs other than a tensor or flat tuple, under
``torch.compile``, and for declared non-leaf parameters (fast weights under ``functional_call``,
DataParallel replicas), which are often in the module only during the forward: the recompute then
puts the forward's parameters back into the module first. This path builds the graph in the forward
and runs Python saved-tensor hooks: about 15% slower than upstream on a small UNet on CPU.

Trade-off: the fast path does upstream's work (a graph-free forward, a recompute, an inner
``autograd.grad``), saves the same activations plus the 5 KB CPU RNG state, and pays its bookkeeping
with what upstream wastes (the parameter generator, ``autograd.grad``'s argument checks, view
nodes): a training step of the tiny AudioLDM UNet on one CPU thread measured 0.996 +- 0.004 of
upstream's time (``benchmarks/checkpoint_speed.py``). Limits, as for upstream and torch's reentrant
checkpoint: tensors leaving ``func`` other than by its return value carry no gradient; every
floating output counts as differentiable; ``func`` must not modify its inputs in place. For
undeclared tensors the graph path recomputes with what modules hold at backward time; a redone call
repeats side effects such as BatchNorm statistics; ``requires_grad`` flags flip while ``func`` runs,
which another thread using the same parameters at that moment would see.
"""
from __future__ import annotations

import contextlib
import functools
import types
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor
from torch.overrides import has_torch_function
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from gradpatch import settings

try:  # private, but what torch.autograd.grad calls once its arguments are checked; self-tested
    from torch.autograd.graph import _engine_run_backward as _engine_grad

    _w = torch.ones(1, requires_grad=True)
    if _engine_grad((_w * 3.0,), (torch.ones(1),), False, False, (_w,), True, False)[0].item() != 3:
        raise ImportError("unexpected result")
    del _w
except Exception:  # pragma: no cover - another torch: use the public function
    _engine_grad = None

__all__ = ["checkpoint", "CheckpointFunction", "mixed_checkpoint", "non_reentrant",
           "replace_checkpoint", "replace_checkpoint_function", "replace_mixed_checkpoint",
           "replace_torch_checkpoint"]

_PLAIN = (Tensor, type(None), bool, int, float, str)  # what a fast-path output tuple may hold
_MISSING, _ESCAPED = object(), object()
# owner -> {function: _ESCAPED (graph path), the tensors declared at its last call, or None (they
# vary: use the caller's)}; see _cache_key.
_KNOWN: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def checkpoint(func: Callable[..., Any], inputs: Sequence[Any], params: Iterable[Tensor] = (),
               flag: bool = True) -> Any:
    """Evaluate ``func(*inputs)``, keeping only its inputs and recomputing it during backward.

    Args:
        func: the function to run. It must compute the same thing when run again (RNG and
            autocast state are replayed; other global state is not).
        inputs: positional arguments of ``func``: tensors of any dtype, requiring grad or not,
            ``None`` and other objects. Gradients flow to the floating tensors that require grad.
        params: tensors ``func`` uses without taking them as arguments (upstream passes
            ``module.parameters()``; a generator is fine). Frozen ones are skipped; undeclared
            ones (closures, hooks) are detected and receive gradients too.
        flag: the caller's wish to recompute. ``settings.checkpoint_policy``, read at each call,
            decides: ``"respect"`` recomputes iff ``flag``, ``"always"`` always, ``"never"`` never,
            ``"budget:<size>"`` where ``flag`` and the plan of
            :mod:`gradpatch.fixes.checkpoint_budget` say so.

    Returns:
        What ``func`` returns. Without recomputation (policy, ``flag``, or grad mode off, as under
        ``torch.no_grad()``/``torch.inference_mode()``) this is ``func(*inputs)``, called once.
        Gradients, also through ``create_graph=True`` and a second backward after
        ``retain_graph=True``, equal those of ``func(*inputs)`` without checkpointing.
    """
    policy = settings.checkpoint_policy
    if policy == "never" or not (flag or policy == "always") or not torch.is_grad_enabled():
        return func(*inputs)
    if policy[0] == "b":  # "budget:<size>"
        from gradpatch.fixes import checkpoint_budget

        return checkpoint_budget.run(func, tuple(inputs), None, params, policy)
    return _checkpoint(func, tuple(inputs), None, params)


class CheckpointFunction:
    """Stand-in for upstream's class, which upstream's ``checkpoint`` looks up in its module globals
    at each call: ``CheckpointFunction.apply(func, length, *args)`` is
    ``checkpoint(func, args[:length], args[length:], flag=True)`` (the policy still applies)."""

    @staticmethod
    def apply(run_function: Callable[..., Any], length: int, *args: Any) -> Any:
        return checkpoint(run_function, args[:length], args[length:], True)


def mixed_checkpoint(func: Callable[..., Any], inputs: Mapping[str, Any],
                     params: Iterable[Tensor], flag: bool) -> Any:
    """sgm's ``mixed_checkpoint``: :func:`checkpoint` calling ``func(**inputs)``; non-tensor values
    are passed through unchanged."""
    policy = settings.checkpoint_policy
    if policy == "never" or not (flag or policy == "always") or not torch.is_grad_enabled():
        return func(**inputs)
    if policy[0] == "b":  # "budget:<size>"
        from gradpatch.fixes import checkpoint_budget

        return checkpoint_budget.run(func, (), dict(inputs), params, policy)
    return _checkpoint(func, (), dict(inputs), params)


def non_reentrant(torch_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch.utils.checkpoint.checkpoint`` so that ``use_reentrant`` defaults to ``False``.

    An explicit ``True``/``False`` is kept; missing or ``None`` (torch's "unspecified", which warns
    and means reentrant) becomes ``False``. Everything else, the decorator form included, passes
    through. Each call returns a new wrapper.
    """
    @functools.wraps(torch_checkpoint)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_reentrant") is None:
            kwargs["use_reentrant"] = False
        return torch_checkpoint(*args, **kwargs)

    return wrapper


# Engine factories: each takes the upstream object and returns a replacement of its own, since the
# engine reverts by identity. Copies of functions rather than wrappers: no extra frame per call.

def replace_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object equivalent to :func:`checkpoint`."""
    return _copy(checkpoint)


def replace_checkpoint_function(original: type) -> type:
    """A new subclass of :class:`CheckpointFunction`."""
    return type("CheckpointFunction", (CheckpointFunction,), {"__module__": __name__})


def replace_mixed_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object equivalent to :func:`mixed_checkpoint`."""
    return _copy(mixed_checkpoint)


def replace_torch_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`non_reentrant` of ``original``: torch's checkpoint bound without ``use_reentrant``."""
    return non_reentrant(original)


def _copy(function: Callable[..., Any]) -> Callable[..., Any]:
    new = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)
    new.__kwdefaults__ = function.__kwdefaults__
    return functools.update_wrapper(new, function)


def _checkpoint(func: Callable[..., Any], args: tuple, kwargs: dict | None,
                params: Iterable[Tensor]) -> Any:
    if torch.compiler.is_compiling():
        return _graph_path(func, args, kwargs)
    owner, tag = _cache_key(func)
    try:
        known = _KNOWN.get(owner, {}).get(tag, _MISSING)
    except TypeError:  # not weak-referenceable: nothing is remembered
        known = None
    if known is _ESCAPED:
        return _graph_path(func, args, kwargs)
    if type(known) is tuple:  # declared at the last call: leaves, no duplicates; maybe stale
        out = _attempt(func, args, kwargs, known, checked=True)
        if out is _ESCAPED:
            fresh = tuple({id(p): p for p in params}.values())
            if len(fresh) != len(known) or any(a is not b for a, b in zip(fresh, known)):
                _remember(owner, tag, None)  # the declared tensors change: ask the caller
                out = _attempt(func, args, kwargs, fresh)
    else:
        params = tuple({id(p): p for p in params}.values())  # without duplicates
        out = _attempt(func, args, kwargs, params)
        if known is _MISSING and tag is not None and out is not _ESCAPED:
            _remember(owner, tag, params if all(p.grad_fn is None for p in params) else None)
    if out is _ESCAPED:
        _remember(owner, tag, _ESCAPED)
        return _graph_path(func, args, kwargs)
    return out


def _graph_path(func: Callable[..., Any], args: tuple, kwargs: dict | None) -> Any:
    return _torch_checkpoint(func, *args, use_reentrant=False, **(kwargs or {}))


def _attempt(func: Callable[..., Any], args: tuple, kwargs: dict | None, params: tuple,
             checked: bool = False) -> Any:
    """The fast path (the graph path for non-leaf parameters, unless ``checked`` says all are
    leaves); ``_ESCAPED``, RNG rewound, if ``func`` read undeclared differentiable tensors or
    returned what an autograd Function cannot."""
    hidden = [p for p in params if p.requires_grad]
    if not checked and any(p.grad_fn is not None for p in hidden):
        return _graph_path(_rebinding(func), args, kwargs)
    values = list(args) if kwargs is None else [*args, *kwargs.values()]
    try:
        for p in hidden:
            p.requires_grad = False
        state = _State(func, values, len(args), kwargs, hidden)
        probe = list(values)
        for i in state.diff:
            probe[i] = values[i].detach()
        out = state.call(probe)
    finally:
        for p in hidden:
            p.requires_grad = True
    if isinstance(out, Tensor):
        escaped = out.requires_grad
    elif type(out) is tuple and all(isinstance(o, _PLAIN) for o in out):
        escaped = any(isinstance(o, Tensor) and o.requires_grad for o in out)
    else:
        escaped = True
    if escaped:
        state.rewind_rng()
        return _ESCAPED
    if not state.diff and not hidden:
        return out
    state.out = out
    return _Recompute.apply(state, *[values[i] for i in state.slots], *hidden)


def _rebinding(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func``, made to run with the parameters its module holds now. Non-leaf parameters (fast
    weights under ``functional_call``, DataParallel replicas) are often in the module only during
    the forward; the graph path's recompute, run later, would otherwise read other ones."""
    owner = getattr(func, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        return func
    where = [(m, n, t) for m in owner.modules() for n, t in m._parameters.items()]

    def run(*args: Any, **kwargs: Any) -> Any:
        with _parameters_as(where):
            return func(*args, **kwargs)

    return run


@contextlib.contextmanager
def _parameters_as(where: list[tuple[torch.nn.Module, str, Tensor]]) -> Iterator[None]:
    """Put these tensors back as these modules' parameters for the duration."""
    swapped = [(m, n, t, m._parameters.get(n)) for m, n, t in where
               if m._parameters.get(n) is not t]
    for m, n, t, _ in swapped:
        m._parameters[n] = t
    try:
        yield
    finally:
        for m, n, _, before in swapped:
            m._parameters[n] = before


def _cache_key(func: Callable[..., Any]) -> tuple[Any, Any]:
    """(module, function) for methods of modules (upstream's ``self._forward``); otherwise (code or
    callable, None): closures of one code may differ, so only their escapes are remembered."""
    owner = getattr(func, "__self__", None)
    if isinstance(owner, torch.nn.Module) and hasattr(func, "__func__"):
        return owner, func.__func__
    return getattr(func, "__code__", func), None


def _remember(owner: Any, tag: Any, value: Any) -> None:
    with contextlib.suppress(TypeError):
        _KNOWN.setdefault(owner, {})[tag] = value


class _State:
    """What the fast path's backward needs besides the saved tensors."""

    __slots__ = ("func", "n_args", "keys", "params", "template", "slots", "diff", "out", "bound",
                 "cpu_rng", "cuda_rng", "autocast")

    def __init__(self, func: Callable[..., Any], values: list, n_args: int, kwargs: dict | None,
                 params: list[Tensor]) -> None:
        self.func, self.n_args, self.params = func, n_args, params
        self.keys = None if kwargs is None else list(kwargs)
        self.template = list(values)  # the non-tensor arguments; tensors are saved for backward
        self.slots: list[int] = []  # positions of tensors
        self.diff: list[int] = []  # positions of tensors that require grad
        for i, v in enumerate(values):
            if isinstance(v, Tensor):
                self.template[i] = None
                self.slots.append(i)
                if v.requires_grad:
                    self.diff.append(i)
        self.out: Any = None  # handed to _Recompute.forward, then dropped: no reference cycle
        self.bound: list[tuple[torch.nn.Module, str, Tensor]] | None = None  # see rebuild
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng: list[tuple[int, Tensor]] = []
        if torch.cuda.is_initialized():  # never initialise CUDA just to read its RNG
            devices = {t.get_device() for t in (*values, *params)
                       if isinstance(t, Tensor) and t.is_cuda}
            self.cuda_rng = [(d, torch.cuda.get_rng_state(d)) for d in sorted(devices)]
        self.autocast = [(d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
                         for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]

    def call(self, values: list) -> Any:
        if self.keys is None:
            return self.func(*values)
        n = self.n_args
        return self.func(*values[:n], **dict(zip(self.keys, values[n:])))

    def rewind_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        for device, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, device)

    def rebuild(self, saved: tuple, create_graph: bool) -> tuple[tuple, list[Tensor]]:
        """Recompute ``func``; return its outputs and the tensors to differentiate them by."""
        if create_graph and self.bound is None:
            # Double backward reaches this node again (through the next checkpoint's inputs), maybe
            # after MAML swapped fast weights into the modules: note where the parameters live now
            # for later recomputes to restore them. Only in this mode, as it walks the modules.
            owner, ids = getattr(self.func, "__self__", None), {id(p) for p in self.params}
            self.bound = [(m, n, t) for m in owner.modules() for n, t in m._parameters.items()
                          if id(t) in ids] if isinstance(owner, torch.nn.Module) else []
        values = list(self.template)
        for i, t in zip(self.slots, saved):
            values[i] = t
        targets: list[Tensor] = []
        for i in self.diff:
            # A view keeps the link to the original input, needed for higher-order gradients,
            # and hides its hooks from the inner autograd.grad; a detached leaf is cheaper.
            t = values[i]
            values[i] = t.view_as(t) if create_graph else t.detach().requires_grad_()
            targets.append(values[i])
        out = self.recompute(values)
        return (out if isinstance(out, tuple) else (out,)), targets + self.params

    def recompute(self, values: list) -> Any:
        """Run ``func`` as in the forward: its RNG, autocast state and parameters; grad mode on."""
        cpu_now = torch.get_rng_state()
        cuda_now = [(d, torch.cuda.get_rng_state(d)) for d, _ in self.cuda_rng]
        self.rewind_rng()
        contexts: list[Any] = []  # autocast contexts, only where the state differs
        if self.autocast or torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
            on = {d for d, _, _ in self.autocast}
            contexts = [torch.autocast(d, enabled=False) for d in ("cpu", "cuda")
                        if d not in on and torch.is_autocast_enabled(d)]
            contexts += [torch.autocast(d, dtype=dtype, cache_enabled=cache)
                         for d, dtype, cache in self.autocast
                         if not (torch.is_autocast_enabled(d)
                                 and torch.get_autocast_dtype(d) == dtype)]
        if self.bound:
            contexts.append(_parameters_as(self.bound))
        try:
            with torch.enable_grad():
                if not contexts:
                    return self.call(values)
                with contextlib.ExitStack() as stack:
                    for context in contexts:
                        stack.enter_context(context)
                    return self.call(values)
        finally:
            torch.set_rng_state(cpu_now)
            for device, state in cuda_now:
                torch.cuda.set_rng_state(state, device)


def _grad(outputs: tuple, inputs: tuple, grad_outputs: tuple, create_graph: bool) -> tuple:
    """``torch.autograd.grad(..., allow_unused=True)`` minus its Python argument checks (30 us a
    call on CPU): these arguments come from autograd itself. ``__torch_function__`` subclasses, and
    a torch whose private entry point fails the self-test at import, take the public function."""
    if _engine_grad is not None and not has_torch_function((*outputs, *inputs, *grad_outputs)):
        return _engine_grad(outputs, grad_outputs, create_graph, create_graph, inputs, True, False)
    return torch.autograd.grad(outputs, inputs, grad_outputs, create_graph=create_graph,
                               allow_unused=True)


class _Recompute(torch.autograd.Function):
    """The fast path's node. Inputs: ``func``'s input tensors, then its trainable parameters."""

    @staticmethod
    def forward(ctx: Any, state: _State, *tensors: Tensor) -> Any:
        ctx.set_materialize_grads(False)
        ctx.state = state
        ctx.save_for_backward(*tensors[: len(state.slots)])  # freed by backward, version-checked
        out, state.out = state.out, None
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        state: _State = ctx.state
        create_graph = torch.is_grad_enabled()  # backward(create_graph=True), double backward
        outs, targets = state.rebuild(ctx.saved_tensors, create_graph)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if g is not None and isinstance(o, Tensor) and o.requires_grad]
        found: Sequence[Tensor | None] = [None] * len(targets)
        if pairs:
            # Tensor hooks of parameters would run in this inner autograd.grad and again on the
            # gradient this node returns (upstream does that): suspend them here.
            hooked = [(h, dict(h)) for p in state.params if (h := p._backward_hooks)]
            for h, _ in hooked:
                h.clear()
            try:
                found = _grad(tuple(o for o, _ in pairs), tuple(targets),
                              tuple(g for _, g in pairs), create_graph)
            finally:
                for h, saved in hooked:
                    h.update(saved)
        input_grads: list[Tensor | None] = [None] * len(state.slots)
        for i, g in zip(state.diff, found):
            input_grads[state.slots.index(i)] = g
        return (None, *input_grads, *found[len(state.diff):])
