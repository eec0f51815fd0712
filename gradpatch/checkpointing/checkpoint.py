"""Fixed drop-in for the OpenAI/CompVis ``checkpoint(func, inputs, params, flag)`` family.

Upstream's ``CheckpointFunction`` (guided-diffusion, latent-diffusion, AudioLDM 1/2, sgm)
differentiates every input and parameter it is given, so frozen parameters raise "does not require
grad"; it breaks on ``None`` and integer inputs, misses tensors ``func`` reaches undeclared, replays
neither dropout RNG nor CPU autocast, drops second-order terms, runs parameter hooks twice, cannot
backward twice, runs ``func`` under ``no_grad`` in the forward but not in the recompute, and makes
every output require grad. Here gradients equal those of ``func(*inputs)`` without checkpointing,
by one of two paths per call.

**Fast path** (:mod:`gradpatch.checkpointing.recompute`; every upstream call in practice). ``func`` runs as
the caller would run it, building its graph; the graph tells which leaves the outputs depend on
(declared or not: closures, hooks, LoRA modules that are not children) and is then dropped. One
autograd node takes the input tensors and those leaves; backward replays CPU/CUDA RNG and autocast
state, recomputes, and differentiates what requires grad, returning parameter gradients as ordinary
node outputs (``autograd.grad``, ``backward(inputs=...)``, DDP and tensor hooks see each once).
Outputs follow autograd's rules: one that depends on nothing requiring grad does not require grad.
A recompute that builds another graph than the forward (another count of autograd nodes, other nodes
making the outputs: a cache the forward filled) raises in backward, as torch's checkpoint raises on
another count of saved tensors, rather than differentiate what ran the second time.
Under ``create_graph=True`` it recomputes from views of the saved inputs, keeping gradients
connected, and notes where the parameters live, so later passes (MAML's outer backward) recompute
with them even if fast weights were swapped into the modules since.

**Graph path** (``gradpatch.checkpointing.graph_path``): torch's non-reentrant checkpoint, for calls that
read a non-leaf tensor they were not given (fast weights under ``functional_call`` or swapped into
modules, DataParallel replicas, closure tensors computed beforehand), return an input or a view of
one (which the caller may modify in place), return something other than a tensor or a flat tuple,
return tensors sharing storage, or run under ``torch.compile``. Such a call is redone, RNG rewound,
and its function (per module and method, or per code object) goes straight to this path from then
on. Its recompute puts the forward's parameters back into the module first. Calls with modules
inside that a sharding engine manages (FSDP2 ``fully_shard``, FSDP1 ``FullyShardedDataParallel``,
DeepSpeed ZeRO-3 parameters) take this path from their first call, without that rebinding: the
engine's hooks must see the recompute inside the autograd graph, as they do with torch's checkpoint
(``gradpatch.checkpointing.sharding``). A block that is itself the engine's unit, or is wrapped
from outside (DDP, ZeRO-1/2), keeps the fast path.

Trade-off: the fast path does upstream's work plus the forward's graph, which a forward must build
for the block to see the grad mode and ``requires_grad`` flags its recompute sees; that graph is
what it costs over upstream (on one CPU thread, 5.5% of a training step of a tiny AudioLDM UNet and
3.7% of a medium one: docs/benchmarks.md; ``benchmarks/checkpoint_speed.py``). It saves the same activations plus the 5 KB CPU RNG state; the forward's graph saves nothing (its
saved-tensor hooks drop what it would save), so the step peaks as under torch's non-reentrant
checkpoint, reference cycles through module hooks or not, and under a caller's ``save_on_cpu`` the
node's inputs are what goes through it (``benchmarks/memory_truth.py``). Limits, as for upstream and
torch's checkpoints: a tensor leaving ``func`` other than by its return value raises if backward
reaches it; ``func`` must not modify its inputs in place; a redone call repeats side effects such as
BatchNorm statistics.
"""
from __future__ import annotations

