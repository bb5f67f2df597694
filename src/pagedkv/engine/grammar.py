"""Structured output with llguidance: a grammar per spec, a matcher per sample, and the token
mask the sampler applies to each constrained row.

Why llguidance and not xgrammar (both installed and measured by ``benchmarks/bench_grammar.py``
on this CPU; docs/structured_output.md has the numbers): both mask a step in tens of
microseconds, but xgrammar 0.2.9 lets a string with ``maxLength`` contain raw control bytes,
so a sampled object then fails to parse; llguidance's output parsed and validated every time.
vLLM runs llguidance as its ``guidance`` backend.

A matcher is built per spec once (``GrammarCache.compile``: the grammar's lexer, milliseconds),
from ``LLMEngine.check_request``, which the server runs on a worker thread before the request
reaches the engine thread; each sample then gets a copy (microseconds). JSON follows
``engine/json_schema.py``: objects closed unless the schema opens them, blanks bounded and on
one line. Special tokens are never part of a structure. Once the structure is complete only
EOS is allowed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from pagedkv.engine.device_copies import to_device, upload
from pagedkv.engine.json_schema import guidance_schema
from pagedkv.engine.structured import StructuredOutput
from pagedkv.errors import UsageError
from pagedkv.model.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256
MAX_ERROR_CHARS = 300


class GrammarCache:
    """A prototype matcher per spec for one tokenizer, least recently used dropped first.
    Thread-safe. llguidance is imported on first use: without constrained requests it is
    never loaded."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str, bool, bool], Any] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer_of_llguidance(self) -> Any:
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                tok = self._tokenizer
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tok.backend.to_str(), n_vocab=self._vocab_size, eos_token=tok.eos_token_id
                )
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutput) -> Any:
        """The prototype matcher of ``spec``; ``UsageError`` naming ``spec.param`` when
        llguidance refuses it."""
        import llguidance

        key = (spec.kind, spec.spec, spec.open_objects, spec.whitespace)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        tokenizer = self._tokenizer_of_llguidance()
        try:
            grammar = _grammar(spec)
            error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        except Exception as exc:  # a GBNF grammar gbnf_to_lark cannot read, a bad schema
            error = str(exc) or type(exc).__name__
        if error:
            reason = " ".join(error.split())[:MAX_ERROR_CHARS]
            raise UsageError(f"{spec.param} cannot be compiled into a grammar: {reason}",
                             param=spec.param)  # fmt: skip
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def matchers(self, spec: StructuredOutput | None, n: int) -> list[Any] | None:
        """One fresh matcher per sample of a request (None without a spec)."""
        if spec is None:
            return None
        prototype = self.compile(spec)
        return [prototype.deep_copy() for _ in range(n)]


def _grammar(spec: StructuredOutput) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if spec.kind in ("json", "json_object"):
        schema = json.loads(spec.spec) if spec.kind == "json" else {"type": "object"}
        rules = guidance_schema(schema, open_objects=spec.open_objects, whitespace=spec.whitespace)
        return LLMatcher.grammar_from_json_schema(json.dumps(rules))
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":  # Lark string literals take JSON's escapes
        choices = json.loads(spec.spec)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, choices)))
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.spec)
    text = gbnf_to_lark(spec.spec) if "::=" in spec.spec else spec.spec  # GBNF or Lark
    return LLMatcher.grammar_from_lark(text)


def apply_masks(logits: torch.Tensor, matchers: list[Any | None]) -> None:
    """Set to -inf (in place) every logit row ``i``'s tokens that ``matchers[i]`` forbids next."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import llguidance.torch as llt

    bitmask = llt.allocate_token_bitmask(len(rows), logits.shape[-1])
    for k, i in enumerate(rows):
        llt.fill_next_token_bitmask(matchers[i], bitmask, k)
    index = to_device(rows, torch.int64, logits.device)
    masked = logits.index_select(0, index)
    llt.apply_token_bitmask_inplace(masked, upload(bitmask, logits.device))
    logits.index_copy_(0, index, masked)


def accept(matcher: Any, token_id: int) -> bool:
    """Advance ``matcher`` by the sampled token; True once the structure is complete and
    closed (the sample must stop). A token the mask allowed is always accepted."""
    if not matcher.consume_token(token_id):
        raise RuntimeError(f"the grammar refused token {token_id}: {matcher.get_error()}")
    return matcher.is_stopped()
