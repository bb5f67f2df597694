"""The shared KV store tier: full blocks in Redis, keyed by page format and chained hash.

``codec`` (key and payload format, checksums), ``address`` (``redis://HOST:PORT`` checked at
the edge), ``client`` (a Redis that is down or slow is a miss, logged once, counted),
``writer`` (write-through off the step's thread), ``tier`` (the allocator's "store" tier:
verify, stage, hand verified bytes to the engine). Pure Python: no torch here; the engine's
``engine/kv/block_copy.py`` turns device blocks into bodies and back.
"""

from pagedkv.kvstore.address import StoreAddress, parse_store_url

__all__ = ["StoreAddress", "parse_store_url"]
