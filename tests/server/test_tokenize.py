"""``POST /tokenize`` and ``/detokenize`` (vLLM's shapes): counts that agree with what the
generation routes bill, a lossless round trip, and a 4xx naming the field for bad input."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL_NAME, running_server
from .test_api import POOL, PROMPT

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def url(tiny_loaded):
    with running_server(tiny_loaded, **POOL) as (base, _):
        yield base


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def test_counts_equal_the_prompt_tokens_the_generation_routes_bill(url) -> None:
    text = _post(url, "/tokenize", {"prompt": PROMPT}).json()
    billed = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).json()
    assert text["count"] == len(text["tokens"]) == billed["usage"]["prompt_tokens"]
    assert text["max_model_len"] == POOL["max_model_len"] and text["token_strs"] is None
    chat = _post(url, "/tokenize", {"messages": MESSAGES, "model": MODEL_NAME}).json()
    billed = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["count"] == billed["usage"]["prompt_tokens"]
    # the same ids the completion route runs when it is sent them
    by_ids = _post(url, "/v1/completions", {"prompt": text["tokens"], "max_tokens": 1}).json()
    assert by_ids["usage"]["prompt_tokens"] == text["count"]


def test_detokenize_inverts_tokenize_and_token_strs_spell_the_text(url) -> None:
    out = _post(url, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False,
                                   "return_token_strs": True}).json()  # fmt: skip
    assert _post(url, "/detokenize", {"tokens": out["tokens"]}).json() == {"prompt": PROMPT}
    assert len(out["token_strs"]) == out["count"] and all(out["token_strs"])
    without_generation = _post(url, "/tokenize", {"messages": MESSAGES,
                                                  "add_generation_prompt": False}).json()  # fmt: skip
    with_generation = _post(url, "/tokenize", {"messages": MESSAGES}).json()
    assert with_generation["tokens"][: without_generation["count"]] == without_generation["tokens"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "colour": "red"}, 400, "colour"),
        ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(url, path, body, status, param) -> None:
    r = _post(url, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(f"{url}/health").status_code == 200


def test_tokenizer_info_is_what_lm_evals_remote_tokenizer_reads(url, tiny_loaded) -> None:
    tokenizer = tiny_loaded[2]
    info = httpx.get(f"{url}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"  # tests/model/tiny.py
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model"] == MODEL_NAME and info["vocab_size"] == tokenizer.vocab_size
    # lm-eval encodes the EOS text through /tokenize and takes the first id
    eos = _post(url, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"][0] == tokenizer.eos_token_id
