"""The router's small parts: flags and config, the replicas' compatibility rule, the SSE
splitter, the load scrape."""

from __future__ import annotations

import pytest

from pagedkv.cli import main
from pagedkv.errors import UsageError
from pagedkv.router.config import RouterConfig
from pagedkv.router.forward import SSESplitter
from pagedkv.router.handshake import ReplicaInfo, check_compatible, first_difference
from pagedkv.router.health import scraped_requests
from tests.router.fakes import info_json


def _info(url: str, block_size: int = 16, **changes) -> ReplicaInfo:
    return ReplicaInfo.from_json(url, {**info_json(url[-1], block_size), **changes})


def test_replicas_that_differ_are_named_with_the_field():
    a, b = _info("http://a"), _info("http://b", 32)
    assert first_difference(b, a) == "block_size 32 (http://b) vs 16 (http://a)"
    assert first_difference(_info("http://c"), a) is None
    with pytest.raises(UsageError, match=r"block_size 32 \(http://b\) vs 16 \(http://a\)"):
        check_compatible([a, _info("http://c"), b])
    fmt = {**a.page_format, "kv_dtype": "fp16"}
    d = _info("http://d", page_format=fmt)
    assert first_difference(d, a) == "page_format.kv_dtype fp16 (http://d) vs fp32 (http://a)"
    assert "model other" in first_difference(_info("http://e", model="other"), a)


def test_the_router_tokenizes_as_its_replicas_or_refuses(tmp_path):
    """The router's tokenizer (read from the GGUF header alone) has the fingerprint the
    replicas publish (their tokenizer comes with the weights); another model's is refused."""
    from pagedkv.model import load_model
    from pagedkv.router.server import check_tokenizer, load_tokenizer
    from tests.model.tiny import make_tiny_model

    ours = load_tokenizer(None).fingerprint()
    assert ours == load_model(None, progress=False)[2].fingerprint()
    make_tiny_model("llama", tmp_path / "tiny")
    tiny = load_tokenizer(str(tmp_path / "tiny")).fingerprint()
    assert tiny != ours
    replica = _info("http://a", tokenizer=ours)
    check_tokenizer(ours, None, replica)
    check_tokenizer(tiny, None, _info("http://b", tokenizer=None))  # an older replica: no check
    with pytest.raises(UsageError, match=rf"tokenizer {tiny} \(--model .*tiny\) vs {ours}"):
        check_tokenizer(tiny, str(tmp_path / "tiny"), replica)
    assert "tokenizer" in first_difference(_info("http://c", tokenizer=tiny), replica)


def test_device_and_dtype_are_shown_never_compared_and_bounded():
    gpu, cpu = _info("http://a"), _info("http://b", device="cpu", dtype="float32")
    assert (gpu.device, gpu.dtype, cpu.device) == ("cuda:0", "bfloat16", "cpu")
    assert first_difference(cpu, gpu) is None  # the same KV, wherever it is computed
    assert _info("http://c", device=None, dtype=None).device is None  # an older replica
    with pytest.raises(ValueError, match="device"):
        _info("http://d", device="x" * 5000)
    with pytest.raises(ValueError, match="dtype"):
        _info("http://e", dtype=16)


def test_a_wrong_info_answer_is_a_value_error():
    with pytest.raises(ValueError, match="http://x/pagedkv/info is not a pagedkv replica"):
        ReplicaInfo.from_json("http://x", {"instance_id": "1"})


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "give at least one --replica URL"),
        (["--replica", "localhost:8000"], "is not an http(s)://HOST:PORT URL"),
        (["--replica", "http://a:1,http://a:1/"], "is given twice"),
        (["--replica", "http://a:1/x"], "no path"),
        (["--replica", "http://a:1", "--health-interval", "0"], "--health-interval must be > 0"),
        (["--replica", "http://a:1", "--balance-abs", "-1"], "balance_abs must be"),
        (["--replica", "http://a:1", "--kv-events", "http://r"], "not a redis://HOST:PORT URL"),
        (["--replica", "http://a:1", "--port", "70000"], "--port must be in 0..65535"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, words):
    assert main(["route", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedkv route: error: ") and words in err[0]


def test_an_unreachable_replica_is_a_usage_error(capsys):
    assert main(["route", "--replica", "http://127.0.0.1:9", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "replica http://127.0.0.1:9 does not answer /pagedkv/info" in err and "--wait" in err


def test_config_normalizes_urls():
    cfg = RouterConfig(("http://a:1/", "https://b:2/v1"))
    assert cfg.replica_urls == ("http://a:1", "https://b:2")


def test_the_splitter_yields_whole_events_only():
    s = SSESplitter()
    assert s.feed(b"data: 1\n\ndata: ") == [b"data: 1\n\n"]
    assert s.feed(b"2\n") == []
    assert s.feed(b"\ndata: [DONE]\n\n") == [b"data: 2\n\n", b"data: [DONE]\n\n"]


def test_the_load_is_in_flight_plus_queued():
    text = "# HELP x\npagedkv_requests_in_flight 3.0\npagedkv_requests_queued 2.0\nother 9\n"
    assert scraped_requests(text) == 5


def test_mla_replicas_are_refused_beside_mha_or_another_rank():
    """Issue 55: one router over replicas whose pages mean different records would route a
    prefix to a replica that cannot read it; the line names the page field."""
    mla = {"block_size": 16, "attention": "mla", "kv_dtype": "bf16", "num_layers": 27,
           "num_kv_heads": 0, "head_dim": 0, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "record_bytes": 31104}  # fmt: skip
    a = _info("http://a", page_format=mla)
    mha = _info("http://b")
    assert first_difference(mha, a).startswith("page_format.attention mha (http://b) vs mla")
    ranked = _info("http://c", page_format={**mla, "kv_lora_rank": 256, "record_bytes": 17280})
    want = r"page_format.kv_lora_rank 256 \(http://c\) vs 512 \(http://a\)$"
    with pytest.raises(UsageError, match=want):
        check_compatible([a, ranked])
    assert first_difference(_info("http://d", page_format=mla), a) is None
