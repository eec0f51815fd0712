"""Where the fixed checkpoint's extra time goes: its forward, piece by piece, against upstream V1's.

Run:  PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/checkpoint_cost.py
      [--model tiny|medium|audioldm-s] [--device cpu|cuda] [--rounds N] [--quick]

The checkpointed calls of one training step of AudioLDM's UNet (``checkpoint_speed.py`` builds it)
are recorded once, then replayed, interleaved in a fresh random order every round:

* ``no_grad``: the blocks' forwards under ``torch.no_grad()``, as upstream V1's forward runs them;
* ``graph``: the same with grad mode on, building (and freeing) the graph, as the fix's forward must
  for a block to see what its recompute sees;
* ``graph + walk``: plus the walk that finds the leaves the outputs depend on;
* ``fixed``: the fix's whole fast-path forward (``recompute.attempt``);
* ``V1``: upstream's ``CheckpointFunction.apply``.

Then real training steps of V1 and the fix, interleaved, with the time spent in the checkpoint nodes'
backward. Times are CPU-side (``time.perf_counter``; one thread on the CPU): on CUDA, kernels are
queued, not waited for, so this is the launching cost that bounds small GPU steps. Medians over rounds.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_speed as speed  # noqa: E402

from gradpatch.checkpointing import graph_walk, recompute  # noqa: E402

CheckpointFunction = speed.util.CheckpointFunction


def record_calls(model: torch.nn.Module, batch: tuple) -> list[tuple[Callable, tuple, list]]:
    """(function, inputs, parameters) of every call upstream asks to checkpoint in one forward."""
    calls = []

    def grab(func, inputs, params, flag):
        if flag:
            calls.append((func, tuple(inputs), list(params)))
        return func(*inputs)

    speed.VARIANTS["record"] = (grab, "respect")
    with speed.use("record"):
        speed.forward(model, batch)
    del speed.VARIANTS["record"]
    return calls


def replay(kind: str, calls: list) -> None:
    if kind == "no_grad":
        with torch.no_grad():
            for func, inputs, _ in calls:
                func(*inputs)
    elif kind == "graph":
        for func, inputs, _ in calls:
            func(*inputs)
    elif kind == "graph + walk":
        for func, inputs, _ in calls:
            start = recompute.sequence_nr()
            out = func(*inputs)
            graph_walk.sources([out], start, recompute.sequence_nr(),
                                [t for t in inputs if t.requires_grad])
    elif kind == "fixed":
        for func, inputs, _ in calls:
            recompute.attempt(func, inputs, None)
    elif kind == "V1":
        for func, inputs, params in calls:
            CheckpointFunction.apply(func, len(inputs), *inputs, *params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "medium", "audioldm-s"), default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="10 rounds")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 10
    speed.DEVICE = torch.device(args.device)
    if args.device == "cpu":
        torch.set_num_threads(1)
    model, batch = speed.build(*speed.MODELS[args.model])
    calls = record_calls(model, batch)
    nodes = 0
    for func, inputs, _ in calls:
        start = recompute.sequence_nr()
        func(*inputs)
        nodes += recompute.sequence_nr() - start
    print(f"{args.model} on {args.device}: {len(calls)} checkpointed calls a step, {nodes} autograd "
          f"nodes in their forwards; CPU-side ms a step, medians of {args.rounds} rounds")
    kinds = ["no_grad", "graph", "graph + walk", "fixed", "V1"]
    times: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(args.rounds):
        for kind in random.sample(kinds, len(kinds)):
            start = time.perf_counter()
            replay(kind, calls)
            times[kind].append(time.perf_counter() - start)
    for kind in kinds:
        print(f"  forward, {kind:13} {statistics.median(times[kind]) * 1e3:9.3f}")

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(key: str, backward: Callable) -> staticmethod:
        def wrapper(*args):
            start = time.perf_counter()
            try:
                return backward(*args)
            finally:
                spent[key] += time.perf_counter() - start
        return staticmethod(wrapper)

    saved = recompute.Recompute.backward, CheckpointFunction.backward
    recompute.Recompute.backward = timed("fixed", saved[0])
    CheckpointFunction.backward = timed("V1", saved[1])
    steps: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for _ in range(max(args.rounds // 2, 10)):
            for variant in random.sample(["V1", "fixed"], 2):
                spent.clear()
                with speed.use(variant):
                    steps[f"step, {variant}"].append(speed.step(model, batch))
                steps[f"nodes' backward, {variant}"].append(spent[variant])
    finally:
        recompute.Recompute.backward, CheckpointFunction.backward = saved
    for key in sorted(steps):
        print(f"  {key:22} {statistics.median(steps[key]) * 1e3:9.3f}")


if __name__ == "__main__":
    main()
