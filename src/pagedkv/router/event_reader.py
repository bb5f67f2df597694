"""``KVEventReader``: one replica's KV event stream, read from Redis on a daemon thread.

A replica started with ``--kv-events redis://HOST:PORT`` appends one entry per engine step to
the Redis stream ``pagedkv:kv-events:<instance_id>`` (field ``batch``: a
``KVEventBatch.to_json()``; ``GET /pagedkv/info`` names the URL and the stream; the format is in
docs/kv_events.md). The reader ``XREAD``s from ``start_id`` (``"0"``: the stream's start, so a
router started late or restarted replays the retained history, which holds a full snapshot),
decodes each entry and calls ``on_batch`` with it, in stream order, on the reader's thread.

Contracts:

* ``on_batch`` sees every well-formed entry once, in order. Entries are untrusted (anyone
  with access to Redis may write one): an entry that does not decode (no ``batch`` field, not
  a batch this version wrote, over the caps of ``kvcache/event_wire.py``: size, nesting, numbers,
  ``MAX_HASHES_PER_ENTRY``) is skipped and counted (``num_malformed``, by kind in
  ``malformed_by_kind``; the first of each kind is logged). Nothing an entry holds, and no
  exception from ``on_batch``, ends the reader: it logs and goes on.
* A stream reset (deleted and written anew, e.g. by its publisher after Redis refused it for
  good, or a Redis restarted empty) would leave a reader waiting after an id the new stream
  may never reach. So after every read that returns nothing, the reader compares the stream's
  newest id with the last one it read: when the stream is gone or its newest entry is older,
  it was reset, and the reader starts over from ``"0"`` (``num_resets``, logged once). The new
  stream begins with a snapshot (``AllBlocksCleared`` first), which replaces the replica's
  view.
* Redis down or unreachable: ``connected`` turns False, ``last_error`` says why (logged once per
  outage), and the reader retries with the shared back-off (``kvstore/redis_policy.py``);
  once it answers again it continues after the last entry it read, so
  nothing still in the stream is missed or seen twice.
* ``stop()`` returns within about ``block_ms`` (plus a socket timeout when Redis hangs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pagedkv.kvcache.events import KVEventBatch
from pagedkv.kvstore.address import parse_store_url
from pagedkv.kvstore.redis_policy import Backoff, RedisPolicy
from pagedkv.untrusted import UntrustedInput

log = logging.getLogger("pagedkv.router")

BATCH_FIELD = b"batch"
# Entries per XREAD: bounds one call's reply (at most this many entries, each refused past
# MAX_ENTRY_BYTES right after), not the rate.
READ_COUNT = 64
UNEXPECTED = "unexpected"  # the kind of a decoding failure that is not an UntrustedInput


class KVEventReader:
    """Reads one stream; ``num_batches``, ``num_malformed``, ``num_resets``, ``connected`` and
    ``last_error`` may be read from any thread (each is one attribute written by the reader's
    thread)."""

    def __init__(
        self,
        url: str,
        stream: str,
        on_batch: Callable[[KVEventBatch], None],
        *,
        start_id: str = "0",
        block_ms: int = 200,
        policy: RedisPolicy | None = None,
    ) -> None:
        """``url``: ``redis://HOST:PORT[/DB]``; ``stream``: the replica's stream name;
        ``start_id``: the entry id to read after (``"0"`` = from the start, ``"$"`` = only new
        entries); ``block_ms`` (>= 1): how long one XREAD waits for new entries. A ``url``
        that is not ``redis://HOST[:PORT][/DB]`` is a ``ValueError``."""
        import redis  # the engine extra's dependency, imported only when a reader is built

        if block_ms < 1:
            raise ValueError(f"block_ms must be >= 1, got {block_ms}")
        self.url, self.stream, self.block_ms = url, stream, block_ms
        self._on_batch = on_batch
        self._errors = (redis.RedisError, OSError)
        # A blocked XREAD is silent for block_ms: the socket timeout must be longer than that.
        self._redis = parse_store_url(url).connect(policy, blocking_read_s=block_ms / 1000)
        self._backoff = Backoff(policy)
        self.last_id: str = start_id
        self.num_batches = 0
        self.num_malformed = 0
        self.malformed_by_kind: dict[str, int] = {}
        self.num_resets = 0
        self.connected = False
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_info(
        cls, kv_events: dict, on_batch: Callable[[KVEventBatch], None], **kwargs
    ) -> KVEventReader:
        """A reader of the ``kv_events`` object of a replica's ``GET /pagedkv/info``."""
        return cls(kv_events["url"], kv_events["stream"], on_batch, **kwargs)

    def start(self) -> KVEventReader:
        """Start the daemon thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the reader was started already")
        self._thread = threading.Thread(
            target=self._run, name=f"pagedkv-kv-events-{self.stream}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the thread and close the connection; waits up to ``timeout_s`` (default: one
        XREAD plus its socket timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s if timeout_s is not None else self.block_ms / 1000 + 3.0)
        self._redis.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.last_id == "$":  # pin "only new entries" once: "$" again would skip
                    newest = self._redis.xrevrange(self.stream, count=1)  # entries between reads
                    self.last_id = _decode(newest[0][0]) if newest else "0-0"
                reply = self._redis.xread(
                    {self.stream: self.last_id}, count=READ_COUNT, block=self.block_ms
                )
                if not reply and self._was_reset():
                    self._restart()
            except Exception as exc:  # noqa: BLE001 - Redis down, or a reply it could not parse
                self._failed(exc)
                self._stop.wait(self._backoff.next_delay())
                continue
            if not self.connected:
                if self.last_error is not None:
                    log.warning("KV event stream %s at %s answers again", self.stream, self.url)
                self.connected = True
                self._backoff.reset()
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    if self._stop.is_set():
                        return
                    self._deliver(entry_id, fields)

    def _was_reset(self) -> bool:
        """Whether the stream lost the entries read so far (gone, or its newest is older)."""
        if _id_key(self.last_id) == (0, 0):
            return False
        newest = self._redis.xrevrange(self.stream, count=1)
        return not newest or _id_key(_decode(newest[0][0])) < _id_key(self.last_id)

    def _restart(self) -> None:
        self.num_resets += 1
        if self.num_resets == 1:
            log.warning(
                "KV event stream %s was reset (its entries are older than %s, or gone): "
                "reading it again from the start (logged once, counted)",
                self.stream,
                self.last_id,
            )
        self.last_id = "0"

    def _deliver(self, entry_id: bytes | str, fields: dict) -> None:
        entry = _decode(entry_id)
        self.last_id = entry  # first: whatever the entry holds, it is never read twice
        try:
            raw = fields.get(BATCH_FIELD, fields.get(BATCH_FIELD.decode()))
            if raw is None:
                raise UntrustedInput("the entry has no 'batch' field", "no_batch_field")
            batch = KVEventBatch.from_json(raw)
        except Exception as exc:  # noqa: BLE001 - nothing in an entry may end the reader
            self._malformed(entry, exc)
            return
        try:
            self._on_batch(batch)
        except Exception:  # the router's bug, not the stream's: keep reading
            log.exception("KV event stream %s: on_batch failed on entry %s", self.stream, entry)
        finally:
            self.num_batches += 1  # after the callback: a waiter sees its effect

    def _malformed(self, entry: str, exc: Exception) -> None:
        kind = exc.kind if isinstance(exc, UntrustedInput) else UNEXPECTED
        self.malformed_by_kind[kind] = self.malformed_by_kind.get(kind, 0) + 1
        self.num_malformed += 1
        if self.malformed_by_kind[kind] == 1:
            log.warning(
                "KV event stream %s: entry %s skipped (%s: %s); further entries of this "
                "kind are only counted",
                self.stream,
                entry,
                kind,
                str(exc)[:300],
            )

    def _failed(self, exc: BaseException) -> None:
        was_connected_or_new = self.connected or self.last_error is None
        self.connected = False
        self.last_error = f"{type(exc).__name__}: {exc}"
        if was_connected_or_new:  # once per outage
            log.warning(
                "KV event stream %s at %s failed (%s); retrying with back-off (logged once per "
                "outage)",
                self.stream,
                self.url,
                self.last_error,
            )


def _decode(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def _id_key(entry_id: str) -> tuple[int, int]:
    """A stream id's order: ``"1700000000000-3"`` -> ``(1700000000000, 3)``; ``"0"`` -> (0, 0)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
