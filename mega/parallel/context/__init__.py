"""Context parallelism (``--context-parallel-size``): every sequence split over the ``cp`` group.

Each rank holds ``1/cp`` of every sequence, balanced for causal attention as in Megatron: the
sequence is cut into ``2*cp`` chunks and rank ``r`` holds chunks ``r`` and ``2*cp-1-r``
(:mod:`.layout`, which also cuts a micro-batch on the host and weights each rank's loss). Only
attention needs other ranks' positions; the communication types that bring them are registered
plugins (``--cp-comm-type``) built on this library:

- ``p2p`` (:mod:`.ring`): keys and values travel around the ring, each block's attention
  computed while the next block is in flight, partial results merged by their log-sum-exp;
- ``all_gather`` (:mod:`.gather`): every rank gathers all keys and values, computes its own
  queries' attention, and the key/value gradients are reduce-scattered back;
- ``a2a`` (:mod:`.ulysses`): an all-to-all trades the sequence split for a split of the heads,
  the whole sequence's attention runs on ``heads/cp`` heads, and a second all-to-all trades back.

:mod:`.apply` puts the chosen type in place of the model's core attention (the plan's
``core_attention``). Gradients are summed over ``cp`` and averaged over ``dp`` (the topology's
``dpcp`` group), since each rank's loss is its share of the micro-batch's loss.
"""
