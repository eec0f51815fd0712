"""What the fast path reads off a forward's autograd graph: the leaves it depends on, whether it
reads tensors made elsewhere (:mod:`gradpatch.checkpointing.recompute`)."""
from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

_ACCUMULATE_GRAD: Any = type(cast(Any, torch.ones(1, requires_grad=True).mul(1).grad_fn).next_functions[0][0])


def root(t: Tensor) -> Tensor:
    return t._base if t._is_view() else t  # type: ignore[return-value]  # (a view has a _base)


def aliasing_inputs(outs: tuple, inputs: list[Tensor]) -> bool:
    """Whether an output is an input tensor or a view of the tensor an input is (a view of)."""
    roots = {id(root(t)) for t in inputs}
    return any(isinstance(o, Tensor) and id(root(o)) in roots for o in outs)


def made_here(t: Tensor, start: int) -> bool:
    """Whether ``t`` (or the tensor it is a view of) was computed by this call's forward."""
    grad_fn = root(t).grad_fn
    return grad_fn is not None and grad_fn._sequence_nr() >= start


def sources(roots: list[Tensor], start: int, end: int, inputs: list[Tensor]) -> list[Tensor] | None:
    """The leaves requiring grad that ``roots`` depend on, other than ``inputs``; ``None`` if they
    also depend on a tensor not made by the call (sequence numbers outside ``start``..``end``)
    that is not one of ``inputs``."""
    allowed = {(t.grad_fn, t.output_nr) for t in inputs if t.grad_fn is not None}
    stack: list[Any] = [t.grad_fn for t in roots]
    seen = {None, *stack}
    leaves: list[Tensor] = []
    while stack:  # about 0.2 us a node; kept flat for that
        for node, nr in stack.pop().next_functions:
            if node in seen:
                continue
            if type(node) is _ACCUMULATE_GRAD:
                seen.add(node)
                leaves.append(node.variable)
            elif start <= node._sequence_nr() < end:  # made by this call
                seen.add(node)
                stack.append(node)
            elif (node, nr) not in allowed:
                return None
    if not inputs:
        return leaves
    given = {id(t) for t in inputs}
    return [t for t in leaves if id(t) not in given]
