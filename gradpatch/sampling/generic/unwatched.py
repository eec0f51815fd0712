"""A step evaluation run without copy on write's watch (:mod:`gradpatch.sampling.generic.copy_on_write`).

Copy on write sees every torch call through its ``__torch_function__`` mode and every tensor saved
for backward through its pack hook: a Python call each, most of them inside the step's network. Once
the step's first recorded evaluations have shown that the network writes nothing saved (copy on write
kept no copy there, made no update out of place), its later evaluations run without the mode; and
while copy on write has not acted anywhere in the call yet (the sampler refills nothing that a step
saved), without its pack hook too, whose tensors torch then saves as it would without gradpatch (under
the caller's own hooks, ``save_on_cpu``, if any). What stays: the sampler's own calls are watched as
before. What a later evaluation does differently fails loudly, never silently: a write of the network's
own into a tensor saved is refused in backward by copy on write's check (:meth:`Saved.value
<gradpatch.sampling.generic.held.Saved.value>`) or by torch's version counter, whichever saved it; so
is a later refill of a tensor an evaluation without the pack hook saved.
"""
from __future__ import annotations

import torch

from gradpatch.checkpointing.compat import top_saved_tensors_hooks
from gradpatch.sampling.generic.copy_on_write import CopyOnWrite


class Unwatched:
    """``cow``'s mode off for the block, where it is the innermost; with ``hooks``, its pack hook too,
    where its pair is the innermost (torch 2.2 on: readable there). A class, not a generator-based
    context manager: it is entered once per step evaluation, where a generator's frame costs more than
    the stack operations themselves."""

    __slots__ = ("cow", "mode", "hooks")

    def __init__(self, cow: CopyOnWrite, hooks: bool) -> None:
        self.cow = cow
        depth = torch._C._len_torch_function_stack()
        self.mode = depth > 0 and torch._C._get_function_stack_at(depth - 1) is cow
        pushed = cow.pushed if hooks else None
        top = top_saved_tensors_hooks() if pushed is not None else None
        self.hooks = pushed is not None and top is not None and top[0] is pushed[0]

    def __enter__(self) -> None:
        if self.mode:
            torch._C._pop_torch_function_stack()
        if self.hooks:
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def __exit__(self, *exc: object) -> None:
        if self.hooks:
            torch._C._autograd._push_saved_tensors_default_hooks(*self.cow.pushed)  # type: ignore[misc]
        if self.mode:
            torch._C._push_on_torch_function_stack(self.cow)
