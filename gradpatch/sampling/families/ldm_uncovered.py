"""The latent-diffusion family's report of decorated methods no patch replaced
(:mod:`gradpatch.sampling.families.ldm`, on the first ``cache=False`` call of each class)."""
from __future__ import annotations

from typing import Any

from gradpatch.sampling.lifting.bytecode import no_grad_body

_checked: set[type] = set()
FRAMEWORKS = frozenset({"torch", "pytorch_lightning", "lightning"})
"""Packages whose base classes' decorated methods (``LightningModule.to_onnx``/``to_torchscript``: model
export, never reached by sampling) are not reported as uncovered."""


def warn_uncovered(obj: Any) -> None:
    """Once per class: name the ``@torch.no_grad()`` methods no patch replaced. The catalogue declares
    every decorated method of a known class; one left over (a subclass's own, a new upstream method)
    would cut the graph of a ``cache=False`` call that reaches it, so say so rather than stay silent."""
    cls = type(obj)
    if obj is None or cls in _checked:
        return
    _checked.add(cls)
    left = sorted({f"{c.__qualname__}.{name}" for c in cls.__mro__ for name, value in vars(c).items()
                   if no_grad_body(value) is not None and getattr(cls, name, None) is value
                   and c.__module__.partition(".")[0] not in FRAMEWORKS})
    if left:
        from gradpatch.errors import UnknownCodeWarning, complain

        complain(UnknownCodeWarning, f"gradpatch: {', '.join(left)} {'is' if len(left) == 1 else 'are'} "
                 "@torch.no_grad() and not patched: a cache=False call that reaches "
                 f"{'it' if len(left) == 1 else 'them'} gets no gradient through that part")
