"""Choosing which parameters train: :func:`trainable`.

Fine-tuning part of a model is a ``requires_grad`` mask. Setting it by hand is easy to get silently
wrong (a pattern that matches nothing trains nothing), so :func:`trainable` takes glob patterns over
parameter names, refuses an include pattern that matches nothing before changing anything, and returns
a summary per top-level module.
"""
from __future__ import annotations

import fnmatch
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import torch

from gradpatch.errors import ConfigWarning, complain


@dataclass
class TrainableSummary:
    """How many tensors and elements train, in total and per top-level module."""

    trained_tensors: int
    trained_elements: int
    total_tensors: int
    total_elements: int
    by_module: "OrderedDict[str, tuple[int, int, int]]" = field(default_factory=OrderedDict)  # trained tensors, trained elements, total elements
    unmatched: tuple[str, ...] = ()

    def __str__(self) -> str:
        share = self.trained_elements / max(self.total_elements, 1)
        lines = [f"trainable: {self.trained_elements:,} of {self.total_elements:,} parameters "
                 f"({share:.1%}) in {self.trained_tensors} of {self.total_tensors} tensors"]
        width = max((len(name) for name in self.by_module), default=0)
        for name, (tensors, elements, total) in self.by_module.items():
            lines.append(f"  {name.ljust(width)}  {elements:>12,} / {total:>12,}  ({tensors} tensors)")
        for pattern in self.unmatched:
            lines.append(f"  pattern {pattern!r} matched no parameter")
        return "\n".join(lines)


def _matches(name: str, patterns: Iterable[str]) -> set[str]:
    return {p for p in patterns if fnmatch.fnmatchcase(name, p)}


def trainable(model: torch.nn.Module, include: Iterable[str] = (), exclude: Iterable[str] = (),
              *, verbose: bool = False) -> TrainableSummary:
    """Set ``requires_grad`` on ``model``'s parameters from glob patterns over their names.

    With ``include``, exactly the parameters matching an include pattern and no exclude pattern
    train; without, every parameter trains except those matching ``exclude``. Patterns use
    :mod:`fnmatch` syntax on names from ``named_parameters()``, e.g. ``"*attn2*"`` (cross-attention in
    CompVis-style UNets), ``"*.norm*"``, ``"input_blocks.*"``.

    The patterns are checked before anything changes, because a pattern that matches no parameter
    almost always means a typo. An ``include`` pattern that matches nothing raises ``ValueError``
    and leaves every ``requires_grad`` flag as it was (applied anyway, it would silently train
    less than asked, or nothing). An ``exclude`` pattern that matches nothing excludes nothing: it is
    reported with a :class:`~gradpatch.ConfigWarning` (an error in strict mode) and the mask is set.
    Both messages name a few real parameter names. ``verbose`` prints the summary.
    """
    include, exclude = tuple(include), tuple(exclude)
    named = list(model.named_parameters())
    used = {p for name, _ in named for p in include + exclude if fnmatch.fnmatchcase(name, p)}
    examples = ", ".join(name for name, _ in named[:3])
    missing = [p for p in include if p not in used]
    if missing:
        raise ValueError(f"gradpatch.trainable: include pattern {', '.join(map(repr, missing))} matched no "
                         f"parameter of {type(model).__name__} (names look like: {examples}); nothing was "
                         "changed. Patterns are fnmatch globs over named_parameters() names.")
    summary = TrainableSummary(0, 0, 0, 0)
    summary.unmatched = tuple(p for p in exclude if p not in used)
    if summary.unmatched:
        complain(ConfigWarning, f"gradpatch.trainable: {', '.join(map(repr, summary.unmatched))} matched no "
                 f"parameter of {type(model).__name__} (names look like: {examples})")
    for name, parameter in named:
        train = (not include or bool(_matches(name, include))) and not _matches(name, exclude)
        parameter.requires_grad_(train)
        top = name.split(".", 1)[0]
        tensors, elements, total = summary.by_module.get(top, (0, 0, 0))
        summary.by_module[top] = (tensors + train, elements + train * parameter.numel(), total + parameter.numel())
        summary.total_tensors += 1
        summary.total_elements += parameter.numel()
        summary.trained_tensors += train
        summary.trained_elements += train * parameter.numel()
    if verbose:
        print(summary)
    return summary
