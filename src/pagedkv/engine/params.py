"""``SamplingParams``: how to pick tokens for one request, validated once at the edge.

This is the one place that decides which sampling values the sampler can run: the CLI, the
server and the Python API all build a ``SamplingParams`` and get the same ``UsageError``
(``param`` names the field) for a value it refuses.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.structured.spec import StructuredOutput
from pagedkv.errors import UsageError

# Guards against absurd values that would only burn memory or time.
MAX_N = 64
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
# top_k travels to the sampler as a 64-bit tensor and is clamped to the vocabulary there; beyond
# int32 it cannot be a real vocabulary size, so such a value is a mistake.
MAX_TOP_K = 2**31 - 1
# Below this, dividing fp32 logits by the temperature overflows; such requests are greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence / frequency: OpenAI's range is [-2, 2]
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# (field, valid?, the rule in words): one check of ``SamplingParams``
_Rule = tuple[str, bool, str]


def _as_fp32(value: float) -> float:
    """``value`` rounded to fp32, as the sampler will see it (0.0 for what underflows)."""
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature`` below 1e-5 (0 included) is greedy. ``seed`` makes
    sampling reproducible per request; sample ``i`` of ``n`` draws from ``seed + i``, so ``n``
    samples equal ``n`` separate requests seeded ``seed, seed + 1, ...``. ``top_k`` 0 or -1 is
    off (-1 is vLLM's spelling). ``logprobs`` asks for the chosen token's log-probability plus
    that many top alternatives (0 = chosen only); ``prompt_logprobs`` the same for every prompt
    token after the first (scored in the prefill, never from the prefix cache). Invalid values
    raise ``UsageError``.

    Logit processing (``engine/step/logits_processing.py``), applied before greedy or random choice:
    ``logit_bias`` ``((token_id, bias), ...)`` is added to those logits; ``repetition_penalty``
    (vLLM's) divides the positive and multiplies the negative logits of every token already in
    the prompt or output; ``frequency_penalty`` and ``presence_penalty`` (OpenAI's) subtract
    ``count x frequency + presence`` for each token already generated; ``min_p`` drops tokens
    below ``min_p`` x the most likely one's probability; ``min_tokens`` keeps EOS and
    ``stop_token_ids`` out of the first that many output tokens. ``structured``: the output
    must match it (``engine/structured/grammar.py`` masks every token it forbids; the sample stops once
    the structure is complete)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            object.__setattr__(self, "stop", tuple(stop))
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        except TypeError:
            raise UsageError("stop and stop_token_ids must be lists", param="stop") from None
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise UsageError("logit_bias must map token ids to numbers", "logit_bias") from None
        for param, ok, rule in self._rules():
            if not ok:
                value = getattr(self, param)
                raise UsageError(f"{param} must be {rule}, got {value!r}", param=param)

    def _rules(self) -> list[_Rule]:
        """(field, valid?, the rule in words); checked in order, the first failure is raised."""
        return [*self._draw_rules(), *self._output_rules(), *self._logit_rules()]

    def _draw_rules(self) -> list[_Rule]:
        """How many tokens, and how each is drawn."""
        top_p = self.top_p
        return [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            (
                "temperature",
                _is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
                f"a finite number in [0, {MAX_TEMPERATURE:g}]",
            ),
            (
                "top_k",
                _is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
                f"an integer in [0, {MAX_TOP_K}] (0 or -1 = off)",
            ),
            (
                "top_p",
                _is_number(top_p) and 0.0 < top_p <= 1.0 and _as_fp32(top_p) > 0.0,
                "a number in (0, 1] that is not 0 in fp32 (at least 1e-45)",
            ),
            ("n", _is_int(self.n) and 1 <= self.n <= MAX_N, f"an integer in [1, {MAX_N}]"),
            ("seed", self.seed is None or _is_int(self.seed), "an integer"),
        ]

    def _output_rules(self) -> list[_Rule]:
        """What ends a sample, and what it reports beside its tokens."""
        return [
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            (
                "stop_token_ids",
                all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "token ids (integers >= 0)",
            ),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "true or false"),
            (
                "logprobs",
                self.logprobs is None
                or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"an integer in [0, {MAX_LOGPROBS}]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None
                or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"an integer in [0, {MAX_LOGPROBS}]",
            ),
        ]

    def _logit_rules(self) -> list[_Rule]:
        """The logit processing applied before the choice (penalties, biases, the structure,
        ``min_tokens``)."""
        return [
            *(
                (
                    name,
                    _is_number(v) and -MAX_PENALTY <= v <= MAX_PENALTY,
                    f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                )
                for name, v in (
                    ("presence_penalty", self.presence_penalty),
                    ("frequency_penalty", self.frequency_penalty),
                )
            ),
            (
                "repetition_penalty",
                _is_number(self.repetition_penalty)
                and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)",
            ),
            ("min_p", _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "a number in [0, 1]"),
            (
                "logit_bias",
                len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES
                and all(
                    _is_int(t) and t >= 0 and _is_number(b) and abs(b) <= MAX_LOGIT_BIAS
                    for t, b in self.logit_bias
                ),
                f"at most {MAX_LOGIT_BIAS_ENTRIES} token ids (integers >= 0) with biases in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
            (
                "structured",
                self.structured is None or isinstance(self.structured, StructuredOutput),
                "a StructuredOutput",
            ),
            (
                "min_tokens",
                _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                "an integer in [0, max_tokens]",
            ),
        ]

    @property
    def processes_logits(self) -> bool:
        """Whether any logit processing applies (the sampler skips the rest)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def sample_seed(self, sample_index: int) -> int | None:
        """The seed of sample ``sample_index`` of this request (None: unseeded)."""
        return None if self.seed is None else self.seed + sample_index
