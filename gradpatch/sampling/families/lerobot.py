"""LeRobot's pi0 / pi05 flow policies: ``sample_actions`` made differentiable, its step count read as upstream does.

``PI0Pytorch.sample_actions(..., num_steps=None)`` (and PI05's) takes ``self.config.num_inference_steps`` when
``num_steps`` is not given, which a declared ``steps="num_steps"`` cannot say. This is
:func:`gradpatch.differentiable`'s fix with ``step="denoise_step"`` (one velocity evaluation per Euler step)
and ``steps`` reading ``num_steps``, else the config's. Importing this module does not import torch.
"""
from __future__ import annotations

from typing import Any, Mapping


def _num_steps(arguments: Mapping[str, Any]) -> int:
    steps = arguments.get("num_steps")
    return int(arguments["self"].config.num_inference_steps if steps is None else steps)


def flow_sampler(original: Any) -> Any:
    """``sample_actions`` taking ``cache`` (default True: upstream's call), ``grad_steps``, ``checkpoint_steps``."""
    from gradpatch.sampling.generic.callables import patched

    return patched(original, "denoise_step", _num_steps, where=getattr(original, "__qualname__", repr(original)))
