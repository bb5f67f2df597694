"""What the Python API accepts as prompts and sampling parameters, checked before anything is
queued: a wrong type is a ``UsageError`` naming the argument, never a ``TypeError`` from deep
inside. No torch here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pagedkv.engine.params import SamplingParams
from pagedkv.engine.structured.spec import StructuredOutput
from pagedkv.errors import UsageError
from pagedkv.sched.refusal import Refusal

Prompt = str | Sequence[int]
_PARAMS_TYPE = "params must be a SamplingParams (or a list of them, one per prompt), got {}"


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def check_params(params: object) -> SamplingParams:
    """``params`` itself, the defaults for None, or UsageError."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise UsageError(_PARAMS_TYPE.format(type(params).__name__), "params")
    return params


def tokenize(tokenizer: Encoder, prompt: object) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids) for a string or a list of token ids."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (bytes, bytearray))
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return None, list(prompt)
    raise UsageError(
        f"a prompt is a string or a list of token ids, got {type(prompt).__name__}", "prompt"
    )


def pair_prompts(prompts: object, params: object) -> list[tuple[object, SamplingParams]]:
    """One (prompt, params) pair per prompt of ``generate``'s arguments. A bare string (or one
    list of token ids) is one prompt; one ``SamplingParams`` (or None) serves every prompt."""
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise UsageError(
            f"prompts must be a string, a list of token ids or a list of those, "
            f"got {type(prompts).__name__}",
            "prompts",
        )
    if params is None or isinstance(params, SamplingParams):
        plist = [params] * len(prompts)
    elif isinstance(params, (list, tuple)):
        plist = list(params)
    else:
        raise UsageError(_PARAMS_TYPE.format(type(params).__name__), "params")
    if len(plist) != len(prompts):
        raise UsageError(f"{len(plist)} sampling params for {len(prompts)} prompts", "params")
    return [(p, check_params(q)) for p, q in zip(prompts, plist, strict=True)]


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    refusal: Callable[[int, int, int], Refusal | None],
    compile_grammar: Callable[[StructuredOutput], object],
) -> None:
    """``LLMEngine.check_request``'s rules, given the scheduler's ``refusal`` and the grammar
    cache's ``compile`` (which fills the cache: the engine thread then only looks it up)."""
    if not prompt_token_ids:
        raise UsageError("the prompt is empty", param="prompt")
    biased = [t for t, _ in params.logit_bias]
    for name, ids in (
        ("prompt", prompt_token_ids),
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", biased),
    ):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise UsageError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", name)
    refused = refusal(len(prompt_token_ids), params.max_tokens, params.n)
    if refused is not None:
        raise UsageError(refused.reason, param=refused.param, code=refused.code)
    if params.structured is not None:
        compile_grammar(params.structured)
