"""The training step's peak memory and what the forward keeps, by independent measures side by side.

Run:  PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/memory_truth.py [--model medium|audioldm]
      [--batch N] [--no-memtracker] [--device cuda]

Models (``checkpoint_speed.py`` builds them, every parameter trainable so that upstream V1 runs, every
block checkpointed): the medium UNet of ``checkpoint_budget.py`` at batch 8, and AudioLDM-S's UNet
narrowed to 32 channels (``checkpoint_budget.py --model audioldm``: 10 s of audio, batch 2). Variants:
no checkpoint (``never``), gradpatch's fixed checkpoint under ``respect``, the same as it was before
its forward ran under saved-tensor hooks of its own (``respect-before``, for the record), torch's
``checkpoint(use_reentrant=False)``, upstream V1 (the CompVis ``CheckpointFunction``) and ``budget:``
at half the gap between ``respect``'s and ``never``'s kept bytes.

Measures, all relative to what was allocated when the step's forward began:

* **allocator**: the profiler's allocation events (``profile_memory=True``), each free matched to its
  allocation by address; the peak of the running sum, and what is still allocated after the forward
  (the loss's graph). The CPU allocator reports exactly the bytes requested. Allocations made before
  the profiler started never appear, so parameters do not count; gradients do.
* **MemTracker**: ``torch.distributed._tools.mem_tracker.MemTracker`` (its peak ``Total`` minus the
  parameters it tracked at the start). It sees storages made by operators under its dispatch mode and
  notices frees through weak references to them.
* **allocator under MemTracker**: the first measure taken while MemTracker runs. MemTracker is not a
  passive observer: its ``ModTracker`` registers ``register_multi_grad_hook`` on every module's inputs
  and outputs, and those hooks tie each module's part of the autograd graph into a reference cycle
  (node -> hook -> the hooks' list of nodes -> node), which only the garbage collector frees.
* **CUDA** (``--device cuda``): ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.

Disagreements, explained. Figures measured before the fix below (medium UNet, batch 8, CPU, one
thread, torch 2.14; MiB above the step's start, parameters excluded), allocator / MemTracker:
``never`` 111.7 / 110.7, ``respect`` 79.1 / 135.0, torch's checkpoint 78.7 / 80.9, V1 78.9 / 81.2.

* MemTracker put ``respect``'s peak 54 MiB above torch's checkpoint (199 against 145 MiB with the
  parameters; 203 against 145 in the report that asked), the allocator without MemTracker 0.4 MiB above.
  Both were right about what they measured: gradpatch's fast path builds the block's graph in its
  forward and drops it, and under MemTracker the hooks' reference cycles kept that dropped graph, with
  every activation it saved, until the collector ran, so ``respect`` really held 64 MiB of activations
  at the peak there, as the allocator measured under MemTracker confirms (tiny UNet, every block
  checkpointed, batch 4: 13.7 MiB kept after the forward under MemTracker against 3.0 MiB for torch's
  checkpoint and 3.0 MiB for ``respect`` without it). Torch's checkpoint saves no activations in its
  forward graph (its own saved-tensor hooks), so cycles cost it nothing. Any code making such cycles
  (profilers' module hooks, FSDP-like wrappers) hit it too. The fast path's forward now runs under
  saved-tensor hooks of its own that drop what it saves (``gradpatch.checkpointing.saves``): rows
  ``respect`` and ``respect-before`` show the change, and all three measures then agree.
* After the fix (``--model medium --batch 2 --variants respect,torch-NR,respect-before``; peak / kept after
  the forward, MiB): ``respect`` allocator 65.3 / 4.7, MemTracker 66.3 / 4.6, allocator under MemTracker
  66.7 / 4.7; torch's checkpoint 65.2 / 4.7, 66.4 / 4.6, 66.7 / 4.7; ``respect-before`` 65.3 / 4.7,
  80.3 / 16.8, 81.1 / 17.4 (its activations alive under MemTracker only).
* What remains between ``respect`` and torch's checkpoint at the allocator (0.4 MiB here, at most one
  block output: ``tests/checkpointing/test_checkpoint_memory.py``): autograd holds a Python node's
  incoming gradient while its backward (the recompute and the inner backward) runs.
* Max RSS (163 / 344 / 206 MiB in the report) orders nothing: it is the process's high-water mark
  since it started, never reset between variants, and glibc's allocator keeps freed pages mapped
  (fragmentation, arenas), so it depends on what ran earlier in the process; this script does not use it.
* MemTracker against the allocator where both see the same tensors alive (``never``, torch's
  checkpoint, V1: within 1 to 2.5 MiB): MemTracker counts the storages operators return under its
  dispatch mode, each at its full size, from its hooks' points of view (a peak it updates per operator),
  while the allocator sees every request, including those made outside the dispatcher (the checkpoint's
  5 KB CPU RNG state, autograd's gradient accumulation buffers), at the instant they happen.
* ``budget:`` runs its measuring steps first (planned on the allocator's bytes after the forward), then
  the measured step; a gap between the measures there follows the same reasons.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_budget as cb  # noqa: E402  (also defines the "audioldm" model)
import checkpoint_speed as speed  # noqa: E402

from gradpatch.checkpointing import checkpoint as fixed  # noqa: E402
from gradpatch.checkpointing import recompute  # noqa: E402

MiB = 2 ** 20


@contextlib.contextmanager
def before_fix() -> Iterator[None]:
    """The fast path as it was: its forward's saves held by the forward's graph."""
    saved = recompute.forward_saves
    recompute.forward_saves = lambda held: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        yield
    finally:
        recompute.forward_saves = saved  # type: ignore[assignment]


def step(model: torch.nn.Module, batch: tuple, after_forward: list) -> None:
    out = speed.forward(model, batch)
    loss = out.float().square().mean()
    del out
    after_forward.append(_now())
    loss.backward()


_MARKS: list[Callable[[], int]] = []


def _now() -> int:
    return _MARKS[-1]() if _MARKS else 0


def allocator(fn: Callable[[list], None]) -> tuple[int, int]:
    """(peak, kept after the forward) from the profiler's allocation events matched by address."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    marks: list[int] = []
    with speed.quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _MARKS.append(_mark)
        try:
            fn(marks)
        finally:
            _MARKS.pop()
    events, stack, mark = [], list(prof.profiler.kineto_results.experimental_event_tree()), None
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name == "##forward-end##":
            mark = node.start_time_ns
    live: dict[int, int] = {}
    now = peak = kept = 0
    for t, ptr, size in sorted(events):
        if mark is not None and t >= mark and kept == 0:
            kept = now
        if size > 0:
            live[ptr] = size
            now += size
        elif ptr in live:
            now -= live.pop(ptr)
        peak = max(peak, now)
    return peak, kept


