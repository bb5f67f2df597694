"""``pagedkv generate --chat``: the prompt is the model's own chat template of the user's
message (SmolLM2's template brings its own system turn); ``--system`` adds one only when given."""

from __future__ import annotations

import json

import pytest

import pagedkv.engine
from pagedkv import cli
from pagedkv.engine.startup import build_parts

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture
def sent_prompts(embedded, monkeypatch):
    """Run ``generate`` on the already loaded embedded model; collect the prompts it sends."""
    sent: list = []
    real = pagedkv.engine.LLMEngine

    class Recording(real):
        def __init__(self, config, parts=None):
            super().__init__(config, parts or build_parts(config, embedded))

        def add_request(self, prompt, params=None, *args, **kwargs):
            sent.append(prompt)  # every way generate runs a prompt goes through here
            return super().add_request(prompt, params, *args, **kwargs)

    monkeypatch.setattr(pagedkv.engine, "LLMEngine", Recording)
    return sent


def run_generate(argv, capsys):
    assert (
        cli.main(["generate", "--max-tokens", "1", "--max-model-len", "256", "--json", *argv]) == 0
    )
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_chat_sends_the_templates_own_rendering_of_one_user_message(sent_prompts, capsys, embedded):
    tokenizer = embedded[2]
    run_generate(["--chat", "Hi", "Bye"], capsys)
    expected_text = (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(sent_prompts) == 2
    assert sent_prompts[0] == tokenizer.encode(expected_text, add_special_tokens=False)
    assert "You are a helpful assistant." not in tokenizer.decode(sent_prompts[1])


def test_system_adds_a_system_message_only_when_given(sent_prompts, capsys, embedded):
    tokenizer = embedded[2]
    run_generate(["--chat", "--system", "Be brief.", "Hi", "Bye"], capsys)
    expected_text = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert sent_prompts[0] == tokenizer.encode(expected_text, add_special_tokens=False)
