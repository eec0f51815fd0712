"""The checkpoint fix's fast path: one autograd node that recomputes ``func`` in backward.

**What the block observes.** The forward is ``func(*inputs)`` exactly as the caller would run it:
grad mode on, the caller's own input tensors and parameters with their ``requires_grad`` flags,
autocast and RNG as they are. Nothing is detached, no flag is changed, so a block branching on
``param.requires_grad``, ``x.requires_grad``, an intermediate's ``requires_grad`` or
``torch.is_grad_enabled()`` takes the same branch in its recompute, which runs in backward under
grad mode with the forward's CPU/CUDA RNG and autocast state, on the saved input tensors (detached
leaves with the same values and flags; views of them under ``create_graph=True``) and the same
parameters. What differs: the recompute's input tensors are other tensor objects than the caller's
(a block keeping a reference to its input across calls sees that), and under ``create_graph=False``
they are leaves (``x.is_leaf``, ``x.grad_fn``).

**What gets gradients.** The forward builds its graph as it runs; before the graph is dropped it is
walked once from the outputs that require grad, stopping at nodes not made by the call (autograd
sequence numbers, which are per thread: a tensor that another thread computes while ``func`` runs is
assumed not to be read by it; DataParallel replicas take the graph path). The walk finds every leaf
that requires grad and that the outputs depend on: declared parameters, and also tensors ``func``
reads undeclared (closures, hooks, LoRA modules that are not children). These and the input tensors
become the inputs of one :class:`Recompute` node, whose backward recomputes ``func`` and
differentiates it with respect to exactly those. A node not made by the call, other than an input
tensor's own, means ``func`` read a non-leaf tensor it was not given (fast weights, a closure tensor
computed beforehand): the node could not reach it, so :func:`attempt` rewinds the RNG and returns
``ESCAPED`` for the graph path.

**Outputs.** One that does not require grad is returned as computed (``requires_grad=False``, as
autograd decided). One that is an input tensor or a view of one sends the call to the graph path:
the node saves its inputs for the recompute, so an in-place change to such an output must be seen
there exactly as torch's checkpoint sees it. One made before the call or a view of such a tensor (a
closure tensor returned as is, a view of a parameter) keeps its own graph, which holds no
activations. The others are detached from the forward's graph and become the node's outputs; if
two of them share storage the call takes the graph path, so that an in-place change to one reaches
the other.

**Memory.** The forward runs under saved-tensor hooks of its own (:mod:`gradpatch.checkpointing.saves`):
what its graph would save is dropped as it is saved, so the graph holds no activation whatever keeps it
(reference cycles through module hooks did, until the garbage collector ran); the node's inputs go
through a caller's hooks (``save_on_cpu``). A tensor made inside the block that reaches backward by
another way than the return value raises there.

**Cost.** Peak memory is the backward's, which recomputes the block; the node saves the input
tensors and the 5 KB CPU RNG state. Building that graph (a third to a half of the extra CPU time) and
walking it (0.4 to 2.2 us a node) is what this costs over upstream, whose forward runs under
``no_grad``: 3.6% on the tiny AudioLDM UNet on one CPU thread, 6% to 7% on an H100, where launching
kernels bounds the step (``benchmarks/checkpoint_speed.py``, ``checkpoint_cost.py``, docs/benchmarks.md). A
forward without a graph would be cheaper, but the block would see another grad mode and other flags
than in its recompute.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.overrides import has_torch_function

from gradpatch.checkpointing import graph_walk
from gradpatch.checkpointing.compat import autocast_dtype, autocast_enabled, engine_grad, sequence_nr
from gradpatch.checkpointing.graph_path import parameters_as
from gradpatch.checkpointing.saves import Held, forward_saves

_edge: Callable[[Tensor], Any] | None = getattr(torch.autograd.graph, "get_gradient_edge", None)  # 2.2 on
_PLAIN = (Tensor, type(None), bool, int, float, str)  # what a fast-path output tuple may hold
ESCAPED = object()


def attempt(func: Callable[..., Any], args: tuple, kwargs: dict | None,
            verify: tuple[str, str] | None = None, reuse: bool = False) -> Any:
    """``func``'s result through one :class:`Recompute` node, or ``ESCAPED`` (RNG rewound).

    ``verify``: (what ``func`` is, what to do instead) for the error raised in backward when the
    recompute builds another graph than the forward did: another number of autograd nodes, or other
    kinds of node making the outputs. A cache that filled in the forward, say, would otherwise be
    differentiated as it ran the second time. (Counted, not walked: the count is two reads of the
    thread's autograd sequence number, where a walk of the recomputed graph cost 3% of a sampler
    step's time on small models.)

    ``reuse``: the caller keeps the forward's graph and draws where this returns ``ESCAPED`` (**Memory**)."""
    values = list(args) if kwargs is None else [*args, *kwargs.values()]
    state = _State(func, values, len(args), kwargs)
    state.verify = verify
    held = Held() if reuse else None
    state.held = held
    start = sequence_nr()
    with forward_saves(held):
        out = state.call(values)
    end = sequence_nr()
    if isinstance(out, Tensor):
        outs: tuple = (out,)
    elif type(out) is tuple and all(isinstance(o, _PLAIN) for o in out):
        outs = out
    else:
        return state.escape()
    routed = [i for i, o in enumerate(outs)
              if isinstance(o, Tensor) and o.requires_grad and graph_walk.made_here(o, start)]
    if not routed:
        return out
    if state.slots and graph_walk.aliasing_inputs(outs, [values[i] for i in state.slots]):
        return state.escape()  # an in-place change to the output would change a saved input
    if len(routed) > 1 and len({id(graph_walk.root(outs[i])) for i in routed}) < len(routed):
        return state.escape()  # outputs aliasing each other: in-place on one must reach the other
    params = graph_walk.sources([outs[i] for i in routed], start, end, [values[i] for i in state.diff])
    if params is None:
        return state.escape()
    state.params, state.routed = params, routed
    if verify:
        state.shape = _shape([outs[i] for i in routed], end - start)
    state.out = tuple(outs[i].detach() for i in routed)
    single, passed = isinstance(out, Tensor), list(outs)
    for i in routed:
        passed[i] = None
    del out, outs  # drop the forward's graph: the node's backward recomputes it
    if held is not None:
        held.clear()  # even where a reference cycle keeps the graph's nodes until the collector runs
    results = Recompute.apply(state, *[values[i] for i in state.slots], *params)
    if single:
        return results[0]
    for i, r in zip(routed, results):
        passed[i] = r
    return tuple(passed)


class _State:
    """What the fast path's backward needs besides the saved tensors."""

    __slots__ = ("func", "n_args", "keys", "params", "template", "slots", "diff", "out", "bound",
                 "routed", "cpu_rng", "cuda_rng", "autocast", "verify", "shape", "held")

    def __init__(self, func: Callable[..., Any], values: list, n_args: int,
                 kwargs: dict | None) -> None:
        self.func, self.n_args = func, n_args
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
        self.params: list[Tensor] = []  # leaves the outputs depend on, found by _sources
        self.routed: list[int] = []  # positions of the outputs that are the node's
        self.out: Any = None  # handed to Recompute.forward, then dropped: no reference cycle
        self.bound: list[tuple[torch.nn.Module, str, Tensor | None]] | None = None  # see rebuild
        self.verify: tuple[str, str] | None = None  # see attempt
        self.shape: tuple[int, tuple[str, ...]] | None = None  # the forward's, where verified
        self.held: Held | None = None  # what the forward saved, with reuse
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng: list[tuple[int, Tensor]] = []
        if torch.cuda.is_initialized():  # never initialise CUDA just to read its RNG
            devices = {t.get_device() for t in values if isinstance(t, Tensor) and t.is_cuda}
            self.cuda_rng = [(d, torch.cuda.get_rng_state(d))
                             for d in sorted(devices or {torch.cuda.current_device()})]
        self.autocast = [(d, autocast_dtype(d), torch.is_autocast_cache_enabled())
                         for d in ("cpu", "cuda") if autocast_enabled(d)]

    def call(self, values: list) -> Any:
        if self.keys is None:
            return self.func(*values)
        n = self.n_args
        return self.func(*values[:n], **dict(zip(self.keys, values[n:])))

    def escape(self) -> object:
        if self.held is None:  # the caller runs func again: it draws what it drew
            self.rewind_rng()
        else:  # the caller keeps the forward as it ran, its draws too: its saves go where they would have
            self.held.settle()
        return ESCAPED

    def rewind_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        for device, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, device)

    def rebuild(self, saved: tuple, create_graph: bool) -> tuple[list, list[Tensor]]:
        """Recompute ``func``; return the node's outputs and the tensors to differentiate by."""
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
        # An autocast region still open in backward shares its cast cache with the recompute: the
        # forward's casts of leaves are found there and make no nodes, so only the kinds compare.
        counted = not any(c and autocast_enabled(d) for d, _, c in self.autocast)
        start = sequence_nr()
        out = self.recompute(values)
        every = out if isinstance(out, tuple) else (out,)
        outs = [every[i] for i in self.routed]
        if self.verify and self.shape is not None and (
                now := _shape(outs, sequence_nr() - start if counted else self.shape[0])) != self.shape:
            what, instead = self.verify
            name = getattr(self.func, "__qualname__", None)
            raise RuntimeError(
                f"{what}{f' ({name})' if name else ''} built another graph when recomputed in backward than in its forward "
                f"({self.shape[0]} autograd nodes then, {now[0]} now; outputs made by "
                f"{', '.join(self.shape[1])} then, {', '.join(now[1])} now): it does not run the "
                f"same way twice (a cache filled in the forward?); {instead}")
        return outs, targets + self.params

    def recompute(self, values: list) -> Any:
        """Run ``func`` as in the forward: its RNG, autocast state and parameters; grad mode on."""
        cpu_now = torch.get_rng_state()
        cuda_now = [(d, torch.cuda.get_rng_state(d)) for d, _ in self.cuda_rng]
        self.rewind_rng()
        contexts: list[Any] = []  # autocast contexts, only where the state differs
        if self.autocast or autocast_enabled("cpu") or autocast_enabled("cuda"):
            on = {d for d, _, _ in self.autocast}
            contexts = [torch.autocast(d, enabled=False) for d in ("cpu", "cuda")
                        if d not in on and autocast_enabled(d)]
            contexts += [torch.autocast(d, dtype=dtype, cache_enabled=cache)
                         for d, dtype, cache in self.autocast
                         if not (autocast_enabled(d) and autocast_dtype(d) == dtype)]
        if self.bound:
            contexts.append(parameters_as(self.bound))
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


