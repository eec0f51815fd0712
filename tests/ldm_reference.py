"""References for the ldm-family sampling tests: the same upstream code with its gradient blockers
removed by hand, independently of gradpatch's machinery.

* Decorators: :func:`undecorated` sets each listed method on its class to ``inspect.unwrap`` of it for
  the duration of a block (gradpatch wrappers, if any, are looked through first).
* In-body ``with torch.no_grad():`` (AudioLDM2/AudioSR ``decode_first_stage``/``encode_first_stage``,
  ldm's ``DPM_Solver.sample``): :func:`text_edited` recompiles the method's source with every
  ``with torch.no_grad():`` line rewritten to ``if True:`` (a text edit, not gradpatch's AST lift),
  in the module's own globals.
* Truncation (``grad_steps=K``): :func:`first_calls_without_grad` runs the first ``n`` calls of a
  per-step method under ``no_grad``.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import textwrap
from typing import Any, Callable, Iterable, Iterator

import torch

from support import upstream_method


@contextlib.contextmanager
def replaced(cls: type, name: str, value: Any) -> Iterator[None]:
    original = vars(cls)[name]
    setattr(cls, name, value)
    try:
        yield
    finally:
        setattr(cls, name, original)


@contextlib.contextmanager
def undecorated(methods: Iterable[tuple[type, str]]) -> Iterator[None]:
    """Each ``(cls, name)`` replaced by its undecorated upstream body while the block runs."""
    with contextlib.ExitStack() as stack:
        for cls, name in methods:
            stack.enter_context(replaced(cls, name, inspect.unwrap(upstream_method(cls, name))))
        yield


def text_edited(cls: type, name: str) -> Callable[..., Any]:
    """``cls.name`` recompiled from its source with ``with torch.no_grad():`` replaced by ``if True:``."""
    raw = inspect.unwrap(upstream_method(cls, name))
    source = textwrap.dedent(inspect.getsource(raw))
    edited = source.replace("with torch.no_grad():", "if True:")
    assert edited != source, f"{cls.__name__}.{name} has no in-body no_grad"
    namespace: dict[str, Any] = {}
    exec(compile(edited, f"<hand-edited {cls.__name__}.{name}>", "exec"), vars(sys.modules[raw.__module__]), namespace)
    return namespace[name]


def first_calls_without_grad(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``fn`` whose first ``n`` calls run under ``torch.no_grad()``."""
    calls = [0]

    def step(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] <= n:
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    step.calls = calls  # type: ignore[attr-defined]
    return step


@contextlib.contextmanager
def cpu_buffers(sampler: Any) -> Iterator[None]:
    """For upstream samplers whose ``register_buffer`` forces CUDA: keep the buffers on the CPU (moved
    by hand, on this one instance), so that unpatched upstream can run on a CPU-only machine."""
    def register_buffer(name: str, attr: Any) -> None:
        setattr(sampler, name, attr.to("cpu") if isinstance(attr, torch.Tensor) else attr)

    sampler.register_buffer = register_buffer
    try:
        yield
    finally:
        del sampler.register_buffer


def assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float = 1e-5) -> None:
    """Equal to ``rtol`` relative to each tensor's largest reference entry; a tensor whose true gradient
    is numerically zero (a bias before GroupNorm) is held to a floor of ``rtol`` times the largest
    gradient of the whole set instead."""
    assert len(got) == len(want) and want
    biggest = max(float(w.abs().max()) for w in want)
    assert biggest > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all(), i
        scale = max(float(w.abs().max()), biggest * 1e-3)
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * scale, msg=lambda m: f"tensor {i}: {m}")
