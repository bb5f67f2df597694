"""Lower KV tiers, the decision side (pure Python; the bytes move in ``engine/kv/``).

* ``contract.py``: the ``KVTier`` protocol every lower tier implements, a step's orders
  (``TierOrders``: offloads, loads, saves) and the tier names;
* ``chain.py``: ``TierChain``, the paged allocator's walk over its tiers (match, claim,
  offload and save orders, hits per tier);
* ``host_index.py``: the host tier's index (which hash is in which host slot, LRU, pins);
* ``swap_space.py``: the host blocks swap preemption parks a sequence in;
* ``counts.py``: blocks and bytes each tier moved (the engine adds to it; stats read it).

The store tier's index lives with its Redis I/O (``kvstore/tier.py``).
"""
