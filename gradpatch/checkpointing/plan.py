"""The ``budget:<size>`` policy's plan, torch-free: the :class:`Plan` that
:func:`gradpatch.checkpoint_plan` returns and the knapsack that chooses it. The names live in
:mod:`gradpatch.checkpointing.budget.report`, :mod:`gradpatch.checkpointing.budget.knapsack` and
:mod:`gradpatch.settings` (the size); this module gathers them under their public path.
"""
from __future__ import annotations

from gradpatch.checkpointing.budget.knapsack import Item, Shared, choose, choose_shared, kept_bytes
from gradpatch.checkpointing.budget.report import Plan, PlanEntry
from gradpatch.settings import EXAMPLE, PREFIX, budget_bytes, is_budget, parse_size

__all__ = ["Item", "Shared", "choose", "choose_shared", "kept_bytes", "Plan", "PlanEntry", "EXAMPLE",
           "PREFIX", "budget_bytes", "is_budget", "parse_size"]
