"""Fields a generation request may carry beyond the ones pagedkv implements.

The rule (docs/server.md):

1. A field pagedkv implements is typed and checked: a wrong type or value is a 400 naming it.
2. A field that OpenAI's API or vLLM's extensions define but pagedkv does not implement is
   accepted at its neutral value (what changes nothing: ``"use_beam_search": false``) or when
   it only describes the request (``metadata``, ``store``); any other value is a 400 that says
   it is not supported (``code: "unsupported"``), never silently ignored, because the client
   asked for a behaviour it would not get.
3. A field nobody defines is accepted and ignored, as vLLM does: clients and frameworks add
   their own (a typo too), and refusing them breaks clients that work elsewhere. Each such
   name is logged once per process, and every response lists them in the
   ``x-pagedkv-ignored-fields`` header, so a typo is visible.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from pagedkv.server.errors import APIError

log = logging.getLogger("pagedkv.server")
IGNORED_FIELDS_HEADER = "x-pagedkv-ignored-fields"
MAX_LOGGED_NAMES = 1000  # a client inventing names forever must not grow the log set forever
MAX_NAME_CHARS = 64


def _anything(_: Any) -> bool:
    return True


def _is(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: (
        any(value == n and type(value) is type(n) for n in neutral) or (value is None)
    )


# name -> whether the value is neutral (changes nothing pagedkv does)
DEFINED_ELSEWHERE: dict[str, Callable[[Any], bool]] = {
    # OpenAI: informational
    "metadata": _anything,
    "store": _anything,
    "service_tier": _anything,
    "prompt_cache_key": _anything,
    "safety_identifier": _anything,
    # OpenAI: behaviour pagedkv lacks
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _is(),
    "prediction": _is(),
    "reasoning_effort": _is(),
    "web_search_options": _is(),
    "verbosity": _is(),
    "functions": _is(),
    "function_call": _is("none"),
    # vLLM's extensions pagedkv lacks
    "use_beam_search": _is(False),
    "length_penalty": _is(1.0, 1),
    "priority": _is(0),
    "include_stop_str_in_output": _is(False),
    "skip_special_tokens": _is(True),
    "spaces_between_special_tokens": _is(True),
    "truncate_prompt_tokens": _is(),
    "allowed_token_ids": _is(),
    "bad_words": _is(),
    "prompt_embeds": _is(),
    "return_tokens_as_token_ids": _is(False),
    "return_token_ids": _is(False),
    "guided_decoding_backend": _anything,
    "guided_whitespace_pattern": _is(),
    "structural_tag": _is(),
    "logits_processors": _is(),
    "vllm_xargs": _is(),
    "kv_transfer_params": _is(),
    "request_id": _anything,
    "add_special_tokens": _is(True, False),
    "add_generation_prompt": _is(True),
    "continue_final_message": _is(False),
    "chat_template": _is(),
    "chat_template_kwargs": _is(),
    "documents": _is(),
    "mm_processor_kwargs": _is(),
    "response_prefix": _is(),
    # vLLM's on chat; pagedkv has them on /v1/completions only
    "echo": _is(False),
    "prompt_logprobs": _is(),
}

_logged: set[str] = set()
_lock = threading.Lock()


def sort_extra_fields(extra: dict[str, Any] | None) -> list[str]:
    """Judge a request's fields beyond the implemented ones: ``APIError`` for one defined
    elsewhere with a value pagedkv cannot honour; returns the names ignored (rules 2 and 3)."""
    ignored = []
    for name, value in (extra or {}).items():
        neutral = DEFINED_ELSEWHERE.get(name)
        if neutral is not None:
            if not neutral(value):
                raise APIError(
                    f"{name} is not supported by pagedkv (only its default value, "
                    "which changes nothing, is accepted)",
                    param=name,
                    code="unsupported",
                )
            continue
        ignored.append(name[:MAX_NAME_CHARS])
    with _lock:
        for name in ignored:
            if name not in _logged and len(_logged) < MAX_LOGGED_NAMES:
                _logged.add(name)
                log.warning("ignoring the request field %r, which pagedkv does not know", name)
    return ignored


def ignored_header(names: list[str]) -> dict[str, str]:
    """The response header that lists the ignored fields (empty: no header)."""
    safe = [n for n in names if n.isascii() and n.isprintable()]
    return {IGNORED_FIELDS_HEADER: ", ".join(safe)} if safe else {}
