"""The client and the tier on a real redis-server: runs, verification, outages."""

from __future__ import annotations

import logging

from pagedkv.kvstore import parse_store_url
from pagedkv.kvstore.client import StoreClient
from pagedkv.kvstore.counters import StoreCounters
from pagedkv.kvstore.namespace import store_namespace
from pagedkv.kvstore.tier import StoreTier
from pagedkv.pages.page_format import PageFormat

FMT = PageFormat(4, "mha", "fp32", 2, 2, 16, 0, 0, 512)
BODY_BYTES = 4 * 512


def make_tier(url: str, model: str = "m") -> StoreTier:
    client = StoreClient(parse_store_url(url), StoreCounters())
    ns = store_namespace(FMT, model, "sha256")
    return StoreTier(client, ns, BODY_BYTES, block_size=4)


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


def body(i: int) -> memoryview:
    return memoryview(bytes([i % 251]) * BODY_BYTES)


def write(tier: StoreTier, hs: list[bytes]) -> None:
    tier.submit([(h, body(i)) for i, h in enumerate(hs)])
    assert tier.flush(10)


def test_match_claim_take_round_trip(redis_url):
    tier = make_tier(redis_url)
    hs = hashes(40)  # more than one MGET chunk
    write(tier, hs[:35])
    assert tier.counters.blocks_written == 35
    assert tier.match(hs) == 35
    tier.claim(hs[:20])
    tier.end_step()  # unclaimed staged bodies go, claimed ones stay
    got = tier.take(hs[:20])
    assert [bytes(b) for b in got] == [body(i) for i in range(20)]
    assert tier.counters.hit_tokens == 80
    tier.close()


def test_other_model_shares_no_key(redis_url):
    a, b = make_tier(redis_url, "a"), make_tier(redis_url, "b")
    write(a, hashes(3))
    assert b.match(hashes(3)) == 0
    a.close()
    b.close()


def test_corrupt_and_foreign_payloads_end_the_run(redis_url):
    import redis

    tier = make_tier(redis_url)
    hs = hashes(6)
    write(tier, hs)
    raw = redis.Redis.from_url(redis_url)
    payload = bytearray(raw.get(tier.key(hs[2])))
    payload[-5] ^= 0x01
    raw.set(tier.key(hs[2]), bytes(payload))
    assert tier.match(hs) == 2
    assert tier.counters.rejected["bad_checksum"] == 1
    assert raw.get(tier.key(hs[2])) is None  # the bad payload was deleted
    foreign = make_tier(redis_url, "other model")
    raw.set(tier.key(hs[0]), foreign.encode(hs[0], body(0))[1])  # same key, other namespace
    tier.end_step()
    assert tier.match(hs) == 0
    assert tier.counters.rejected["foreign_format"] == 1
    raw.close()
    tier.close()
    foreign.close()


def test_store_down_is_a_miss_logged_once(own_redis, caplog):
    tier = make_tier(own_redis.url)
    write(tier, hashes(2))
    own_redis.stop()
    with caplog.at_level(logging.WARNING, "pagedkv.kvstore"):
        for _ in range(5):
            assert tier.match(hashes(2)) == 0
            tier.submit([(hashes(1)[0], body(0))])
            tier.flush(5)
    warnings = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert tier.counters.errors >= 1 and tier.counters.writes_dropped >= 1
    own_redis.start()  # same port: the client reconnects after its back-off
    import time

    deadline = time.monotonic() + 20
    while tier.match(hashes(2)) != 0 or tier.client.is_down:
        assert time.monotonic() < deadline, "the client never reconnected"
        time.sleep(0.2)
    tier.close()


def test_a_hung_store_costs_one_timeout_then_is_skipped(caplog):
    """A server that accepts and never answers: the first call times out (a miss, logged
    once), the next ones are skipped without sending Redis a command until the back-off
    passes. The client's clock only moves when the test moves it, so a slow machine cannot end
    the back-off early (20 calls used to have to fit in its first 0.25 s)."""
    import socket
    import time

    from pagedkv.kvstore.redis_policy import REDIS_POLICY

    now_s = [0.0]
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        address = parse_store_url(f"redis://127.0.0.1:{hung.getsockname()[1]}")
        client = StoreClient(address, StoreCounters(), clock=lambda: now_s[0])
        tier = StoreTier(client, store_namespace(FMT, "m", "sha256"), BODY_BYTES, block_size=4)
        with caplog.at_level(logging.WARNING, "pagedkv.kvstore"):
            start = time.monotonic()
            assert tier.match(hashes(3)) == 0
            first_s = time.monotonic() - start
            sent = []  # the commands that reach redis-py from here on
            send = client._redis.execute_command
            client._redis.execute_command = lambda *a, **kw: sent.append(a[0]) or send(*a, **kw)
            for _ in range(20):
                assert tier.match(hashes(3)) == 0
            assert sent == [] and tier.counters.errors == 1 and tier.client.is_down
            # One socket timeout, not a hang (the bound leaves room for a loaded machine).
            assert first_s < 10 * REDIS_POLICY.socket_timeout_s, first_s
            now_s[0] += REDIS_POLICY.first_backoff_s  # the back-off is over: Redis is tried
            assert tier.match(hashes(3)) == 0
            assert sent == ["MGET"] and tier.counters.errors == 2
        assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1
        tier.close()
