"""The P/D page-format handshake and the pair's config, without a store (a dict client)."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.disagg import PDConfig
from pagedkv.disagg.handshake import Handshake, PeerRecord, check_peer, differences, record_key
from pagedkv.errors import UsageError
from pagedkv.pages.page_format import PageFormat

FMT = PageFormat(block_size=16, attention="mha", kv_dtype="fp32", num_layers=30,
                 num_kv_heads=3, head_dim=64, kv_lora_rank=0, qk_rope_head_dim=0,
                 record_bytes=46080)  # fmt: skip


def rec(role: str, model: str = "m", **changes) -> PeerRecord:
    return PeerRecord(role, model, dataclasses.replace(FMT, **changes), 1, "h")


class DictClient:
    def __init__(self, fail: bool = False) -> None:
        self.data: dict[str, bytes] = {}
        self.fail = fail

    def set(self, key, value):
        if self.fail:
            raise ConnectionError("Connection refused")
        self.data[key] = value.encode()

    def get(self, key):
        if self.fail:
            raise ConnectionError("Connection refused")
        return self.data.get(key)


def test_identical_formats_pass():
    check_peer(rec("decode"), rec("prefill"), "strict", "g")
    assert differences(rec("decode"), rec("prefill"), "strict") == []


@pytest.mark.parametrize(
    ("field", "ours", "theirs"),
    [("block_size", 32, 16), ("kv_dtype", "fp16", "fp32"), ("num_layers", 24, 30),
     ("num_kv_heads", 4, 3), ("head_dim", 128, 64), ("attention", "mla", "mha")],
)  # fmt: skip
def test_each_field_mismatch_names_both_sides(field, ours, theirs):
    with pytest.raises(UsageError) as err:
        check_peer(rec("decode", **{field: ours}), rec("prefill", **{field: theirs}), "strict", "g")
    line = str(err.value)
    assert "\n" not in line
    assert f"{field} {ours} (decode) vs {theirs} (prefill)" in line


def test_relayout_bridges_block_size_only():
    ours, theirs = rec("decode", block_size=32), rec("prefill", block_size=16)
    check_peer(ours, theirs, "relayout", "g")  # block size alone: accepted
    with pytest.raises(UsageError, match="kv_dtype fp16 \\(decode\\) vs fp32 \\(prefill\\)"):
        check_peer(rec("decode", block_size=32, kv_dtype="fp16"), theirs, "relayout", "g")


def test_another_model_is_refused_even_with_the_same_shape():
    with pytest.raises(UsageError, match="model 'a' \\(decode\\) vs 'b' \\(prefill\\)"):
        check_peer(rec("decode", "a"), rec("prefill", "b"), "relayout", "g")


def test_publish_then_wait_round_trip():
    client = DictClient()
    hs = Handshake(client, "redis://x", "g")
    hs.publish(rec("prefill"))
    assert record_key("g", "prefill") in client.data
    assert hs.wait_for("prefill", 1.0) == rec("prefill")


def test_wait_times_out_with_a_clear_error():
    ticks = iter([0.0, 0.0, 100.0])
    with pytest.raises(UsageError, match="no prefill instance published its page format"):
        Handshake(DictClient(), "redis://x", "g").wait_for(
            "prefill", 5.0, clock=lambda: next(ticks)
        )


def test_store_down_and_garbage_records_are_usage_errors():
    with pytest.raises(UsageError, match="cannot publish the page format to redis://x"):
        Handshake(DictClient(fail=True), "redis://x", "g").publish(rec("prefill"))
    client = DictClient()
    client.data[record_key("g", "prefill")] = b"{not json"
    with pytest.raises(UsageError, match="not a pagedkv page-format record"):
        Handshake(client, "redis://x", "g").wait_for("prefill", 1.0)


def test_groups_do_not_see_each_other():
    client = DictClient()
    Handshake(client, "redis://x", "a").publish(rec("prefill"))
    ticks = iter([0.0, 10.0])
    with pytest.raises(UsageError, match="group 'b'"):
        Handshake(client, "redis://x", "b").wait_for("prefill", 1.0, clock=lambda: next(ticks))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"role": "middle"}, "--role must be one of"),
     ({"role": "prefill"}, "needs --kv-store"),
     ({"role": "decode", "kv_store": "redis://h:1"}, "needs --prefill-url"),
     ({"role": "decode", "kv_store": "redis://h:1", "prefill_url": "ftp://h"}, "http\\(s\\)"),
     ({"prefill_url": "http://h:1"}, "only used with --role decode"),
     ({"kv_import": "relayout"}, "only used with --role decode"),
     ({"kv_import": "magic"}, "--kv-import must be one of"),
     ({"group": "a b"}, "--pd-group"),
     ({"peer_wait_s": 0}, "--pd-wait")],
)  # fmt: skip
def test_config_errors(kwargs, match):
    with pytest.raises(UsageError, match=match):
        PDConfig(**kwargs)


def test_config_accepts_a_pair():
    assert not PDConfig().is_pair
    cfg = PDConfig(role="decode", kv_store="redis://h:1", prefill_url="http://h:2")
    assert cfg.is_pair


MLA = PageFormat(block_size=16, attention="mla", kv_dtype="bf16", num_layers=27,
                 num_kv_heads=0, head_dim=0, kv_lora_rank=512, qk_rope_head_dim=64,
                 record_bytes=31104)  # fmt: skip


@pytest.mark.parametrize(
    ("theirs", "named"),
    [(FMT, ["attention mla (decode) vs mha (prefill)", "kv_lora_rank 512 (decode) vs 0"]),
     (dataclasses.replace(MLA, kv_lora_rank=256, record_bytes=17280),
      ["kv_lora_rank 512 (decode) vs 256 (prefill)", "record_bytes 31104 (decode) vs 17280"])],
)  # fmt: skip
def test_mla_pages_are_refused_against_mha_or_another_rank_in_one_line(theirs, named):
    """Issue 55: a latent page read as K/V (or with another rank) is silently wrong."""
    ours = PeerRecord("decode", "m", MLA, 1, "h")
    for kv_import in ("strict", "relayout"):  # relayout bridges the block size, nothing else
        with pytest.raises(UsageError) as err:
            check_peer(ours, PeerRecord("prefill", "m", theirs, 1, "h"), kv_import, "g")
        line = str(err.value)
        assert "\n" not in line and all(n in line for n in named), line