import functools
import importlib
import types
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from gradpatch import settings
from gradpatch.checkpointing import paths
from gradpatch.checkpointing.compat import functorch_active
from gradpatch.checkpointing.paths import fast_path  # noqa: F401  (for gradpatch's sampler steps)
from gradpatch.checkpointing.recompute import ESCAPED  # noqa: F401  (what fast_path returns when it cannot serve)

__all__ = ["checkpoint", "CheckpointFunction", "mixed_checkpoint", "non_reentrant",
           "replace_checkpoint", "replace_checkpoint_function", "replace_mixed_checkpoint",
           "replace_torch_checkpoint"]

def checkpoint(func: Callable[..., Any], inputs: Sequence[Any], params: Iterable[Tensor] = (),
               flag: bool = True) -> Any:
    """Evaluate ``func(*inputs)``, keeping only its inputs and recomputing it during backward.

    Args:
        func: the function to run. It must compute the same thing when run again (RNG and
            autocast state are replayed; other global state is not).
        inputs: positional arguments of ``func``: tensors of any dtype, requiring grad or not,
            ``None`` and other objects. Gradients flow to the floating tensors that require grad.
        params: upstream's list of the tensors ``func`` uses without taking them as arguments
            (``module.parameters()``). Not needed and not iterated: the tensors that need
            gradients are read from ``func``'s graph, so undeclared ones (closures, hooks, LoRA
            modules that are not children) get theirs too and frozen ones get none.
        flag: the caller's wish to recompute. ``settings.checkpoint_policy``, read at each call,
            decides: ``"respect"`` recomputes iff ``flag``, ``"always"`` always, ``"never"`` never,
            ``"budget:<size>"`` and ``"peak:<size>"`` where ``flag`` and the plan of
            :mod:`gradpatch.checkpointing.budget` say so.

    Returns:
        What ``func`` returns. Without recomputation (policy, ``flag``, or grad mode off, as under
        ``torch.no_grad()``/``torch.inference_mode()``) this is ``func(*inputs)``, called once.
        Under a ``torch.func`` transform (``grad``, ``vjp``, ``vmap``, ``jacrev``, ``jvp``,
        ``hessian``; torch's own checkpoint refuses them) it is ``func(*inputs)`` too, so the
        transform's result is exact; the block's activations are then kept, as without checkpoint.
        Gradients, also through ``create_graph=True`` and a second backward after
        ``retain_graph=True``, equal those of ``func(*inputs)`` without checkpointing.
    """
    mode = settings.checkpoint_policy
    if mode == "never" or not (flag or mode == "always") or not torch.is_grad_enabled() \
            or functorch_active():
        return func(*inputs)
    if mode[0] in "bp":  # "budget:<size>", "peak:<size>"
        from gradpatch.checkpointing.budget import policy

        return policy.run(func, tuple(inputs), None, mode)
    return paths.run(func, tuple(inputs), None)


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
    mode = settings.checkpoint_policy
    if mode == "never" or not (flag or mode == "always") or not torch.is_grad_enabled() \
            or functorch_active():
        return func(**inputs)
    if mode[0] in "bp":  # "budget:<size>", "peak:<size>"
        from gradpatch.checkpointing.budget import policy

        return policy.run(func, (), dict(inputs), mode)
    return paths.run(func, (), dict(inputs))


