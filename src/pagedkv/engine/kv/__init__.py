"""KV movement, the bytes side (torch; the decisions are in ``kvcache/tiers/``).

* ``mover.py``: ``KVMover``, the one object the runner calls before and after the forward pass
  (offloads, swaps, copy-on-write copies, loads; then saves), with the per-tier counts;
* ``block_copy.py``: the block-row copies every kind of move uses, and blocks <-> bytes;
* ``host_pool.py``: host memory in the device pool's layout, under both of these:
* ``swap_pool.py``: the host swap pool (swap preemption);
* ``host_tier.py``: the host tier's tensors (evicted prefix blocks);
* ``store.py``: the store tier's executor (the Redis I/O is ``kvstore/``'s);
* ``setup.py``: start-up (sizes the host tier, attaches the tiers to allocator and mover);
* ``events.py``: the engine's KV events (``--kv-events``) and the replica's self-description;
* ``identity.py``: the digest of the weights that names shared KV.
"""
