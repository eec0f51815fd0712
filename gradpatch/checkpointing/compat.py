"""What the checkpoint fix reads from torch, on every release ``pyproject.toml`` accepts (2.1 on).

Each name is bound once, at import, to the fastest form the installed torch has: the per-device
autocast queries appeared in 2.4 (2.1 to 2.3 have ``is_autocast_cpu_enabled`` and friends, which
2.4 deprecates), ``torch.compiler.is_compiling`` in 2.3, the engine entry point behind
``torch.autograd.grad`` in 2.3. On 2.1 an item assignment of a tensor does not reach a
``TorchFunctionMode`` (:func:`setitem_to_modes`: the copy on write of ``gradpatch.differentiable`` sees
writes through one).
``make test`` runs the tests that need no upstream package on the lowest release too.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode, handle_torch_function

__all__ = ["top_saved_tensors_hooks", "autocast_enabled", "autocast_dtype", "is_compiling", "engine_grad", "sequence_nr",
           "functorch_active", "setitem_to_modes"]

try:
    torch.is_autocast_enabled("cpu")
    torch.get_autocast_dtype("cpu")
except (TypeError, AttributeError):  # torch < 2.4: one function per device
    def autocast_enabled(device: str) -> bool:
        """``torch.is_autocast_enabled(device)`` for ``"cpu"`` and ``"cuda"``."""
        return torch.is_autocast_cpu_enabled() if device == "cpu" else torch.is_autocast_enabled()

    def autocast_dtype(device: str) -> torch.dtype:
        """``torch.get_autocast_dtype(device)`` for ``"cpu"`` and ``"cuda"``."""
        return torch.get_autocast_cpu_dtype() if device == "cpu" else torch.get_autocast_gpu_dtype()
else:
    autocast_enabled = torch.is_autocast_enabled  # type: ignore[assignment]  # (same call, with a device)
    autocast_dtype = torch.get_autocast_dtype  # type: ignore[assignment]  # (same call, with a device)

#: Whether torch.compile is tracing the caller (dynamo answers True while tracing).
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or \
    torch._utils.is_compiling  # torch < 2.3: the same flag under its older name

_peek_interpreter = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vjp``, ``vmap``, ``jacrev``, ``jvp``,
    ``hessian``, ...) is running the caller: functorch keeps a stack of interpreters, empty outside
    transforms. About 0.1 us. ``False`` while torch.compile traces (dynamo handles transforms)."""
    return _peek_interpreter is not None and not is_compiling() and _peek_interpreter() is not None


#: The thread's next autograd sequence number: nodes made from now on get this number or higher.
sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr

try:  # private, but what torch.autograd.grad calls once its arguments are checked; self-tested
    from torch.autograd.graph import _engine_run_backward

    _w = torch.ones(1, requires_grad=True)
    if _engine_run_backward((_w * 3.0,), (torch.ones(1),), False, False, (_w,), True,
                            False)[0].item() != 3:
        raise ImportError("unexpected result")
    del _w
    engine_grad: Callable[..., tuple] | None = _engine_run_backward
except Exception:  # torch < 2.3, or another signature: the public function is used
    engine_grad = None


class _Probe(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.seen.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def _setitem_reaches_modes() -> bool:
    probe, tensor, value = _Probe(), torch.zeros(1), torch.ones(1)
    with probe:
        tensor[:] = value  # torch 2.1 dispatches a scalar value, not a tensor
    return "__setitem__" in probe.seen


_setitem = torch.Tensor.__setitem__
_own_setitem = vars(torch.Tensor).get("__setitem__")
_setitem_users = 0
_setitem_lock = threading.Lock()


def _setitem_through_modes(self: torch.Tensor, index: Any, value: Any) -> None:
    if torch._C._is_torch_function_enabled() and torch._C._is_torch_function_mode_enabled():
        handle_torch_function(_setitem, (self, value), self, index, value)
    else:
        _setitem(self, index, value)


def setitem_to_modes(on: bool) -> None:
    """Count a user (``on``) or drop one of ``Tensor.__setitem__`` dispatched to the active
    ``TorchFunctionMode``. Where torch does it itself (checked once, at import), nothing; on torch 2.1
    (item assignment of a tensor goes straight to C), while any user holds it, ``torch.Tensor.__setitem__``
    is a Python function handing the call to the mode (one Python call per item assignment, any thread)."""
    global _setitem_users
    if _SETITEM_REACHES_MODES:
        return
    with _setitem_lock:
        _setitem_users += 1 if on else -1
        if _setitem_users == 1 and on:
            torch.Tensor.__setitem__ = _setitem_through_modes  # type: ignore[assignment, method-assign]
        elif _setitem_users == 0:
            if _own_setitem is None:
                del torch.Tensor.__setitem__
            else:
                torch.Tensor.__setitem__ = _own_setitem  # type: ignore[method-assign]


_SETITEM_REACHES_MODES = _setitem_reaches_modes()


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # torch 2.2 on


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost default saved-tensor hooks in force (``(pack, unpack)``), or None. Torch 2.1 has no
    way to read them: there it is always None (gradpatch's hooks then stand in front of a caller's
    ``save_on_cpu`` instead of composing with it, as torch's own nested hooks do)."""
    return None if _TOP_HOOKS is None else _TOP_HOOKS(False)

