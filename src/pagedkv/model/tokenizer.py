"""Tokenizer: text ↔ token ids, the chat template, and the ids that end a generation.

Two sources: a GGUF file's vocabulary and merges (rebuilt as a byte-level BPE with the
``tokenizers`` library and the pre-tokenizer the file names), or a Hugging Face folder's
``tokenizer.json`` + ``tokenizer_config.json``. Chat templates render with a sandboxed jinja2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp): 3 = control, 4 = user defined; both are matched whole in text.
_SPECIAL_TOKEN_TYPES = (3, 4)
# Token texts that end a turn in the chat formats we know, besides the declared EOS.
_END_OF_TURN_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


def _byte_level(split_digits: bool) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if not split_digits:
        return byte_level
    # "smollm": every digit is its own word before the GPT-2 regex and the byte mapping.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


# GGUF ``tokenizer.ggml.pre`` → pre-tokenizer. Only those we can check against llama.cpp.
GGUF_PRE_TOKENIZERS = {
    "smollm": lambda: _byte_level(split_digits=True),
    "gpt2": lambda: _byte_level(split_digits=False),
    "default": lambda: _byte_level(split_digits=False),
}


class Tokenizer:
    """Encode/decode plus chat formatting. Immutable after construction; safe to share."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_id: int | None,
        stop_token_ids: Iterable[int],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.stop_token_ids: frozenset[int] = frozenset(stop_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token texts (``<|im_start|>``) map to their ids.
        ``add_special_tokens`` adds what the model expects around a prompt (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def text_stream(self, skip_special_tokens: bool = True) -> TextStream:
        """A fresh incremental decoder for one generated sequence (streaming output)."""
        return TextStream(self.backend, skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` ``[{"role": ..., "content": ...}]``."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_text(self.eos_token_id) if self.eos_token_id is not None else ""
        return _compile(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos or "",
            eos_token=eos or "",
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat; the template already placed any BOS it wants."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


class TextStream:
    """Incremental detokenization of one sequence: ``push(id)`` returns the text that id
    completes ("" while a multi-byte character is still partial). Mutates itself only."""

    def __init__(self, backend: HFTokenizer, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


def _compile(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    # Chat templates are written for this whitespace handling (as in the HF tokenizers).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    # Some templates (Llama 3.x) print today's date.
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any]) -> Tokenizer:
    """Rebuild the GGUF's byte-level BPE; ``ValueError`` for a tokenizer kind we do not support."""
    kind = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2 byte-level BPE)"
        )
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (supported: {sorted(GGUF_PRE_TOKENIZERS)})"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    backend.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in _SPECIAL_TOKEN_TYPES
        ]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)],
        )
    stops = {eos} if eos is not None else set()
    stops |= {
        vocab[t]
        for t in _END_OF_TURN_TEXTS
        if t in vocab and types[vocab[t]] in _SPECIAL_TOKEN_TYPES
    }
    if meta.get("tokenizer.ggml.eot_token_id") is not None:
        stops.add(int(meta["tokenizer.ggml.eot_token_id"]))
    return Tokenizer(
        backend,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=bos,
        eos_token_id=eos,
        stop_token_ids=stops,
    )


def tokenizer_from_hf_folder(
    folder: str | os.PathLike[str], config_eos_ids: Iterable[int] = ()
) -> Tokenizer:
    """``tokenizer.json`` (required) with ``tokenizer_config.json``/``generation_config.json``
    and ``chat_template.jinja`` when present. Stop ids: EOS, the config's and generation
    config's ``eos_token_id``s."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    backend = HFTokenizer.from_file(str(path))
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    gen_cfg = _read_json(folder / "generation_config.json")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")

    def token_id(entry: Any) -> int | None:
        text = entry.get("content") if isinstance(entry, dict) else entry
        return backend.token_to_id(text) if isinstance(text, str) else None

    bos, eos = token_id(tok_cfg.get("bos_token")), token_id(tok_cfg.get("eos_token"))
    stops = set(config_eos_ids)
    gen_eos = gen_cfg.get("eos_token_id")
    stops.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if eos is not None:
        stops.add(eos)
    elif stops:
        eos = min(stops)
    return Tokenizer(
        backend, chat_template=template, bos_token_id=bos, eos_token_id=eos, stop_token_ids=stops
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from exc
