"""DiffSynth-Studio's block checkpoint: the fixed checkpoint in place of its DeepSpeed path.

``diffsynth.core.gradient.gradient_checkpoint.gradient_checkpoint_forward(model,
use_gradient_checkpointing, use_gradient_checkpointing_offload, *args, **kwargs)`` is how every DiT
of DiffSynth-Studio runs its blocks in training. When DeepSpeed's activation checkpointing is
configured (``initialize_deepspeed_gradient_checkpointing``, from an ``activation_checkpointing``
section of the DeepSpeed config) it calls ``deepspeed.checkpointing.checkpoint``, which is reentrant:
``torch.autograd.grad(loss, params)`` then raises (the parameters "appear to not have been used in the
graph"), and a block none of whose inputs requires grad (the first blocks when only LoRA weights of
later ones train; every block of a frozen-input adapter) is skipped, i.e. run without checkpointing,
all its activations kept.

:func:`gradient_checkpoint_forward` replaces it: on that path every block goes through
:func:`gradpatch.checkpointing.checkpoint.checkpoint` (recomputed in backward, RNG replayed, gradients
to every parameter that requires grad, also when no input does; ``torch.autograd.grad`` works).
DeepSpeed's own memory options on that path (``partition_activations``, ``cpu_checkpointing``,
``contiguous_memory_optimization``) do not apply to the fixed checkpoint: when one is set, the first such
call warns (:class:`~gradpatch.errors.ConfigWarning`) naming it and what to use instead
(``torch.autograd.graph.save_on_cpu()`` around the step offloads what the checkpoint keeps). Without DeepSpeed checkpointing the call is
upstream's (``torch.utils.checkpoint`` non-reentrant already, or no checkpoint).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["gradient_checkpoint_forward"]

_DEEPSPEED_OPTIONS = {"PARTITION_ACTIVATIONS": "partition_activations", "CPU_CHECKPOINT": "cpu_checkpointing",
                      "CONTIGUOUS_CHECKPOINTING": "contiguous_memory_optimization"}


def _unapplied_options(checkpointing: Any) -> None:
    from gradpatch.errors import ConfigWarning, complain

    names = [name for flag, name in _DEEPSPEED_OPTIONS.items() if getattr(checkpointing, flag, False)]
    if names:
        complain(ConfigWarning, f"gradpatch: DiffSynth's DeepSpeed block checkpoint runs gradpatch's fixed checkpoint "
                 f"(exact gradients, frozen-input blocks trained); DeepSpeed's {', '.join(names)} do not apply "
                 "to it. To offload what it keeps to CPU, run the step under "
                 "torch.autograd.graph.save_on_cpu(); to keep DeepSpeed's checkpoint (reentrant: no "
                 "torch.autograd.grad, frozen-input blocks not checkpointed), "
                 "gradpatch.revert('diffsynth.gradient_checkpoint_forward').", once=True)


def gradient_checkpoint_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """The fix factory for ``diffsynth.core.gradient.gradient_checkpoint:gradient_checkpoint_forward``."""
    from gradpatch.checkpointing.checkpoint import checkpoint

    upstream = getattr(original, "__globals__", {})  # its module's globals, read at each call

    @functools.wraps(original)
    def forward(model: Any, use_gradient_checkpointing: Any, use_gradient_checkpointing_offload: Any,
                *args: Any, **kwargs: Any) -> Any:
        deepspeed = upstream.get("deepspeed")
        if use_gradient_checkpointing and upstream.get("_HAS_DEEPSPEED") and deepspeed is not None \
                and deepspeed.checkpointing.is_configured():
            _unapplied_options(deepspeed.checkpointing)
            keys, count = tuple(kwargs), len(args)

            def block(*inputs: Any) -> Any:
                return model(*inputs[:count], **dict(zip(keys, inputs[count:])))

            return checkpoint(block, args + tuple(kwargs.values()))
        return original(model, use_gradient_checkpointing, use_gradient_checkpointing_offload, *args, **kwargs)

    return forward
