"""The fixed checkpoint and its policies.

``checkpoint`` (the public entry and the factories that replace upstream's checkpoint functions) hands
every call that recomputes to ``paths``, which chooses per call between ``recompute`` (the fast path:
one autograd Function that recomputes the block in backward, and checks that the recompute builds the
graph its forward built; ``graph_walk`` reads the leaves it needs off the forward's graph) and
``graph_path`` (torch's non-reentrant checkpoint, for what the fast path cannot serve); ``sharding``
finds the calls a sharding engine manages from inside, which take the graph path. ``compat`` binds
what differs between torch releases. ``budget/`` is the ``budget:<size>`` policy (one package: the
run-time ``policy``, the ``planner``, block ``key``\\s, ``measure``, the torch-free ``knapsack`` and
``report``, and ``compiled``); ``plan`` gathers its torch-free names under their public path, and
``tradeoff`` measures a user's step under each policy. ``moved`` keeps the old ``_``-named paths
importable for one release, with a ``DeprecationWarning``.
"""
