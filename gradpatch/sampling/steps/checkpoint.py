"""The recompute of one sampler step's denoiser evaluation (``checkpoint_steps``).

Each evaluation goes through the fixed checkpoint's node (:func:`gradpatch.checkpointing.checkpoint.fast_path`):
the forward builds the evaluation's graph, walks it once for the leaves it depends on (parameters,
closed-over leaves) and drops it; one autograd node holds the inputs, and its backward recomputes the
evaluation under the forward's RNG (CPU, and the CUDA devices of the inputs) and autocast state and
differentiates it. What the forward saves is dropped as it is saved (a pack hook from C: no Python frame
per tensor), so the evaluation's activations are freed when it returns even where a reference cycle (module
hooks) keeps the dropped graph's nodes; the node's inputs, which it keeps, go through the caller's
saved-tensor hooks (``save_on_cpu``). The call's first evaluation holds its saves aside instead (one
Python call per saved tensor: ``gradpatch.checkpointing.saves.Held``) until the node is made: where the
node cannot take it, its graph is kept as it ran (what a first evaluation cached on the side, a prefix's
keys and values, stays valid), and the held tensors go through the caller's hooks then. An output that is not a tensor (a dataclass, a dict) is
flattened with ``torch.utils._pytree`` and rebuilt. A recompute that builds another graph than its
forward (a cache that filled in the forward: another count of autograd nodes, or other nodes making the
outputs) raises RuntimeError in backward rather than differentiate what ran the second time.

Where that node cannot take an evaluation (it reads a tensor with history that it was not given, such as
a closed-over conditioning computed with grad; outputs aliasing inputs; a sharding engine loaded, whose
hooks must see the recompute inside the graph; compiling), the evaluation runs with
saved-tensor hooks (:class:`_Frame`): the forward's pack hook returns the saved tensor's position
(``next`` of a counter: no Python frame), the first unpack in backward recomputes the evaluation once,
keeping the tensors it saves, in order, and each unpack takes its own; a recompute that saves another
number of tensors, or builds another graph (counted and compared as on the node), raises. A later evaluation the
node could not take after running it has saved nothing: it runs again on the hook path, from the RNG state
the fast path rewound and with its ``torch.Generator`` objects replayed, so it draws what it drew (its
other side effects, a counter say, happen twice, as a recompute repeats them). Once an evaluation of a ``cache=False`` call needed the hook path, the call's later evaluations take it
at once (:attr:`gradpatch.sampling.run.SamplingRun.fast`).

Both support what the evaluation does under grad, dropout included (the RNG is replayed),
``torch.autograd.grad`` and ``backward``, ``retain_graph`` (a second backward recomputes again) and
``create_graph=True`` (higher-order gradients). Gradients equal those of the plain call up to the order in
which floating-point contributions are summed (measured in float64: within 1e-13 of the largest gradient).

Nested checkpoints. Blocks checkpointed by gradpatch's fixed checkpoint inside the evaluation
(CompVis/AudioLDM transformer blocks default to ``checkpoint=True``; ``use_checkpoint=True`` UNets)
run plainly in the forward and the recompute (policy ``"never"`` in this context): the step is
recomputed as a whole, and their own recompute would run them a third time. ``torch.utils.checkpoint``
called directly inside the evaluation (diffusers' gradient checkpointing) still recomputes its blocks a
second time.

``FLAT = False`` uses ``torch.utils.checkpoint`` instead (an earlier implementation; benchmarks compare).
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, TypeVar

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradpatch.checkpointing.compat import autocast_dtype, autocast_enabled
from gradpatch.settings import scope
from gradpatch.sampling.steps import generators
from gradpatch.checkpointing.sharding import engine_loaded
from gradpatch.checkpointing.checkpoint import ESCAPED, fast_path

T = TypeVar("T")

FLAT = True
"""Use this module's checkpoint; False: ``torch.utils.checkpoint(use_reentrant=False)``."""


def _cuda_devices(args: tuple, kwargs: dict) -> list[int]:
    if not torch.cuda.is_initialized():
        return []
    return sorted({v.get_device() for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.is_cuda})


