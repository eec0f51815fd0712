"""torch's ``sac_ilp`` plan for a model, and that plan applied to the model (``benchmarks/peak_plan.py``).

Inputs (``Inputs``), the ones torch's ``test/distributed/_tools/test_sac_ilp.py`` makes: ``MemTracker``
over a training step (module statistics), the modules' forward and backward order (what
``aggregate_stats`` reads from a ``RuntimeEstimator``), and ``SACEstimator`` over the forward (each
module's operators, their output bytes and times, and its greedy order, ``SACGreedyOrderMeta``: the
operators by bytes discarded per millisecond of recompute, highest first). Where this departs from
torch's test: it runs them on the real model, not under ``FakeTensorMode`` (a CPU step there took 10x
a real one), with ``PeakTracker`` for ``MemTracker`` (same figures, faster), a ``ModTracker`` for the
order (``RuntimeEstimator`` refuses real tensors; its times are not used by ``sac_milp``), and each
operator's time measured once, on the device (thread CPU time on the CPU), where torch uses a roofline
model or CUDA events. ``aggregate_stats`` and ``parse_module_info`` make the graph, ``sac_milp(graph,
memory_budget=GiB, world_size=1)`` solves it: per module, checkpointed or not, and the fraction of its
operators' output bytes to discard. Modules with nothing to discard are left out (``Inputs._fit``).

Applied (``Applied``): each module the plan checkpoints runs under ``torch.utils.checkpoint(...,
use_reentrant=False)`` with ``create_selective_checkpoint_contexts``; the policy recomputes the
operators that the module's greedy order discards first until the plan's fraction of its bytes is
reached (views and the always-recomputed ops included), and saves the others (``MUST_SAVE``),
matching operators by their index in the module's forward (operators torch's SAC ignores are not
counted); an operator whose name differs from the estimator's at that index is recomputed and counted
in ``Applied.mismatches``. Modules not checkpointed run plainly; the model's own checkpoint calls must
run their function directly.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from torch.distributed._tools.ilp_utils import Graph, aggregate_stats, parse_module_info
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModState
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed._tools.sac_estimator import (
    _ADDITIONAL_IGNORED_OPS,
    SACEstimator,
    SACGreedyOrderMeta,
    SACStats,
)
from torch.distributed._tools.sac_ilp import sac_milp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

GiB = 2 ** 30
Step = Callable[[torch.nn.Module, tuple], None]  # a training step: forward, loss, backward


class PeakTracker(MemTracker):
    """torch's ``MemTracker`` with the same figures at less cost: after every operator it updates the
    peaks of the active modules only, found by name, where ``MemTracker`` walks every module it has
    seen (about 600 on the medium UNet: 97 s a step against 1.4 s without it, one CPU thread)."""

    def _update_peak_stats(self, peak_state: Any) -> None:
        stats = getattr(self, "_by_fqn", {})
        if len(stats) != len(self.memory_tracking):
            stats = self._by_fqn = {s.mod_fqn: s for s in self.memory_tracking.values()}
        current = self._curr_mem_snap
        for fqn in self._mod_tracker.parents:
            mod_stats = stats.get(fqn)
            if mod_stats is None or peak_state not in mod_stats.snapshots:
                continue
            for dev, dev_snap in current.items():
                if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                    mod_stats.snapshots[peak_state][-1][dev] = copy.deepcopy(dev_snap)
        for dev, dev_snap in current.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = copy.deepcopy(dev_snap)


class _Estimator(SACEstimator):
    """``SACEstimator`` on real tensors: each operator runs once, timed (thread CPU time, or wall time
    between synchronisations on CUDA). torch's estimator insists on ``FakeTensorMode`` and times
    operators by a roofline model or CUDA events, neither of which a CPU has."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._estimate_runtime = self._timed
        self._cuda = device.type == "cuda"

    def _timed(self, func: Any, args: tuple, kwargs: dict | None) -> tuple[Any, float]:
        if self._cuda:
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            torch.cuda.synchronize()
            return out, (time.perf_counter() - start) * 1e3
        start = time.thread_time()
        out = func(*args, **(kwargs or {}))
        return out, (time.thread_time() - start) * 1e3

    def __enter__(self) -> "_Estimator":  # SACEstimator.__enter__ without its fake-mode check
        self._mod_tracker.register_user_hooks(pre_fw_hook=self._pre_fw_hook, post_fw_hook=self._post_fw_hook)
        self._mod_tracker.__enter__()
        self._saved_tensor_hook_ctx.__enter__()
        TorchDispatchMode.__enter__(self)
        return self


