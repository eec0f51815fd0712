"""The moment ``grad_steps`` resumes recording: between the last evaluation of step N-K-1 and the first
of step N-K (see :func:`gradpatch.sampling.run.run_step`).

Grad comes back on when step N-K-1's last evaluation returns, so that what the sampler prepares for
step N-K (``c_in = torch.cat([uc, c])``, ``mu_in[0] = mu``) records the conditioning's graph. But the
state update that follows step N-K-1 runs then too: if the state before it carries a graph (the first
step's input, ``N-K == 1``: the caller's noise, an img2img latent), ``x = x + dt * v`` would connect
the latent entering step N-K to it. So until step N-K starts, a :class:`~torch.overrides.TorchFunctionMode`
taints the outputs of the cut steps' evaluations and everything computed from them: an operation with
a tainted input runs under ``no_grad`` (a tensor it updates in place is detached in place first), and
its outputs are tainted. The latent entering step N-K is thus detached, and conditioning prepared
from untainted tensors keeps its graph.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gradpatch.sampling.values import tensors as _all_tensors


_IN_PLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__"})


class Window(TorchFunctionMode):
    """Entered when grad resumes, exited when step N-K starts (or the call ends)."""

    def __init__(self, tainted: Any) -> None:
        super().__init__()
        self.tainted: dict[int, weakref.ref] = {}
        self.taint(tainted)

    def taint(self, obj: Any) -> None:
        for tensor in _all_tensors(obj, modules=False):
            self.tainted[id(tensor)] = weakref.ref(tensor)

    def _is_tainted(self, tensor: torch.Tensor) -> bool:
        ref = self.tainted.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not any(self._is_tainted(t) for t in _all_tensors((args, kwargs), -1, modules=False)):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and target.requires_grad and target._base is None and (
                name in _IN_PLACE or (name.endswith("_") and not name.startswith("_"))):
            target.detach_()  # the state updated in place: its earlier graph must not reach step N-K
        with torch.no_grad():
            out = func(*args, **kwargs)
        self.taint(out)
        if name == "__setitem__" and isinstance(target, torch.Tensor):
            self.taint(target)
        return out
