"""Expert parallelism: the library under mega's mixture-of-experts layers.

``local`` runs tokens through the experts a rank holds; ``dispatchers`` move tokens to the ranks
of their experts and back (the built-in ``allgather`` and ``alltoall``, registered as plugins in
``mega.plugins.parallel.moe_dispatchers``); ``aux_loss`` gives the router's load-balancing losses
their gradient; ``apply`` cuts a model's experts over the expert-parallel group.
"""