def _orders(model: torch.nn.Module, batch: tuple, step: Step) -> SimpleNamespace:
    """What ``aggregate_stats`` reads from a ``RuntimeEstimator``: the modules' forward and backward
    orders (from torch's ``ModTracker``, as ``RuntimeEstimator`` records them) and their times (zero
    here: ``sac_milp`` prices recomputation with ``SACEstimator``'s operator times only)."""
    tracker = ModTracker()
    orders: dict[str, list[str]] = {k: [] for k in ("fw_pre", "fw_post", "bw_pre", "bw_post")}

    def record(key: str) -> Callable:
        return lambda module, *rest: orders[key].append(tracker.get_known_fqn(module))

    tracker.register_user_hooks(pre_fw_hook=record("fw_pre"), post_fw_hook=record("fw_post"),
                                pre_bw_hook=record("bw_pre"), post_bw_hook=record("bw_post"))
    model.zero_grad(set_to_none=True)
    with tracker:
        step(model, batch)
    return SimpleNamespace(mod_runtimes={f: {"fw": 0.0, "bw": 0.0} for f in orders["fw_pre"]},
                           **{f"mod_{k}_order": v for k, v in orders.items()})


class Inputs:
    """What ``sac_milp`` needs for ``model``: the graph, each module's ``SACStats`` and greedy order,
    and the parameters' bytes (``sac_milp``'s budget counts them; the step's peak does not). The
    model's own checkpoint calls must run their function directly while this measures."""

    def __init__(self, model: torch.nn.Module, batch: tuple, step: Step, device: torch.device) -> None:
        self.dropped: list[str] = []  # modules left out of the plan (see _fit)
        if device.type == "cuda" and device.index is None:  # MemTracker's snapshots name the index
            device = torch.device("cuda", torch.cuda.current_device())
        model.zero_grad(set_to_none=True)
        tracker = PeakTracker()
        tracker.track_external(model)
        with tracker:
            step(model, batch)
            last = tracker.get_tracker_snapshot("current")
        for stats in tracker.memory_tracking.values():  # as torch's test: modules whose inputs need
            if _ModState.POST_BW not in stats.snapshots:  # no gradient get no post-backward snapshot
                stats.snapshots.setdefault(_ModState.POST_BW, []).append(copy.deepcopy(last))
        runtime = _orders(model, batch, step)
        sac = _Estimator(device)
        model.zero_grad(set_to_none=True)
        with sac:
            step(model, batch)
        self._fit(sac)
        info = aggregate_stats(model, tracker, runtime, sac, device)  # type: ignore[arg-type]
        model.zero_grad(set_to_none=True)
        self.graph: Graph = parse_module_info(info)
        self.stats: dict[str, SACStats] = sac.sac_mod_stats
        self.orders: dict[str, SACGreedyOrderMeta] = sac.sac_mod_greedy_order_meta
        self.params = self.graph.nodes[0]["param_per_module"]

    def _fit(self, sac: SACEstimator) -> None:
        """torch's trade-off fits (``pwlf``, two segments), made before ``aggregate_stats`` asks for
        them: a module with nothing to discard (one operator: its output is always kept) divides by
        zero there and one whose fit has no finite slope breaks the ILP; such a module is fitted with
        one segment, or else left out (a leaf to the ILP: never checkpointed)."""
        for fqn, stats in list(sac.sac_mod_stats.items()):
            fit = None
            if sum(stats.memory) and sum(stats.runtimes):
                for segments in (2, 1):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        fit = sac._get_sac_tradeoff_pwlf_stats(stats, sac.sac_mod_greedy_order_meta[fqn],
                                                               n_segments=segments)
                    if all(math.isfinite(v) for v in (*fit.slopes, *fit.intercepts)):
                        break
                    fit = None
            if fit is None:
                del sac.sac_mod_stats[fqn]
                self.dropped.append(fqn)
            else:
                sac.sac_mod_tradeoff_stats[fqn] = fit
        sac.pwlf_sac_tradeoff_curve = lambda *args, **kwargs: None  # type: ignore[method-assign]

    def plan(self, peak: int, depth: int | None = None) -> tuple[dict[str, float], float, int | None]:
        """``sac_milp``'s plan for a step peak of ``peak`` bytes above the parameters: {module: fraction
        discarded}, its recompute time (ms), and the peak its model predicts for it (None: no plan).
        ``depth``: only modules at most that deep below the model may be checkpointed (its
        ``ac_units``); every module otherwise."""
        units = None if depth is None else [n["fqn"] for n in self.graph.nodes if n["fqn"].count(".") <= depth]
        decisions, recompute, bound = sac_milp(copy.deepcopy(self.graph), ac_units=units,
                                               memory_budget=(self.params + peak) / GiB, world_size=1)
        return decisions, recompute, (None if bound < 0 else self.predicted(decisions))

    def predicted(self, decisions: dict[str, float]) -> int:
        """The step's peak above the parameters under ``decisions`` by ``sac_milp``'s own model (its
        ``max_m`` is only bounded by the budget; this is the largest ``m_i`` it implies)."""
        nodes = self.graph.nodes
        discarded = {}
        for node in nodes:
            ratio = decisions.get(node["fqn"])
            acm, ia = max(node["sac_memory"], node["act_fw_per_module"]), node["act_fw_per_module"]
            discarded[node["fqn"]] = 0 if ratio is None else acm * ratio - (acm - ia)
        order = self.graph.fw_post_order
        return int(max(node["act_total"] + node["act_grad_per_module"] + node["grad_total"]
                       - sum(discarded[f] for f in order[:node["pos_fw_post_order"]]) for node in nodes))

    def baseline(self) -> int:
        """The step's peak above the parameters with no checkpoint, by ``sac_milp``'s model."""
        return self.predicted({})

    def keep(self, fqn: str, ratio: float) -> list[bool]:
        """Per operator of module ``fqn``: saved (True) or recomputed, discarding ``ratio`` of its
        bytes in the greedy order."""
        stats, order = self.stats[fqn], self.orders[fqn]

        def group(i: int) -> set[int]:
            return {i} | order.inplace_op_groups.get(i, set()) | order.random_ops_group.get(i, set())

        recompute: set[int] = set()
        for i in order.recomputed_ops:
            recompute |= group(i)
        discarded, total = sum(stats.memory[i] for i in recompute), sum(stats.memory)
        for candidate in order.msps_meta:
            if discarded >= ratio * total:
                break
            recompute |= group(candidate.op_idx)
            discarded += candidate.memory
        return [i not in recompute for i in range(len(stats.memory))]


