"""``SamplingParams``: how to pick tokens for one request, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass

# Guards against absurd values that would only burn memory or time.
MAX_N = 64
MAX_LOGPROBS = 20
# Below this, dividing fp32 logits by the temperature overflows; such requests are greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature`` below 1e-5 (0 included) is greedy. ``seed`` makes sampling
    reproducible per request; sample ``i`` of ``n`` draws from ``seed + i``, so ``n`` samples
    equal ``n`` separate requests seeded ``seed, seed + 1, ...``. ``logprobs`` asks for the
    chosen token's log-probability plus that many top alternatives (0 = chosen only)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be >= 1"),
            (
                isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
                "temperature must be in [0, 100]",
            ),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}]"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message} (got {self!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def sample_seed(self, sample_index: int) -> int | None:
        """The seed of sample ``sample_index`` of this request (None: unseeded)."""
        return None if self.seed is None else self.seed + sample_index
