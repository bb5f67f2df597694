"""Structured output with llguidance: a grammar per spec, a matcher per sample, and the token
mask the sampler applies to each constrained row.

Why llguidance and not xgrammar (both installed and measured by ``benchmarks/bench_grammar.py``
on this CPU; docs/structured_output.md has the numbers): both mask a step in tens of
microseconds, but xgrammar 0.2.9 lets a string with ``maxLength`` contain raw control bytes,
so a sampled object then fails to parse; llguidance's output parsed and validated every time.
vLLM runs llguidance as its ``guidance`` backend.

A matcher is built per spec once (``GrammarCache.compile``: the grammar's lexer, milliseconds),
from ``LLMEngine.check_request``, which the server runs on a worker thread before the request
reaches the engine thread; each sample then gets a copy (microseconds). A spec is admitted only
once it is compiled *and probed* (``_probe``): the first masks computed and a few tokens walked
on a copy, under llguidance's fuel limits, so a grammar the lexer cannot build (``a{1000000}``)
or one that admits no output (``{"$ref": "#"}``, ``start: start``) is a ``UsageError`` naming
the field before the request runs, and only a spec that passed is cached. A grammar that still
fails inside a step fails its own sample only (``GrammarError``; ``step/draws.collect``) and is
dropped from the cache (``forget``): copies share their prototype's lexer. JSON follows
``engine/structured/json_schema.py``: objects closed unless the schema opens them, blanks bounded and on
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
from pagedkv.engine.structured.json_schema import guidance_schema
from pagedkv.engine.structured.probe import (
    CONTENT_KINDS,
    limits,
    one_line,
    oversized,
    probe,
    reason,
)
from pagedkv.engine.structured.spec import StructuredOutput
from pagedkv.errors import UsageError
from pagedkv.model.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256


class GrammarError(RuntimeError):
    """A constrained sample's grammar failed inside a step (its lexer ran out of fuel or states,
    or it refused a token): that sample's request fails, no other."""


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
        """The prototype matcher of ``spec``, compiled and probed (module docstring);
        ``UsageError`` naming ``spec.param`` (or the part at fault) when llguidance refuses
        it, cannot build it within its limits, or it admits no output. Cached only once it
        passed."""
        key = _key(spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        for part in spec.parts:  # each tool's schema alone, so an error names its field
            self.compile(part)
        matcher = self._build(spec)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def _build(self, spec: StructuredOutput) -> Any:
        import llguidance

        tokenizer = self._tokenizer_of_llguidance()
        try:
            grammar = _grammar(spec)
            schema = json.loads(spec.spec) if spec.kind == "json" else None
            error = oversized(spec, schema) or llguidance.LLMatcher.validate_grammar(
                grammar, tokenizer, limits=limits()
            )
        except Exception as exc:  # a GBNF grammar gbnf_to_lark cannot read, a bad schema
            error = str(exc) or type(exc).__name__
        if error:
            raise _refusal(spec, f"cannot be compiled into a grammar: {one_line(error)}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
        if why := probe(matcher, self._tokenizer.eos_token_id, spec.kind in CONTENT_KINDS):
            raise _refusal(spec, f"cannot be used as an output constraint: {why}")
        return matcher

    def __contains__(self, spec: StructuredOutput) -> bool:
        with self._lock:
            return _key(spec) in self._cache

    def forget(self, spec: StructuredOutput) -> None:
        """Drop ``spec``'s prototype (one of its samples failed inside a step: the copies share
        its lexer, so the next request compiles it afresh)."""
        with self._lock:
            self._cache.pop(_key(spec), None)

    def matchers(self, spec: StructuredOutput | None, n: int) -> list[Any] | None:
        """One fresh matcher per sample of a request (None without a spec)."""
        if spec is None:
            return None
        prototype = self.compile(spec)
        return [prototype.deep_copy() for _ in range(n)]


def _refusal(spec: StructuredOutput, why: str) -> UsageError:
    return UsageError(f"{spec.param} {why}", param=spec.param)


def _key(spec: StructuredOutput) -> tuple[str, str, bool, bool]:
    return (spec.kind, spec.spec, spec.open_objects, spec.whitespace)


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


def apply_masks(logits: torch.Tensor, matchers: list[Any | None]) -> dict[int, GrammarError]:
    """Set to -inf (in place) every logit row ``i``'s tokens that ``matchers[i]`` forbids next.
    Returns the rows whose matcher failed computing its mask (their rows are left to be drawn
    and then dropped: the failure is their sample's alone). Never advances a matcher."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return {}
    import llguidance.torch as llt

    bitmask = llt.allocate_token_bitmask(len(rows), logits.shape[-1])
    failed: dict[int, GrammarError] = {}
    for k, i in enumerate(rows):
        llt.fill_next_token_bitmask(matchers[i], bitmask, k)
        if matchers[i].is_error():
            failed[i] = GrammarError(f"the output constraint failed: {reason(matchers[i])}")
    index = to_device(rows, torch.int64, logits.device)
    masked = logits.index_select(0, index)
    llt.apply_token_bitmask_inplace(masked, upload(bitmask, logits.device))
    logits.index_copy_(0, index, masked)
    return failed


def accept(matcher: Any, token_id: int) -> bool:
    """Advance ``matcher`` by the sampled token; True once the structure is complete and
    closed (the sample must stop). ``GrammarError`` when it refuses the token (a token its mask
    allowed is always accepted) or fails."""
    if not matcher.consume_token(token_id):
        raise GrammarError(f"the output constraint refused token {token_id}: {reason(matcher)}")
    return matcher.is_stopped()


def advance(matchers: list[Any | None], token_ids: list[int]) -> list[bool]:
    """``accept`` for the samples of one entry, all or none: when one refuses its token, the
    ones already advanced are rolled back before ``GrammarError`` propagates, so every matcher
    stays where its sample's committed text says."""
    done: list[Any] = []
    complete: list[bool] = []
    try:
        for matcher, token in zip(matchers, token_ids, strict=True):
            complete.append(matcher is not None and accept(matcher, token))
            if matcher is not None:
                done.append(matcher)
    except Exception:
        for matcher in done:
            matcher.rollback(1)
        raise
    return complete
