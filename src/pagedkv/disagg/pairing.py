"""Start-up of one side of a prefill/decode pair: publish our page format, check the peer's.

Called by ``pagedkv serve`` once the engine is built (the page format depends on the resolved
block size). The prefill side publishes and is ready. The decode side waits for the prefill
side's record in the store, asks the prefill instance at ``--prefill-url`` what it runs *now*
(``GET /pagedkv/info``: a record can be stale), and raises ``UsageError`` (exit 2, one line
naming both sides' values) when it cannot read the live instance's pages or when the record
disagrees with it; then it publishes its own record.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedkv.disagg.config import PDConfig
from pagedkv.disagg.handshake import Handshake, PeerRecord, check_live, own_record
from pagedkv.disagg.prefill_info import LiveInfo, wait_for_info
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
    api_key: str | None = None,
    live_info: Callable[[str, str | None, float], LiveInfo] = wait_for_info,
) -> PeerRecord | None:
    """Publish this instance's record; on the decode side return the prefill side's (checked
    against the live instance, asked with ``api_key``). ``cfg`` must be a pair
    (``cfg.is_pair``). ``live_info(url, api_key, wait_s)``: for tests."""
    assert cfg.is_pair and cfg.kv_store is not None
    handshake = Handshake(client_factory(cfg.kv_store), cfg.kv_store, cfg.group)
    ours = own_record(cfg.role, model, page_format)
    if cfg.role == "prefill":
        handshake.publish(ours)
        return None
    theirs = handshake.wait_for("prefill", cfg.peer_wait_s)
    assert cfg.prefill_url is not None
    live = live_info(cfg.prefill_url, api_key, cfg.peer_wait_s)
    check_live(ours, theirs, (live.model_identity, live.page_format), cfg.kv_import, cfg.group)
    handshake.publish(ours)
    return theirs
