"""Guards around the latent-diffusion family's sampling fixes (see :mod:`gradpatch.sampling.families.ldm`):
calls that cannot give gradients refuse ``cache=False`` with what to do instead, EMA weight swaps and
``cache=False`` graphs exclude each other, and sampler buffers follow the model's device.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from gradpatch.sampling.contract import sampler_entry
from gradpatch.sampling.families.ldm import EMA_MESSAGE, FAMILY, counted, ema_models, sampling_models


def refuse_cache_false(original: Callable[..., Any]) -> Callable[..., Any]:
    """Fix factory for ``LatentDiffusion.generate_sample*``: they run inside ``ema_scope``, end in numpy
    (``mel_spectrogram_to_waveform``) and pick candidates by ``argmax``, so no gradient can come out.
    Calls without the new keywords are the original's; ``cache=False``, ``grad_steps`` or
    ``checkpoint_steps`` (or any call from inside a ``cache=False`` call) raise instead of being
    swallowed by ``**kwargs``."""
    name = getattr(original, "__name__", "generate_sample")
    return sampler_entry(original, None, family=FAMILY, describe=lambda args: f"{type(args[0]).__name__}.{name}",
                         refusal="it samples inside ema_scope, converts the waveform to numpy and re-ranks "
                         "candidates by argmax. For gradients call sample_log(cond, batch_size, ddim=True, "
                         "ddim_steps=..., cache=False) (or a sampler's sample(..., cache=False)), then "
                         "decode_first_stage(samples, cache=False), outside ema_scope.")


def _bump_versions(model: Any) -> None:
    """Mark every parameter as modified in place, so autograd refuses a graph that saved it before."""
    for parameter in getattr(model, "model", model).parameters():
        torch.autograd.graph.increment_version(parameter)


def guard_ema_scope(original: Callable[..., Any]) -> Callable[..., Any]:
    """Fix factory for ``DDPM.ema_scope`` (a ``contextmanager`` swapping ``self.model``'s parameters
    with ``.data.copy_``, which autograd cannot see). With ``use_ema`` on, the replacement

    * refuses to start (RuntimeError, nothing swapped) while a ``cache=False`` call on this model is in
      progress (an ``img_callback``, a score corrector, another thread), and makes ``cache=False`` calls
      refuse to start while a scope is active (any thread: the weights are shared);
    * bumps the autograd version counter of every swapped parameter after swapping in and after
      restoring, so backpropagating any graph that lives across a swap raises autograd's "modified by
      an inplace operation" error instead of returning wrong gradients: built inside and
      backpropagated after the scope (it used the EMA weights), or built before and backpropagated
      inside (it reads them). It costs nothing numerically. A graph built and backpropagated entirely
      inside a scope, or entirely outside any, is unaffected. Trade-off: a graph built before a scope
      and backpropagated after it also raises, although the restore was exact and its gradients
      would be right: call ``backward()`` before entering ``ema_scope`` (e.g. to log EMA samples).

    The swap itself (upstream's code) is unchanged; with ``use_ema`` off the scope is upstream's.
    """

    @functools.wraps(original)
    @contextlib.contextmanager
    def ema_scope(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if not getattr(self, "use_ema", False):
            with original(self, *args, **kwargs) as value:
                yield value
            return
        if id(self) in sampling_models:
            raise RuntimeError(EMA_MESSAGE.format(what="entering ema_scope during a cache=False call",
                                                  model=type(self).__name__))
        try:
            with original(self, *args, **kwargs) as value:
                _bump_versions(self)
                with counted(ema_models, id(self)):
                    yield value
        finally:
            _bump_versions(self)

    return ema_scope


def _device_of(model: Any) -> torch.device | None:
    betas = getattr(model, "betas", None)
    if isinstance(betas, torch.Tensor):
        return betas.device
    parameters = getattr(model, "parameters", None)
    return next(iter(parameters()), torch.empty(0)).device if callable(parameters) else None


def buffers_follow_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Fix factory for a sampler's ``register_buffer(self, name, attr)`` that moves every tensor to
    ``cuda`` (CompVis SD1 and AudioLDM ``DDIMSampler``, audioldm2/AudioSR ``PLMSSampler``), which
    crashes on a machine without CUDA and splits devices for a model elsewhere. The replacement moves
    tensors to the device of ``self.model``'s schedule (``betas``, the device the sampling loop draws
    its noise on; else its parameters'), so a CPU (or MPS, or second-GPU) model gets its own and a
    model on the default CUDA device gets upstream's buffers exactly. Other values (numpy arrays) are
    stored as they are, as upstream does."""

    @functools.wraps(original)
    def register_buffer(self: Any, name: str, attr: Any) -> None:
        device = _device_of(getattr(self, "model", None))
        if device is None:
            return original(self, name, attr)
        if type(attr) == torch.Tensor and attr.device != device:  # noqa: E721 - upstream's exact test
            attr = attr.to(device)
        setattr(self, name, attr)

    return register_buffer
