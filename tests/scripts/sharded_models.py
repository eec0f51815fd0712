"""Models, batches, checkpoint variants and the single-process reference for ``sharded_train.py``.

AudioLDM runs in float64 through three bridges, applied the same way in the reference: the UNet's
input cast (``dtype``), ``GroupNorm32`` computing in the input's dtype (upstream computes in float32)
and ``time_embed``'s float32 sinusoid input cast to float64. F5-TTS needs only ``.double()``.
"""
from __future__ import annotations

import contextlib
import fnmatch

import torch
import torch.utils.checkpoint

from gradpatch.testing import audioldm_batch, audioldm_unet, f5_cfm, f5_inputs

LR = 0.1
STEPS = 2
TRAINABLE = {"attn2": ["*attn2*"], "all": ["*"]}


def audioldm(trainable: str, compute: torch.dtype = torch.float64) -> torch.nn.Module:
    """The tiny UNet in float64; ``compute``: the dtype its bridges cast to (bfloat16 where a
    mixed-precision policy computes in it)."""
    from audioldm.latent_diffusion import util

    util.GroupNorm32.forward = torch.nn.GroupNorm.forward
    model = audioldm_unet().double()
    model.dtype = compute
    model.time_embed.register_forward_pre_hook(lambda m, args: (args[0].to(compute),))
    for name, p in model.named_parameters():
        p.requires_grad_(any(fnmatch.fnmatch(name, pattern) for pattern in TRAINABLE[trainable]))
    return model


def audioldm_step_batch(step: int, lo: int = 0, hi: int = 4) -> dict[str, torch.Tensor]:
    batch = audioldm_batch(batch=4, seed=step)
    return {k: (v.double() if v.is_floating_point() else v)[lo:hi] for k, v in batch.items()}


def audioldm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(batch["x"], timesteps=batch["timesteps"], y=batch["y"])
    return torch.nn.functional.mse_loss(out.double(), batch["target"])


def f5(trainable: str) -> torch.nn.Module:
    model = f5_cfm().double()
    for name, p in model.named_parameters():
        p.requires_grad_(trainable == "all" or ".attn." in name)
    return model


def f5_batch(step: int, lo: int = 0, hi: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    conds, texts = zip(*(f5_inputs(seed=10 * step + i + 1) for i in range(2)))
    return torch.cat(conds).double()[lo:hi], torch.cat(texts)[lo:hi]


def f5_loss(model: torch.nn.Module, batch: tuple, options: dict) -> torch.Tensor:
    cond, text = batch
    out, _ = model.sample(cond, text, duration=12, steps=3, cfg_strength=2.0, seed=0, **options)
    return out.square().mean()


def _upstream_globals() -> list[dict]:
    from audioldm.latent_diffusion import attention, openaimodel

    return [attention.BasicTransformerBlock.forward.__globals__, openaimodel.ResBlock.forward.__globals__]


def _no_checkpoint(func, inputs, params, flag):
    return func(*inputs)


def _torch_checkpoint(func, inputs, params, flag):
    if not flag:
        return func(*inputs)
    return torch.utils.checkpoint.checkpoint(func, *inputs, use_reentrant=False)


@contextlib.contextmanager
def checkpoint_variant(variant: str):
    """``gradpatch``: what the modules hold (gradpatch's fix under GRADPATCH=1); ``torch``: torch's
    non-reentrant checkpoint; ``none``: no checkpoint; ``upstream``: gradpatch reverted."""
    import gradpatch

    if variant == "upstream":
        gradpatch.revert()
        try:
            yield
        finally:
            gradpatch.apply()  # what GRADPATCH=1 applied at start-up
        return
    spaces = _upstream_globals()
    saved = [space["checkpoint"] for space in spaces]
    replacement = {"torch": _torch_checkpoint, "none": _no_checkpoint}.get(variant)
    try:
        if replacement is not None:
            for space in spaces:
                space["checkpoint"] = replacement
        yield
    finally:
        for space, before in zip(spaces, saved):
            space["checkpoint"] = before


_REFERENCES: dict = {}


def reference(kind: str, trainable: str, options: tuple = (), steps: int = STEPS) -> tuple[list[dict], set]:
    """Per step, the gradients of one process on the whole batch without checkpointing; the names of
    the trainable tensors."""
    key = (kind, trainable, options, steps)
    if key not in _REFERENCES:
        model = audioldm(trainable) if kind == "audioldm" else f5(trainable)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=LR)
        grads = []
        with checkpoint_variant("none") if kind == "audioldm" else contextlib.nullcontext():
            for step in range(steps):
                optimizer.zero_grad(set_to_none=True)
                if kind == "audioldm":
                    audioldm_loss(model, audioldm_step_batch(step)).backward()
                else:  # one sample at a time: F5 samples a batch of two other than two of one
                    for i in range(2):
                        (f5_loss(model, f5_batch(step, i, i + 1), dict(options)) / 2).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
                optimizer.step()
        _REFERENCES[key] = (grads, {n for n, p in model.named_parameters() if p.requires_grad})
    return _REFERENCES[key]


def compare(got: list[dict[str, torch.Tensor]], kind: str, trainable: str, options: tuple = (),
            steps: int = STEPS) -> dict:
    """Largest relative error per step (near-zero gradients against a floor of 1e-3 of the largest
    one), trainable tensors without a gradient, frozen ones with one."""
    want, names = reference(kind, trainable, options, steps)
    result = {"rel": [], "missing": [], "frozen_with_grad": [], "tensors": len(names), "scale": []}
    for step, (g, r) in enumerate(zip(got, want)):
        result["scale"].append(max(t.abs().max().item() for t in r.values()))
        floor = 1e-3 * result["scale"][-1]
        worst = 0.0
        for name in names:
            if name not in g:
                result["missing"].append(f"step {step}: {name}")
                continue
            ref = r.get(name, torch.zeros_like(g[name]))
            err = (g[name].double() - ref.double()).abs().max().item()
            worst = max(worst, err / max(ref.abs().max().item(), floor))
        result["rel"].append(worst)
        result["frozen_with_grad"] += [f"step {step}: {n}" for n, t in g.items()
                                       if n not in names and t.abs().max().item() > 0]
    return result
