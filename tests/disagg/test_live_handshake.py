"""The P/D handshake against what the prefill instance says now (``GET /pagedkv/info``): a
stale record in the store (block size 32 while the instance runs 16) is refused at start-up
with one line naming both values, and a peer's answer is untrusted input."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedkv.disagg import PDConfig
from pagedkv.disagg.handshake import Handshake, check_live, record_key
from pagedkv.disagg.pairing import pair_up
from pagedkv.disagg.prefill_info import LiveInfo, parse_info, wait_for_info
from pagedkv.errors import UsageError
from tests.disagg.test_handshake import FMT, DictClient, rec

URL = "http://prefill:8001"


def live(model: str = "m", **changes) -> tuple[str, dict]:
    return model, {**FMT.to_dict(), **changes}


def test_a_live_instance_that_matches_passes():
    check_live(rec("decode"), rec("prefill"), live(), "strict", "g")


def test_the_issues_stale_record_is_refused_naming_both_values():
    """The record says 32, the instance runs 16, the decode side runs 32: the record alone
    would let it start and share nothing."""
    ours, record = rec("decode", block_size=32), rec("prefill", block_size=32)
    with pytest.raises(UsageError) as err:
        check_live(ours, record, live(block_size=16), "strict", "g")
    line = str(err.value)
    assert "\n" not in line and err.value.param == "page_format"
    assert "block_size 32 (decode) vs 16 (prefill)" in line
    assert f"record {record_key('g', 'prefill')} is stale (block_size 32 (store record) vs 16 " \
           "(prefill))" in line  # fmt: skip


def test_a_stale_record_is_refused_even_when_we_match_the_live_instance():
    with pytest.raises(UsageError, match="is stale \\(block_size 32 \\(store record\\) vs 16"):
        check_live(rec("decode"), rec("prefill", block_size=32), live(), "strict", "g")
    with pytest.raises(UsageError, match="stale \\(model 'old' \\(store record\\) vs 'm'"):
        check_live(rec("decode"), rec("prefill", "old"), live(), "relayout", "g")


def test_relayout_still_bridges_the_live_block_size_only():
    check_live(rec("decode", block_size=32), rec("prefill"), live(), "relayout", "g")
    with pytest.raises(UsageError, match="kv_dtype fp16 \\(decode\\) vs fp32 \\(prefill\\)"):
        check_live(rec("decode", kv_dtype="fp16"), rec("prefill"), live(), "relayout", "g")


def _info_body(**changes) -> bytes:
    return json.dumps({"model_identity": "m", "page_format": {**FMT.to_dict(), **changes}}).encode()


@pytest.mark.parametrize(
    ("body", "words"),
    [(b"[" * 100_000, "nests"),
     (b"{\"page_format\": {\"block_size\": 1e400}}", "does not fit a float"),
     (b"x" * (300 * 1024), "over"),
     (b"not json", "not JSON"),
     (b"[]", "must be an object"),
     (b"{}", "page_format is missing"),
     (_info_body(block_size=16.0), "block_size must be an integer"),
     (_info_body(block_size=-1), "block_size must be in"),
     (_info_body(extra=1), "page_format fields"),
     (json.dumps({"page_format": FMT.to_dict(), "model_identity": 5}).encode(), "must be a string")],
)  # fmt: skip
def test_a_hostile_info_answer_is_a_value_error(body, words):
    with pytest.raises(ValueError, match=words):
        parse_info(URL, body)


def test_wait_for_info_reads_a_live_instance_and_refuses_a_wrong_one():
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, content=_info_body())

    info = wait_for_info(URL, "k", 1.0, transport=httpx.MockTransport(answer))
    assert info == LiveInfo(URL, "m", FMT.to_dict())
    with pytest.raises(UsageError, match="answered HTTP 401"):
        wait_for_info(URL, None, 1.0, transport=httpx.MockTransport(lambda r: httpx.Response(401)))


def test_wait_for_info_retries_until_the_deadline_on_a_fake_clock():
    calls, ticks, sleeps = [], iter([0.0, 1.0, 2.0, 30.0]), []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("Connection refused", request=request)

    with pytest.raises(UsageError) as err:
        wait_for_info(URL, None, 5.0, clock=lambda: next(ticks), sleep=sleeps.append,
                      transport=httpx.MockTransport(refuse))  # fmt: skip
    assert len(calls) == 3 and len(sleeps) == 2
    assert f"the prefill instance at {URL} does not answer /pagedkv/info" in str(err.value)


def test_pair_up_asks_the_live_instance_with_our_key():
    client = DictClient()
    Handshake(client, "redis://x", "g").publish(rec("prefill", block_size=32))  # stale
    asked = []

    def live_info(url, api_key, wait_s):
        asked.append((url, api_key))
        return LiveInfo(url, "m", FMT.to_dict())  # runs 16

    cfg = PDConfig(role="decode", kv_store="redis://x", prefill_url=URL, group="g")
    ours = rec("decode", block_size=32).page_format
    with pytest.raises(UsageError, match="block_size 32 \\(decode\\) vs 16 \\(prefill\\)"):
        pair_up(cfg, ours, "m", lambda url: client, api_key="k", live_info=live_info)
    assert asked == [(URL, "k")]
    assert record_key("g", "decode") not in client.data  # refused before publishing ours


def test_a_decode_pairs_with_the_live_instance_when_the_store_lost_the_record():
    """Redis restarted (emptied) since the prefill instance published: the decode instance
    restarting now pairs with what the live instance says, and publishes its own record."""
    client = DictClient()  # no prefill record in it

    def live_info(url, api_key, wait_s):
        return LiveInfo(url, "m", FMT.to_dict())

    cfg = PDConfig(role="decode", kv_store="redis://x", prefill_url=URL, group="g")
    theirs = pair_up(cfg, FMT, "m", lambda url: client, live_info=live_info)
    assert theirs is not None and theirs.role == "prefill" and theirs.page_format == FMT
    assert record_key("g", "decode") in client.data


def test_without_a_record_a_live_mismatch_is_still_refused():
    client = DictClient()

    def live_info(url, api_key, wait_s):
        return LiveInfo(url, "m", FMT.to_dict())  # runs 16

    cfg = PDConfig(role="decode", kv_store="redis://x", prefill_url=URL, group="g")
    ours = rec("decode", block_size=32).page_format
    with pytest.raises(UsageError, match="block_size 32 \\(decode\\) vs 16 \\(prefill\\)"):
        pair_up(cfg, ours, "m", lambda url: client, live_info=live_info)
