"""Wrapping a model per engine and layout, and gathering its full gradients, for ``sharded_train.py``.

Engines: ``ddp``; ``fsdp2`` (``fully_shard``; layouts ``outer``: each ResBlock and SpatialTransformer,
``inner``: each CrossAttention and FeedForward inside the checkpointed BasicTransformerBlock (F5: each
DiT block's attention and feed-forward), ``nested``: both; then the root); ``fsdp1``
(``FullyShardedDataParallel``; ``outer``: auto-wrap per TimestepEmbedSequential and SpatialTransformer,
``inner``: per CrossAttention and FeedForward); ``zero2``/``zero3`` (DeepSpeed, CPU accelerator).
Full gradients: FSDP2 ``full_tensor()``; FSDP1 the flat parameters' gradient shards all-gathered and
split (``summon_full_params(with_grads=True)`` aborts gloo on units mixing frozen and trainable
parameters); DeepSpeed ``safe_get_full_grad``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class _Plain:
    """``backward``/``step`` for the torch engines: the loss's backward, the optimizer's step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()


class _DeepSpeed:
    def __init__(self, engine) -> None:
        self.engine = engine

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


def _inner_classes(model: torch.nn.Module) -> tuple[type, ...]:
    if type(model).__name__ == "CFM":
        from f5_tts.model.modules import Attention, FeedForward

        return Attention, FeedForward
    from audioldm.latent_diffusion.attention import CrossAttention, FeedForward

    return CrossAttention, FeedForward


def _outer_classes(model: torch.nn.Module) -> tuple[type, ...]:
    if type(model).__name__ == "CFM":
        from f5_tts.model.modules import DiTBlock

        return (DiTBlock,)
    from audioldm.latent_diffusion.attention import SpatialTransformer
    from audioldm.latent_diffusion.openaimodel import ResBlock

    return ResBlock, SpatialTransformer


def wrap(cell: dict, model: torch.nn.Module):
    """(the model to call, the engine zeroing, backpropagating and stepping)."""
    engine = cell["engine"]
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, **cell.get("kwargs", {}))
    elif engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw = dict(mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                  reshard_after_forward=cell.get("reshard", True))
        if cell.get("bf16"):
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if cell.get("offload"):
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        layout = cell["layout"]
        classes = (_inner_classes(model) if layout in ("inner", "nested") else ()) + \
                  (_outer_classes(model) if layout in ("outer", "nested") else ())
        for m in reversed(list(model.modules())):  # children before parents
            if isinstance(m, classes):
                fully_shard(m, **kw)
        root = model.transformer if type(model).__name__ == "CFM" else model
        fully_shard(root, **kw)
        wrapped = model
    elif engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        if cell["layout"] == "outer":
            from audioldm.latent_diffusion.attention import SpatialTransformer
            from audioldm.latent_diffusion.openaimodel import TimestepEmbedSequential

            classes = {TimestepEmbedSequential, SpatialTransformer}
        else:
            classes = set(_inner_classes(model))
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy(classes),
                                           use_orig_params=cell.get("orig", True), device_id=torch.device("cpu"))
    elif engine in ("zero2", "zero3"):
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": int(engine[-1])}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10 ** 9}
        ds_engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable(model), lr=0.1),
                                                  config=config)
        return ds_engine, _DeepSpeed(ds_engine)
    else:
        raise ValueError(engine)
    optimizer = torch.optim.SGD(trainable(wrapped), lr=0.1)
    return wrapped, _Plain(optimizer)


@contextlib.contextmanager
def sync(cell: dict, wrapped, last: bool):
    """Gradient accumulation: DDP's ``no_sync()``; FSDP2's ``set_requires_gradient_sync``."""
    if cell["engine"] == "ddp" and not last:
        with wrapped.no_sync():
            yield
        return
    if cell["engine"] == "fsdp2" and cell.get("accumulate"):
        root = wrapped.transformer if type(wrapped).__name__ == "CFM" else wrapped
        root.set_requires_gradient_sync(last)
    yield


def full_grads(cell: dict, wrapped, names: list[str]) -> dict[str, torch.Tensor]:
    engine = cell["engine"]
    if engine == "fsdp1":
        return _fsdp1_grads(wrapped)
    if engine.startswith("zero"):
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in wrapped.module.named_parameters():
            if p.requires_grad:
                g = safe_get_full_grad(p)
                if g is not None:
                    out[name] = g.clone().double()
        return out
    module = wrapped.module if engine == "ddp" else wrapped
    params = list(module.named_parameters())
    flags = torch.tensor([p.grad is not None for _, p in params], dtype=torch.int64)
    dist.all_reduce(flags)
    out = {}
    for (name, p), n in zip(params, flags.tolist()):
        if n != dist.get_world_size():
            if n:
                out[name] = torch.full(p.shape, float("nan"))  # a gradient on some ranks only
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().clone().double()
    return out


def _fsdp1_grads(wrapped) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    prefixes = {id(m): n for n, m in wrapped.named_modules()}
    out = {}
    for unit in FSDP.fsdp_modules(wrapped):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        local = flat.grad if flat.grad is not None else torch.zeros_like(flat)
        has = torch.tensor([flat.grad is not None], dtype=torch.int64)
        dist.all_reduce(has)
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, local.contiguous())
        if not has.item():
            continue
        full = torch.cat(shards)
        prefix = prefixes[id(unit)]
        # With use_orig_params=True a unit may mix frozen and trainable parameters: FSDP computes the
        # whole flat gradient and exposes it only on the parameters that require grad.
        originals = iter(getattr(flat, "_params", None) or [None] * len(flat._fqns))
        offset, fqns = 0, iter(flat._fqns)
        for numel, padding, shape in _segments(flat):
            if not padding:
                name = ".".join(x for x in (prefix, next(fqns)) if x).replace("_fsdp_wrapped_module.", "")
                original = next(originals)
                if original is None or original.requires_grad or original.grad is not None:
                    out[name] = full[offset:offset + numel].view(shape).double()
            offset += numel
    return out


def _segments(flat):
    shapes = iter(flat._shapes)
    for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        yield numel, padding, None if padding else next(shapes)


def compare_runs(got: list[dict], want: list[dict]) -> dict:
    """Largest relative difference per step between two runs of a cell (floor: 1e-3 of the largest)."""
    result = {"rel": [], "missing": [], "frozen_with_grad": [], "tensors": len(want[0]), "scale": []}
    for step, (g, r) in enumerate(zip(got, want)):
        result["scale"].append(max(t.abs().max().item() for t in r.values()))
        floor = 1e-3 * result["scale"][-1]
        result["missing"] += [f"step {step}: {n}" for n in r if n not in g]
        result["frozen_with_grad"] += [f"step {step}: {n}" for n in g if n not in r]
        result["rel"].append(max((g[n] - r[n]).abs().max().item() / max(r[n].abs().max().item(), floor)
                                 for n in r if n in g))
    return result