def _mark() -> int:
    """A zero-length profiler range where the forward ends (read back from the events)."""
    with torch.profiler.record_function("##forward-end##"):
        pass
    return 0


def memtracker(fn: Callable[[list], None], model: torch.nn.Module,
               inner: Callable[[Callable[[list], None]], Any] | None = None) -> tuple[int, int, Any]:
    """(peak, kept after the forward) by MemTracker; ``inner``: a measure run inside it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model.zero_grad(set_to_none=True)  # the start: parameters, no gradients
    tracker = MemTracker()
    tracker.track_external(model)
    start = _total(tracker.get_tracker_snapshot("current"))
    marks: list[int] = []
    with tracker:
        _MARKS.append(lambda: _total(tracker.get_tracker_snapshot("current")) - start)
        try:
            result = inner(fn) if inner else fn(marks)
        finally:
            _MARKS.pop()
    peak = _total(tracker.get_tracker_snapshot("peak")) - start
    return peak, (marks[0] if marks else -1), result


def _total(snapshot: dict) -> int:
    return sum(device.get("Total", 0) for device in snapshot.values())


def cuda_peak(fn: Callable[[list], None], model: torch.nn.Module) -> tuple[int, int]:
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _MARKS.append(lambda: torch.cuda.memory_allocated() - before)
    marks: list[int] = []
    try:
        fn(marks)
    finally:
        _MARKS.pop()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, marks[0]


VARIANTS = ["never", "respect", "respect-before", "torch-NR", "V1", "budget 50%"]


def table(name: str, batch_size: int | None, with_tracker: bool, variants: list[str]) -> None:
    kwargs, shape, n = speed.MODELS[name]
    model, batch = speed.build(dict(kwargs, use_checkpoint=True), shape, batch_size or n)
    ckpt = fixed.replace_checkpoint(speed.V1)
    speed.VARIANTS.clear()
    speed.VARIANTS.update(cb.BASE)
    speed.VARIANTS["respect-before"] = (ckpt, "respect")
    kept = {}
    for variant in ("respect", "never"):
        with speed.use(variant):
            kept[variant] = speed.saved_bytes(model, batch)
    size = (kept["never"] - kept["respect"]) // 2
    speed.VARIANTS["budget 50%"] = (ckpt, cb.budget_policy(size))
    if "budget 50%" in variants:
        cb.budget.reset()
        cb.measure_plans(model, batch, size)
    print(f"\n== {name}: batch {batch_size or n}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters ({sum(p.numel() * p.element_size() for p in model.parameters()) / MiB:.1f} MiB), "
          f"every block checkpointed; MiB above the step's start ==")
    head = f"{'variant':15} {'peak':>8} {'kept':>8}"
    if with_tracker:
        head += f" | {'MemTracker peak':>15} {'kept':>8} | {'allocator under MT: peak':>24} {'kept':>8}"
    if speed.DEVICE.type == "cuda":
        head += f" | {'CUDA peak':>10} {'kept':>8}"
    print(head)
    for variant in variants:
        def run(marks: list) -> None:
            model.zero_grad(set_to_none=True)
            step(model, batch, marks)

        context = before_fix() if variant == "respect-before" else contextlib.nullcontext()
        with speed.use(variant), context:
            run([])  # warm up
            model.zero_grad(set_to_none=True)
            gc.collect()
            peak, after = allocator(run)
            row = f"{variant:15} {peak / MiB:8.1f} {after / MiB:8.1f}"
            if with_tracker:
                gc.collect()
                mt_peak, mt_kept, _ = memtracker(run, model)
                gc.collect()
                _, _, (a_peak, a_kept) = memtracker(run, model, allocator)
                row += (f" | {mt_peak / MiB:15.1f} {mt_kept / MiB:8.1f} | {a_peak / MiB:24.1f} "
                        f"{a_kept / MiB:8.1f}")
            if speed.DEVICE.type == "cuda":
                c_peak, c_kept = cuda_peak(run, model)
                row += f" | {c_peak / MiB:10.1f} {c_kept / MiB:8.1f}"
        print(row, flush=True)
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("medium", "audioldm"), help="only this model")
    parser.add_argument("--batch", type=int, help="batch size (default: 8 for medium, 2 for audioldm)")
    parser.add_argument("--no-memtracker", action="store_true", help="the allocator only (MemTracker is slow)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    args = parser.parse_args()
    speed.DEVICE = torch.device(args.device)
    torch.set_num_threads(1)
    for name in [args.model] if args.model else ["medium", "audioldm"]:
        batch = args.batch or (8 if name == "medium" else None)
        table(name, batch, not args.no_memtracker, args.variants.split(","))


if __name__ == "__main__":
    main()
