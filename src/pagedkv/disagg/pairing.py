"""Start-up of one side of a prefill/decode pair: publish our page format, check the peer's.

Called by ``pagedkv serve`` once the engine is built (the page format depends on the resolved
block size). The prefill side publishes and is ready. The decode side publishes, waits for the
prefill side's record and raises ``UsageError`` (exit 2, one line naming both sides' values)
when it cannot read the prefill side's pages.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedkv.disagg.config import PDConfig
from pagedkv.disagg.handshake import Handshake, PeerRecord, check_peer, own_record
from pagedkv.pages.page_format import PageFormat

# Short: a store that does not answer within this is down, and a pair cannot start without it.
STORE_TIMEOUT_S = 2.0


def redis_client(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=STORE_TIMEOUT_S,
                                socket_connect_timeout=STORE_TIMEOUT_S)  # fmt: skip


def pair_up(
    cfg: PDConfig,
    page_format: PageFormat,
    model: str,
    client_factory: Callable[[str], object] = redis_client,
) -> PeerRecord | None:
    """Publish this instance's record; on the decode side return the prefill side's (checked).
    ``cfg`` must be a pair (``cfg.is_pair``)."""
    assert cfg.is_pair and cfg.kv_store is not None
    handshake = Handshake(client_factory(cfg.kv_store), cfg.kv_store, cfg.group)
    ours = own_record(cfg.role, model, page_format)
    if cfg.role == "prefill":
        handshake.publish(ours)
        return None
    theirs = handshake.wait_for("prefill", cfg.peer_wait_s)
    check_peer(ours, theirs, cfg.kv_import, cfg.group)
    handshake.publish(ours)
    return theirs
