"""``echo`` and prompt log-probabilities on /v1/completions, checked against transformers on the
same tiny random weights: the legacy lists lead with the prompt's tokens (first logprob null),
``max_tokens: 0`` scores without generating, vLLM's ``prompt_logprobs`` carries ranks, streams
echo the prompt once, a warm prefix cache changes nothing, and bad values are 400s naming the
field. The official ``openai`` client parses every shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from pagedkv.model import load_model

from .conftest import MODEL_NAME, running_server

PROMPT = "The cat sat on the mat, and"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama-echo")
    hf = make_tiny_model("llama", folder)
    return load_model(folder, progress=False), hf


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(tiny[0], max_model_len=128) as (url, _):
        yield url


@pytest.fixture(scope="module")
def reference(tiny):
    """(prompt ids, transformers' float64 log-softmax at every prompt position)."""
    (_, _, tokenizer), hf = tiny
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return ids, logits.log_softmax(dim=-1)


def post(url: str, **body) -> httpx.Response:
    body.setdefault("model", MODEL_NAME)
    body.setdefault("temperature", 0)
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_echo_with_max_tokens_0_scores_the_prompt(server, reference):
    ids, log_probs = reference
    r = post(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == PROMPT
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == PROMPT and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["text_offset"] == offsets
    for i in range(1, len(ids)):
        want = float(log_probs[i - 1][ids[i]])
        assert lp["token_logprobs"][i] == pytest.approx(want, abs=1e-4)
        top = lp["top_logprobs"][i]
        assert top[lp["tokens"][i]] == pytest.approx(want, abs=1e-4)  # the token itself
        best = int(log_probs[i - 1].argmax())
        assert max(top.values()) == pytest.approx(float(log_probs[i - 1][best]), abs=1e-4)
        assert 2 <= len(top) <= 3


def test_echo_with_generation_appends_the_completion(server):
    plain = post(server, prompt=PROMPT, logprobs=1, max_tokens=4).json()["choices"][0]
    echoed = post(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4).json()
    choice = echoed["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    n = len(choice["logprobs"]["tokens"]) - 4
    assert choice["logprobs"]["tokens"][n:] == plain["logprobs"]["tokens"]
    assert choice["logprobs"]["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert choice["logprobs"]["text_offset"][n] == len(PROMPT)
    assert echoed["usage"]["completion_tokens"] == 4


def test_echo_without_logprobs_and_token_id_prompts(server, reference):
    ids, _ = reference
    r = post(server, prompt=[ids, ids[:5]], echo=True, max_tokens=2).json()
    texts = [c["text"] for c in r["choices"]]
    assert texts[0].startswith(PROMPT) and texts[1].startswith(PROMPT[:5])
    assert all(c["logprobs"] is None for c in r["choices"])


def test_vllm_prompt_logprobs_have_ranks(server, reference):
    ids, log_probs = reference
    r = post(server, prompt=PROMPT, prompt_logprobs=1, max_tokens=1)
    assert r.status_code == 200, r.text
    scored = r.json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        row = log_probs[i - 1]
        entry = scored[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(float(row[ids[i]]), abs=1e-4)
        assert entry["rank"] == int((row > row[ids[i]]).sum()) + 1
        best = str(int(row.argmax()))
        assert scored[i][best]["rank"] == 1 or best == str(ids[i])
    assert r.json()["choices"][0]["text"] != PROMPT  # no echo: the completion only


def test_a_warm_prefix_cache_leaves_the_scores_unchanged(tiny):
    with running_server(tiny[0], max_model_len=128, block_size=4) as (url, _):
        cold = post(url, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0).json()
        warm_up = post(url, prompt=PROMPT, max_tokens=1).json()
        assert warm_up["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        warm = post(url, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0).json()
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]


def test_streamed_echo_leads_once(server):
    whole = post(server, prompt=PROMPT, echo=True, logprobs=0, max_tokens=5).json()
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 5,
        "temperature": 0, "stream": True,
    }) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert (
        text == whole["choices"][0]["text"]
        and chunks[0]["choices"][0]["text"][: len(PROMPT)] == PROMPT
    )
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]


@pytest.mark.parametrize(
    "body, param",
    [({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
     ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": "1"}, "prompt_logprobs"),
     ({"echo": "yes"}, "echo"), ({"echo": True, "logprobs": 99}, "logprobs")],
)  # fmt: skip
def test_bad_values_are_400s_naming_the_field(server, body, param):
    r = post(server, prompt=PROMPT, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_openai_client_parses_echo(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1,
                                    max_tokens=0, temperature=0)  # fmt: skip
    assert out.choices[0].text == PROMPT
    assert out.choices[0].logprobs.token_logprobs[0] is None
    assert len(out.choices[0].logprobs.tokens) == out.usage.prompt_tokens