def _shape(outs: list, nodes: int) -> tuple[int, tuple[str, ...]]:
    """What :func:`attempt`'s ``verify`` compares: autograd nodes made, and the kinds making ``outs``."""
    return nodes, tuple(type(o.grad_fn).__name__ if isinstance(o, Tensor) else "-" for o in outs)


def _grad(outputs: tuple, inputs: tuple, grad_outputs: tuple, create_graph: bool) -> tuple:
    """``torch.autograd.grad(..., allow_unused=True)`` minus its Python argument checks (30 us a
    call on CPU): these arguments come from autograd itself. ``__torch_function__`` subclasses, and
    a torch without the engine entry point (``compat.engine_grad``), take the public function."""
    if engine_grad is not None and not has_torch_function((*outputs, *inputs, *grad_outputs)):
        return engine_grad(outputs, grad_outputs, create_graph, create_graph, inputs, True, False)
    return torch.autograd.grad(outputs, inputs, grad_outputs, create_graph=create_graph,
                               allow_unused=True)


class Recompute(torch.autograd.Function):
    """The fast path's node. Inputs: ``func``'s input tensors, then the leaves its outputs depend
    on; outputs: those of ``func``'s outputs that :func:`attempt` routes through it."""

    @staticmethod
    def forward(ctx: Any, state: _State, *tensors: Tensor) -> tuple:
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
        del outs
        found: Sequence[Tensor | None] = [None] * len(targets)
        if pairs:
            roots: tuple = tuple(o for o, _ in pairs)
            if _edge is not None and not create_graph and not has_torch_function(roots):
                # Their edges: the recomputed outputs are freed before the inner backward runs.
                roots = tuple(_edge(o) for o in roots)
            pairs = [(root, g) for root, (_, g) in zip(roots, pairs)]
            del roots
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
