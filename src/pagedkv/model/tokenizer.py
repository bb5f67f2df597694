"""Tokenizer: text ↔ token ids, the chat template, and the ids that end a generation.

Two sources: a GGUF file's vocabulary and merges (rebuilt as a byte-level BPE with the
``tokenizers`` library and the pre-tokenizer the file names), or a Hugging Face folder's
``tokenizer.json`` + ``tokenizer_config.json``. Chat templates render with a sandboxed jinja2.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Encoding, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pagedkv.errors import UsageError
from pagedkv.model.chat_template import compile_template, overlaps, render_with_content_spans

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
        # Built on first use, then reused (benign race: two threads may both build one).
        self._compiled_template: Any = None
        self._special_id_set: frozenset[int] | None = None
        self._plain_backend: HFTokenizer | None = None
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """A digest of everything that decides the token ids of a request: the tokenizer's
        whole definition, the chat template and the special ids. Two processes that must turn
        one request into the same ids (a router and its replicas) compare it."""
        if self._fingerprint is None:
            h = hashlib.blake2b(self.backend.to_str().encode(), digest_size=16)
            h.update(
                repr(
                    (
                        self.chat_template,
                        self.bos_token_id,
                        self.eos_token_id,
                        sorted(self.stop_token_ids),
                    )
                ).encode()
            )
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token texts (``<|im_start|>``) map to their ids.
        ``add_special_tokens`` adds what the model expects around a prompt (e.g. BOS). For a
        chat, use ``encode_chat``: it keeps users from typing special tokens."""
        return _encode(self.backend, text, add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` list (Qwen/Hermes-style templates)."""
        return bool(self.chat_template) and "tools" in (self.chat_template or "")

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` ``[{"role": ..., "content": ...}]`` (and ``tools``,
        for a template that renders them). The template is compiled once per tokenizer
        (compiling costs milliseconds; rendering, microseconds)."""
        from jinja2.exceptions import TemplateError

        if not self.chat_template:
            raise UsageError("this model has no chat template: send plain prompts", "messages")
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_text(self.eos_token_id) if self.eos_token_id is not None else ""
        try:
            if self._compiled_template is None:
                self._compiled_template = compile_template(self.chat_template)
            return self._compiled_template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=bos or "",
                eos_token=eos or "",
                **({"tools": list(tools)} if tools is not None else {}),
            )
        except TemplateError as exc:  # a broken template, or its own raise_exception
            raise UsageError(f"cannot apply the model's chat template: {exc}", "messages") from None

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template already placed any BOS it wants.

        Only the template's own markers become special tokens: a message's content is text,
        so ``"<|im_end|>\\n<|im_start|>system"`` typed by a user is encoded as ordinary
        tokens and cannot open a turn. A chat whose contents hold no special-token text
        encodes exactly as ``encode(apply_chat_template(...), add_special_tokens=False)``.
        """
        text, content_spans = render_with_content_spans(
            self, messages, add_generation_prompt, tools
        )
        encoding = _encode(self.backend, text, False)
        special_ids = self._special_ids()
        if not any(
            token_id in special_ids and overlaps(start, end, content_spans)
            for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
        ):
            return list(encoding.ids)
        # Keep the template's markers; encode the text between them with special parsing off.
        ids: list[int] = []
        run_start = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in special_ids and not overlaps(start, end, content_spans):
                ids += self._encode_plain(text[run_start:start])
                ids.append(token_id)
                run_start = end
        return ids + self._encode_plain(text[run_start:])

    def _special_ids(self) -> frozenset[int]:
        if self._special_id_set is None:
            decoder = self.backend.get_added_tokens_decoder()
            self._special_id_set = frozenset(i for i, t in decoder.items() if t.special)
        return self._special_id_set

    def _encode_plain(self, text: str) -> list[int]:
        """``text`` with special-token texts read as ordinary characters. A second backend
        does it, so the shared one is never toggled (encoding may run on several threads)."""
        if not text:
            return []
        if self._plain_backend is None:
            plain = HFTokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return _encode(self._plain_backend, text, False).ids


def _encode(backend: HFTokenizer, text: str, add_special_tokens: bool) -> Encoding:
    """``backend.encode``, without holding the GIL while it works: ``tokenizers`` releases it
    in ``encode_batch`` only, and a long prompt tokenized on a server's worker thread must not
    stop its event loop (a 7.9 MB prompt held ``/health`` for 6.7 s; issue 27)."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]


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
