"""The tokenizer rebuilt from the embedded GGUF, and the one read from a tokenizer.json folder."""

from __future__ import annotations

import pytest

from pagedkv.model import load_model
from pagedkv.model.embedded import EMBEDDED_FILE_NAME, embedded_model_path
from tests.model.tiny import make_tiny_model

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Ünïcödé — 日本語のテキスト 🙂",
    "def f(x):\n    return x ** 2  # square",
    "phone 555-0199, pi 3.14159, year 2024",
]


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded[2]


def test_digits_are_split_one_by_one(tokenizer):
    ids = tokenizer.encode("12345", add_special_tokens=False)
    assert [tokenizer.token_text(i) for i in ids] == ["1", "2", "3", "4", "5"]
    ids = tokenizer.encode("in 2024", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids][-4:] == ["2", "0", "2", "4"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_agrees_with_transformers_on_digit_free_text(tokenizer):
    """transformers' GGUF tokenizer is an independent reading of the same vocabulary/merges."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(
        embedded_model_path().parent, gguf_file=EMBEDDED_FILE_NAME
    )
    for text in TEXTS[:4]:
        assert tokenizer.encode(text) == hf(text, add_special_tokens=False).input_ids


def test_special_tokens_and_stop_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tokenizer.eos_token_id == 2
    assert {2, 0} <= tokenizer.stop_token_ids  # <|im_end|> and <|endoftext|>
    assert tokenizer.decode([1, 4093, 2]) == "user"
    assert tokenizer.decode([1, 4093, 2], skip_special_tokens=False) == "<|im_start|>user<|im_end|>"


def test_chat_template_renders(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(2) == 2  # one id per special token


def test_hf_folder_tokenizer_and_template(tmp_path):
    make_tiny_model("llama", tmp_path)
    _, _, tok = load_model(tmp_path, progress=False)
    assert tok.eos_token_id == 257 and tok.bos_token_id == 256 and 257 in tok.stop_token_ids
    text = tok.apply_chat_template([{"role": "user", "content": "hé"}])
    assert text == "<s>[user] hé</s>[assistant] "
    ids = tok.encode_chat([{"role": "user", "content": "hé"}])
    assert ids[0] == 256 and 257 in ids
    assert tok.decode(ids) == "[user] hé[assistant] "


@pytest.mark.parametrize("text", TEXTS)
def test_text_stream_concatenates_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode_chat([{"role": "user", "content": text}])
    stream = tokenizer.text_stream()
    assert "".join(stream.push(i) for i in ids) == tokenizer.decode(ids)
