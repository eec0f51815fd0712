"""The ``peak:<size>`` plan (:mod:`gradpatch.checkpointing.budget.peak`) as :func:`gradpatch.checkpoint_plan`
reports it."""
from __future__ import annotations

import torch

from gradpatch import settings
from gradpatch.checkpointing.budget.peak import PEAK, settle
from gradpatch.checkpointing.budget.peak_choice import KEEP, RECOMPUTE
from gradpatch.checkpointing.budget.planner import PLANNER
from gradpatch.checkpointing.budget.report import Plan, PlanEntry


def report(model: torch.nn.Module | None, policy: str) -> Plan:
    """:func:`gradpatch.checkpoint_plan` under ``peak:<size>``."""
    with PEAK.lock:
        if PEAK.recording is not None and PEAK.recording.ended:
            settle()
        if PEAK.recorded is not None and PEAK.epoch == PLANNER.epoch \
                and PEAK.solved_for != settings.peak_bytes(policy):
            PEAK.solve(settings.peak_bytes(policy))
        planned = PEAK.recorded is not None and PEAK.epoch == PLANNER.epoch
        paths_in = {id(m): p for p, m in model.named_modules()} if model is not None else None
        entries = []
        for owner, block in PLANNER.live():
            if paths_in is not None and id(owner) not in paths_in:
                continue
            name = block.name if paths_in is None else f"{paths_in[id(owner)]}.{block.name.split('.')[-1]}"
            known = block.measured and not block.opaque
            choice = PEAK.choices.get(block, RECOMPUTE) if planned else RECOMPUTE
            opts = {o.kind: o for o in PEAK.options.get(block, ())}
            shown = opts.get(choice if choice != RECOMPUTE else KEEP)
            size = shown.bytes if shown is not None else block.bytes if known else None
            seconds = shown.seconds if shown is not None else block.seconds if known else None
            entries.append(PlanEntry(name, size, seconds, choice != KEEP, block.measured,
                                     block.why if block.opaque else None, choice))
        plan = Plan(entries)
        plan.policy, plan.budget = policy, settings.peak_bytes(policy)
        if PEAK.unrecorded:
            plan.unrecorded = ("no step can be recorded (it begins inside compiled code: a compiled function "
                               "that calls the model; compile the model itself, torch.compile(model))")
        if planned:
            plan.smallest_peak, plan.largest_peak = PEAK.floor, PEAK.ceiling
            # Once the plan's first step is recorded, its peak is the prediction for the next steps.
            plan.predicted_peak = PEAK.realised if PEAK.realised is not None else PEAK.predicted
        return plan
