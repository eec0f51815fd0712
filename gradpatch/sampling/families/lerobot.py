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


_SMOLVLA_GRAD_STEPS = (
    "VLAFlowMatching.sample_actions(cache=False): grad_steps is not offered for SmolVLA: its denoise_step "
    "appends the suffix to the prefix's key/value cache and crops it back every step (DynamicCache.update, "
    "crop), so the steps run without grad would leave the cache holding slices without the prefix's graph, "
    "and the gradients to the VLM and the state would be wrong. Use the whole graph or checkpoint_steps=True")


def smolvla_sampler(original: Any) -> Any:
    """SmolVLA's ``sample_actions``: ``cache``, ``checkpoint_steps`` (one ``denoise_step`` per Euler step,
    ``self.config.num_steps`` of them); ``grad_steps`` raises (see the message)."""
    from gradpatch.sampling.generic.callables import patched

    made = patched(original, "denoise_step", "self.config.num_steps", where=getattr(original, "__qualname__", ""))

    def sample_actions(self: Any, *args: Any, grad_steps: Any = None, **kwargs: Any) -> Any:
        if grad_steps is not None:
            raise ValueError(_SMOLVLA_GRAD_STEPS)
        return made.__get__(self)(*args, **kwargs)

    sample_actions.__wrapped__ = original  # type: ignore[attr-defined]
    sample_actions.__qualname__ = getattr(original, "__qualname__", "sample_actions")
    sample_actions.__doc__ = getattr(original, "__doc__", None)
    return sample_actions