def non_reentrant(torch_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch.utils.checkpoint.checkpoint`` so that ``use_reentrant`` defaults to ``False``.

    An explicit ``True``/``False`` is kept; missing or ``None`` (torch's "unspecified", which warns
    and means reentrant) becomes ``False``. Everything else, the decorator form included, passes
    through. Under a ``torch.func`` transform, which torch's checkpoint refuses ("don't yet support
    saved tensor hooks"), the function runs directly: the transform's exact result, without the
    memory saving. Each call returns a new wrapper; it pickles as ``non_reentrant(torch_checkpoint)``.
    """
    return _NonReentrant(torch_checkpoint)


# torch.utils.checkpoint.checkpoint's own keyword arguments (2.1 to 2.15): not passed to the function.
_TORCH_CHECKPOINT_OPTIONS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check",
                             "debug", "early_stop")


class _NonReentrant:
    """What :func:`non_reentrant` returns: a callable that pickles (a nested function would not)."""

    __wrapped__: Callable[..., Any]  # torch's checkpoint, set by functools.update_wrapper

    def __init__(self, torch_checkpoint: Callable[..., Any]) -> None:
        functools.update_wrapper(self, torch_checkpoint)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and functorch_active():  # torch's checkpoint refuses torch.func transforms
            for option in _TORCH_CHECKPOINT_OPTIONS:
                kwargs.pop(option, None)
            return args[0](*args[1:], **kwargs)
        if kwargs.get("use_reentrant") is None:
            kwargs["use_reentrant"] = False
        return self.__wrapped__(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return non_reentrant, (self.__wrapped__,)


# Engine factories: each takes the upstream object and returns a replacement of its own, since the
# engine reverts by identity. Copies of functions rather than wrappers: no extra frame per call.

def replace_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object equivalent to :func:`checkpoint`."""
    return _copy(checkpoint, original)


def replace_checkpoint_function(original: type) -> type:
    """A new subclass of :class:`CheckpointFunction`."""
    new = type("CheckpointFunction", (CheckpointFunction,), {"__module__": __name__})
    _name_as(new, original)
    return new


def replace_mixed_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object equivalent to :func:`mixed_checkpoint`."""
    return _copy(mixed_checkpoint, original)


def replace_torch_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`non_reentrant` of ``original``: torch's checkpoint bound without ``use_reentrant``."""
    return non_reentrant(original)


class _NonReentrantModule(types.ModuleType):
    """``torch.utils.checkpoint`` as seen through a module alias (``import torch.utils.checkpoint as
    ckpt``): ``checkpoint`` is :func:`non_reentrant`, every other name is the real module's."""

    def __init__(self, module: types.ModuleType) -> None:
        super().__init__(module.__name__, module.__doc__)
        self.__dict__["_module"] = module
        self.checkpoint = non_reentrant(module.checkpoint)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def replace_torch_checkpoint_module(original: types.ModuleType) -> types.ModuleType:
    """For a module that bound ``torch.utils.checkpoint`` itself under a name (CosyVoice's ``ckpt``,
    Chatterbox's ``cp``) and calls ``name.checkpoint(...)`` without ``use_reentrant``: a stand-in whose
    ``checkpoint`` is non-reentrant by default. Other modules, and torch, are unaffected."""
    return _NonReentrantModule(original)


def _copy(function: Callable[..., Any], original: Any) -> Callable[..., Any]:
    """A new function object running ``function``'s code, pickled by way of ``original``'s place."""
    new = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)
    new.__kwdefaults__ = function.__kwdefaults__
    functools.update_wrapper(new, function)
    _name_as(new, original)
    return new


def _name_as(new: Any, original: Any) -> None:
    """Name ``new`` so that pickle finds it where ``original`` is defined (see :data:`_upstream`)."""
    module, qualname = getattr(original, "__module__", None), getattr(original, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        new.__qualname__ = f"_upstream.{module.replace('.', ':')}.{qualname}"


class _Upstream:
    """Pickle's route to a replacement, which pickles by reference as upstream's object does:
    ``_upstream.<module, ':' for '.'>.<qualname>`` resolves to that module's attribute as it is
    now (the replacement while patched, upstream's object after ``revert()``; in a spawn worker,
    what that worker's ``GRADPATCH`` made of it). The replacement keeps this module as its
    ``__module__``, so it is never taken for upstream's code."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _ModuleRef(name.replace(":", "."))


class _ModuleRef:
    """A module, by name, that pickles: protocols below 4 pickle a dotted qualname as
    ``getattr(parent, last)`` and so pickle the parent, which a module object cannot be."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(self.__dict__["_name"]), name)

    def __reduce__(self) -> tuple:
        return _ModuleRef, (self._name,)


_upstream = _Upstream()