class Applied:
    """``decisions`` applied to ``model`` while the context is entered (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, inputs: Inputs, decisions: dict[str, float]) -> None:
        self.model, self.mismatches = model, 0
        root = type(model).__name__
        self.modules = {}
        for fqn, ratio in decisions.items():
            path = fqn[len(root) + 1:] if fqn.startswith(root + ".") else ""
            self.modules[fqn] = (model.get_submodule(path), inputs.stats[fqn].func_names,
                                 inputs.keep(fqn, ratio))
        self.decisions = decisions

    def _context(self, names: list[str], keep: list[bool]) -> Callable:
        def contexts() -> Any:
            index = 0

            def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
                nonlocal index
                if op in _ADDITIONAL_IGNORED_OPS:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                i, index = index, index + 1
                if i < len(names) and op._overloadpacket.__name__ == names[i]:
                    return CheckpointPolicy.MUST_SAVE if keep[i] else CheckpointPolicy.PREFER_RECOMPUTE
                self.mismatches += 1
                return CheckpointPolicy.PREFER_RECOMPUTE

            return create_selective_checkpoint_contexts(policy)

        return contexts

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        wrapped = []
        try:
            for module, names, keep in self.modules.values():
                forward, context = module.forward, self._context(names, keep)

                def run(*args: Any, _forward: Callable = forward, _context: Callable = context,
                        **kwargs: Any) -> Any:
                    return checkpoint(_forward, *args, use_reentrant=False, context_fn=_context, **kwargs)

                module.forward = run
                wrapped.append(module)
            yield
        finally:
            for module in wrapped:
                del module.forward

    def describe(self) -> str:
        parts = [f"{fqn.split('.', 1)[-1]} (discard {self.decisions[fqn]:.2f}): keep {sum(k)}/{len(k)} ops"
                 for fqn, (_, _, k) in self.modules.items()]
        return "; ".join(parts) if parts else "nothing checkpointed"
