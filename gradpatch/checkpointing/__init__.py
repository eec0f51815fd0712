"""The fixed checkpoint and its policies.

``checkpoint`` (the public entry and the factories that replace upstream's checkpoint functions),
``_recompute`` (the fast path: one autograd Function that recomputes the block in backward, and
checks that the recompute builds the graph its forward built), ``_graph_walk`` (the leaves it reads
off the forward's graph),
``_graph_path`` (the path through ``torch.utils.checkpoint`` for what the fast path cannot serve),
``plan`` (the torch-free ``budget:<size>`` knapsack and :class:`~gradpatch.checkpointing.plan.Plan`),
``budget`` (measuring blocks and applying the plan at run time) and ``_measure``.
"""
