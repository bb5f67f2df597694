"""Start-up of one side of a prefill/decode pair: publish our page format, check the peer's.

Called by ``pagedkv serve`` once the engine is built (the page format depends on the resolved
block size). The prefill side publishes and is ready. The decode side waits for the prefill
instance at ``--prefill-url`` to say what it runs *now* (``GET /pagedkv/info``: the truth),
reads the prefill side's record in the store (a record can be stale; it can also be gone: a
Redis restarted since holds none, and then the live answer stands in for it), and raises
``UsageError`` (exit 2, one line naming both sides' values) when it cannot read the live
instance's pages or when the record disagrees with it; then it publishes its own record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from pagedkv.disagg.config import PDConfig
from pagedkv.disagg.handshake import Handshake, PeerRecord, check_live, own_record
from pagedkv.disagg.prefill_info import LiveInfo, wait_for_info
from pagedkv.pages.page_format import PageFormat

log = logging.getLogger("pagedkv.disagg")

# Short: a store that does not answer within this is down, and a pair cannot start without it.
STORE_TIMEOUT_S = 2.0


def redis_client(url: str):
    import redis

    return redis.Redis.from_url(
        url, socket_timeout=STORE_TIMEOUT_S, socket_connect_timeout=STORE_TIMEOUT_S
    )


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
    assert cfg.prefill_url is not None
    live = live_info(cfg.prefill_url, api_key, cfg.peer_wait_s)  # the truth (waits for it)
    theirs = handshake.read("prefill")
    if theirs is None:  # the store lost it (Redis restarted, emptied): the live answer serves
        log.warning(
            "P/D group %r: no prefill record in %s; pairing with what %s says it runs",
            cfg.group,
            cfg.kv_store,
            live.url,
        )
        theirs = PeerRecord(
            "prefill",
            live.model_identity or "",
            PageFormat.from_dict(dict(live.page_format)),
            0,
            urlsplit(live.url).hostname or "",
        )
    check_live(ours, theirs, (live.model_identity, live.page_format), cfg.kv_import, cfg.group)
    handshake.publish(ours)
    return theirs
