"""``RoutedHints``: the prompt blocks this router sent to each replica lately, counted as held
there until they expire.

Why: a replica reports its cache through Serve's stats poll (``stats.py``), seconds after a
request arrives when the machine is busy: the blocks exist only once the replica has computed
the prompt, and the report follows at the next poll and broadcast. Without hints every turn
of a conversation that arrives in that window is routed as if no replica held its history
(measured at saturation: 15 of 50 requests; docs/ray_serve.md). SGLang's router keeps the
same kind of tree of what it sent. A hint is only a hint: it expires after ``ttl_s`` seconds
(the replica's own report has taken over by then, or the blocks were evicted), and a wrong
one costs one recomputed prefix, never a wrong answer.

Bounded: at most ``max_blocks`` hashes per replica (the oldest go first). Not thread-safe (the
router's event loop owns it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from pagedkv.kvcache.hashing import BlockHash

DEFAULT_TTL_S = 60.0
DEFAULT_MAX_BLOCKS = 1 << 16


class RoutedHints:
    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl_s > 0 or max_blocks < 1:
            raise ValueError(f"ttl_s must be > 0 and max_blocks >= 1, got {ttl_s}, {max_blocks}")
        self.ttl_s, self.max_blocks, self._clock = ttl_s, max_blocks, clock
        self._sent: dict[str, OrderedDict[BlockHash, float]] = {}  # oldest first

    def add(self, replica: str, block_hashes: Sequence[BlockHash]) -> None:
        """``replica`` was sent a prompt of these blocks now."""
        sent = self._sent.setdefault(replica, OrderedDict())
        now = self._clock()
        for h in block_hashes:
            sent[h] = now
            sent.move_to_end(h)
        while len(sent) > self.max_blocks:
            sent.popitem(last=False)

    def match(self, block_hashes: Sequence[BlockHash], replicas: Iterable[str]) -> dict[str, int]:
        """Replica -> the leading blocks of ``block_hashes`` sent there within ``ttl_s``
        (replicas with none are absent). Expired hints are dropped first."""
        out: dict[str, int] = {}
        for replica in replicas:
            sent = self._fresh(replica)
            n = 0
            while n < len(block_hashes) and block_hashes[n] in sent:
                n += 1
            if n:
                out[replica] = n
        return out

    def forget(self, replica: str) -> None:
        self._sent.pop(replica, None)

    def num_blocks(self, replica: str) -> int:
        return len(self._fresh(replica))

    def _fresh(self, replica: str) -> OrderedDict[BlockHash, float]:
        sent = self._sent.get(replica)
        if sent is None:
            return OrderedDict()
        horizon = self._clock() - self.ttl_s
        while sent and next(iter(sent.values())) < horizon:
            sent.popitem(last=False)
        return sent