class _Frame:
    """One evaluation: what its recompute needs, and the recomputed tensors while backward uses them."""

    __slots__ = ("fn", "args", "kwargs", "rng", "devices", "cuda_rng", "autocast", "counter", "count", "values",
                 "left", "seen", "pack", "shape")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.count: int | None = None
        self.counter = itertools.count()
        # The forward's pack hook: the saved tensor's position, from C (no Python frame per tensor).
        self.pack: Callable[[torch.Tensor], int] = functools.partial(next, self.counter)  # type: ignore[arg-type]
        self.rng = torch.get_rng_state()
        self.devices = _cuda_devices(args, kwargs)
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.autocast = [(device, True, autocast_dtype(device))
                         for device in ("cpu", "cuda") if autocast_enabled(device)]
        self.values: list[torch.Tensor | None] | None = None
        self.left = 0
        self.seen: dict[Any, tuple[Any, int]] | None = None  # measured: storage -> (weak ref, bytes)
        self.shape: tuple[int | None, tuple[str, ...]] | None = None  # see run

    def run(self, pack: Callable[[torch.Tensor], Any]) -> Any:
        """The forward: ``fn`` under this frame's hooks (``pack``), noting the graph it builds (autograd
        nodes made, the kinds making its outputs) for :meth:`recompute` to compare."""
        start = _sequence_nr()
        with torch.autograd.graph.saved_tensors_hooks(pack, self.unpack), _inner_plain():
            out = self.fn(*self.args, **self.kwargs)
        # Nodes not counted where a sharding engine may run hooks (FSDP2 registers post-backward nodes in
        # the forward and not in a recompute during backward): there only the output kinds compare.
        self.shape = _shape(out, _sequence_nr() - start, self.autocast or engine_loaded())
        return out

    def measuring_pack(self, tensor: torch.Tensor) -> int:
        """The pack hook of :func:`measured`: the position, and the storage noted (once; an address
        freed and reused is a new storage)."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = self.seen.get(key)  # type: ignore[union-attr]
        if entry is None or entry[0].expired():
            if entry is not None:
                self.seen[(key, len(self.seen))] = entry  # type: ignore[index, arg-type]
            self.seen[key] = (StorageWeakRef(storage), storage.nbytes())  # type: ignore[index]
        return next(self.counter)

    def unpack(self, index: int) -> torch.Tensor:
        values = self.values
        if values is None or values[index] is None:
            self.recompute()
            values = self.values
            assert values is not None
        tensor, values[index] = values[index], None  # each saved tensor is unpacked once per backward
        self.left -= 1
        if not self.left:
            self.values = None  # all used: a later backward (retain_graph=True) recomputes
        assert tensor is not None
        return tensor

    def recompute(self) -> None:
        if self.count is None:  # the forward is over: what it saved
            self.count = next(self.counter)
        values: list[torch.Tensor | None] = []
        keep_graph = torch.is_grad_enabled()  # backward(create_graph=True): higher-order gradients

        def pack(tensor: torch.Tensor) -> None:
            values.append(tensor if keep_graph else tensor.detach())

        with torch.random.fork_rng(devices=self.devices, enabled=True, device_type="cuda"):
            torch.set_rng_state(self.rng)
            for device, state in zip(self.devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _never):
                with _autocast(self.autocast), _inner_plain():
                    start = _sequence_nr()
                    shape = _shape(self.fn(*self.args, **self.kwargs), _sequence_nr() - start,
                                   self.autocast or self.shape is None or self.shape[0] is None)
        if len(values) != self.count:
            raise RuntimeError(f"checkpoint_steps: a denoiser evaluation saved {self.count} tensors for backward "
                               f"in the forward and {len(values)} when recomputed in backward: it does not run the "
                               "same way twice (a cache filled in the forward?); use checkpoint_steps=False")
        if self.shape is not None and shape != self.shape:
            raise RuntimeError(f"checkpoint_steps: a denoiser evaluation built another graph when recomputed in "
                               f"backward than in its forward ({self.shape[0]} autograd nodes then, {shape[0]} now; "
                               f"outputs made by {', '.join(self.shape[1])} then, {', '.join(shape[1])} now): it does "
                               "not run the same way twice (a cache filled in the forward, a scripted function's "
                               "first run?); use checkpoint_steps=False")
        self.values, self.left = values, len(values)


class _autocast:
    def __init__(self, states: list) -> None:
        self.contexts = [torch.autocast(device, dtype=dtype) for device, _, dtype in states]

    def __enter__(self) -> None:
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for context in reversed(self.contexts):
            context.__exit__(*exc)


_sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr  # the thread's next autograd node number


def _shape(out: Any, nodes: int, uncounted: Any) -> tuple[int | None, tuple[str, ...]]:
    """What :meth:`_Frame.recompute` compares: autograd nodes made (unless ``uncounted``: under autocast,
    whose cast cache may hold the forward's casts of parameters and not the recompute's) and the kinds
    making the outputs."""
    return (None if uncounted else nodes), tuple(type(o.grad_fn).__name__ if isinstance(o, torch.Tensor) else "-"
                                                for o in tree_flatten(out)[0])


def _never(packed: Any) -> torch.Tensor:
    raise RuntimeError("checkpoint_steps: a tensor saved during a recompute was unpacked")


_VERIFY = ("checkpoint_steps: a denoiser evaluation", "use checkpoint_steps=False")


def recomputed(fn: Callable[..., T], args: tuple, kwargs: dict, fast: bool, hold: bool = False) -> tuple[T, bool]:
    """``fn(*args, **kwargs)`` with what it saves recomputed in backward (module docstring), through the
    fixed checkpoint's node if ``fast``; also whether the next evaluation of the same call should try
    that node (False once one could not take it). ``hold``: the call's first try, whose forward's saves
    are held until the node is made (kept where it cannot be)."""
    if not FLAT:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs), fast  # type: ignore[return-value]
    fn = generators.wrap(fn, args, kwargs)
    if fast:
        structure: list[Any] = [None, None, hold]  # how to rebuild the output; the forward's; keep it
        out = fast_path(functools.partial(_flat_call, fn, structure), args, kwargs or None, verify=_VERIFY,
                        reuse=hold)
        ran, structure[1], structure[2] = structure[1], None, False  # the recompute in backward keeps nothing
        if out is not ESCAPED:
            return (out if structure[0] is None else tree_unflatten(list(out), structure[0])), True
        if ran is not None:  # it ran with its saves held, and the node could not take it: its result, graph
            out = ran        # and all, is the plain run's (its side effects and draws happened once)
            return (out if structure[0] is None else tree_unflatten(list(out), structure[0])), False
        # A later evaluation the node could not take after running it saved nothing (dropped as saved)
        # and the RNG is rewound: it runs again on the hook path, drawing what it drew (``fn`` replays its
        # generators from its second call on).
    frame = _Frame(fn, args, kwargs)
    return frame.run(frame.pack), False


def _flat_call(fn: Callable[..., Any], structure: list[Any], *args: Any, **kwargs: Any) -> Any:
    """``fn``'s result, as a tensor or a flat tuple (``structure[0]``: how to rebuild it), with
    gradpatch's block checkpoints inside it plain: in the forward and in the recompute."""
    with _inner_plain():
        out = fn(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        structure[0] = None
    else:
        leaves, structure[0] = tree_flatten(out)
        out = tuple(leaves)
    if structure[2]:  # a held forward: kept in case the fast path escapes after running it
        structure[1] = out
    return out


def _inner_plain() -> Any:
    """gradpatch's fixed checkpoints inside the evaluation run their blocks plainly: the step is
    recomputed as a whole, so a block checkpoint inside it would recompute a second time."""
    return scope(checkpoint_policy="never")


def measured(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, int]:
    """The evaluation recomputed in backward (the hook path of :func:`recomputed`), and the bytes keeping
    its graph would have added: those of the storages it saved for backward that were freed when it
    returned (as :mod:`gradpatch.checkpointing.budget.measure` counts a block's own bytes). Storages still
    alive (the inputs, parameters, the output) cost nothing more when kept, and each storage counts once."""
    frame = _Frame(generators.wrap(fn, args, kwargs), args, kwargs)
    frame.seen = {}
    out = frame.run(frame.measuring_pack)
    seen, frame.seen = frame.seen, None
    return out, sum(size for ref, size in seen.values() if ref.expired())


def kept(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, its graph kept, with gradpatch's block checkpoints inside it plain as in
    :func:`measured` (so it keeps what was measured)."""
    with _inner_plain():
        return fn(*args, **kwargs)
