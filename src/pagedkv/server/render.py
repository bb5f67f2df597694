"""From engine outputs to OpenAI bodies: whole responses, stream chunks, usage, logprobs.

Streaming sends text deltas: exactly ``text[len(sent):]`` of each new snapshot. The engine's
text never takes back what it once exposed (its detokenizer holds back a possible stop string's
beginning and an incomplete UTF-8 character), so the server holds back nothing of its own.
Choice ``index`` = ``prompt_index * n + sample index``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine import CompletionOutput, RequestOutput
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server import protocol as p
from pagedkv.server.echo import (
    NO_ECHO,
    Echo,
    prompt_legacy_logprobs,
    vllm_prompt_logprobs,
    without_generation,
)
from pagedkv.server.logprobs import chat_logprobs, completion_logprobs
from pagedkv.server.tools import ToolUse

# The engine's finish reasons a client can see; "abort" and "refused" never reach one.
_FINISH = {"stop": "stop", "length": "length"}


@dataclass(frozen=True)
class ResponseHeader:
    """What every body of one response repeats."""

    id: str
    created_s: int
    model: str
    chat: bool
    n: int
    want_logprobs: bool
    tools: ToolUse | None = None  # chat with tools: calls parsed from the text


def usage(outputs: list[RequestOutput]) -> p.Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
    )


def completion_choice(
    head: ResponseHeader,
    tokenizer: Tokenizer,
    echo: Echo,
    out: RequestOutput,
    prompt_index: int,
    c: CompletionOutput,
    text: str,
    first_token: int = 0,
    text_offset: int = 0,
    lead: bool = True,
) -> p.CompletionChoice:
    """The choice of sample ``c`` carrying ``text`` and the logprobs of tokens
    ``first_token:``; when ``lead`` (the choice's first body) the echoed prompt comes first."""
    logprobs = p.CompletionLogprobs() if head.want_logprobs else None
    if lead and echo.texts is not None:
        text = echo.texts[prompt_index] + text
        if logprobs is not None and echo.legacy_logprobs:
            text_offset = prompt_legacy_logprobs(tokenizer, out, logprobs)
    if logprobs is not None:
        completion_logprobs(tokenizer, c, first_token, text_offset, logprobs)
    finish = _FINISH.get(c.finish_reason or "") if c.finished else None
    return p.CompletionChoice(
        index=prompt_index * head.n + c.index,
        text=text,
        logprobs=logprobs,
        finish_reason=finish,
        prompt_logprobs=vllm_prompt_logprobs(tokenizer, out)
        if echo.prompt_logprobs and lead
        else None,
    )


def shown_text(
    head: ResponseHeader, c: CompletionOutput
) -> tuple[str | None, list[tuple[str, p.OutFunctionCall]], str | None]:
    """A chat sample's content so far, its tool calls once finished (``server/tools.py``) and
    its finish reason: while running, the text before anything that may be a call; then the
    text outside calls (None when there is none beside calls). A sample with calls finishes
    ``tool_calls``, unless a call was cut by the length limit: that is ``length``, and the cut
    call is neither a call nor content."""
    use = head.tools
    finish = _FINISH.get(c.finish_reason or "") if c.finished else None
    if use is None or not use.parse:
        return c.text, [], finish
    if not c.finished:
        return use.streamable(c.text), [], None
    parsed = use.parse_text(c.text, at_length=c.finish_reason == "length")
    calls = [(i, p.OutFunctionCall(name=n, arguments=a)) for i, n, a in parsed.calls]
    if calls and not parsed.cut:
        finish = "tool_calls"
    return (parsed.content if calls or parsed.cut else c.text), calls, finish


def full_response(
    head: ResponseHeader,
    tokenizer: Tokenizer,
    outputs: list[RequestOutput],
    echo: Echo = NO_ECHO,
) -> p.Completion | p.ChatCompletion:
    """The non-streaming body of a finished run (outputs in prompt order)."""
    if echo.score_only:
        outputs = [without_generation(o) for o in outputs]
    samples = [(i * head.n + c.index, c) for i, o in enumerate(outputs) for c in o.outputs]
    if head.chat:
        choices = []
        for k, c in samples:
            content, calls, finish = shown_text(head, c)
            message = p.AssistantMessage(
                content=content,
                tool_calls=[p.OutToolCall(id=i, function=f) for i, f in calls] or None,
            )
            choices.append(
                p.ChatChoice(
                    index=k,
                    message=message,
                    finish_reason=finish,
                    logprobs=chat_logprobs(tokenizer, c, 0) if head.want_logprobs else None,
                )
            )
        return p.ChatCompletion(
            id=head.id,
            created=head.created_s,
            model=head.model,
            choices=choices,
            usage=usage(outputs),
        )
    choices = [
        completion_choice(head, tokenizer, echo, o, i, c, c.text)
        for i, o in enumerate(outputs)
        for c in o.outputs
    ]
    return p.Completion(
        id=head.id, created=head.created_s, model=head.model, choices=choices, usage=usage(outputs)
    )


@dataclass
class _Sent:
    """What one choice's client has received so far."""

    chars: int = 0
    tokens: int = 0
    token_chars: int = 0  # text offset of the next token (token strings sent so far)
    role_sent: bool = False
    done: bool = False


@dataclass
class StreamRenderer:
    """Turns successive snapshots of a run into chunk bodies; one renderer per response.
    ``continuous_usage``: every chunk carries the usage so far (vLLM's
    ``stream_options.continuous_usage_stats``)."""

    head: ResponseHeader
    tokenizer: Tokenizer
    continuous_usage: bool = False
    echo: Echo = NO_ECHO
    _sent: dict[int, _Sent] = field(default_factory=dict)
    _latest: dict[int, RequestOutput] = field(default_factory=dict)

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        if self.echo.score_only:
            out = without_generation(out)
        self._latest[prompt_index] = out
        bodies = self._choice_chunks(prompt_index, out)
        if self.continuous_usage:
            so_far = p.dump(usage(list(self._latest.values())))
            for body in bodies:
                body["usage"] = so_far
        return bodies

    def _choice_chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        bodies = []
        for c in out.outputs:
            k = prompt_index * self.head.n + c.index
            sent = self._sent.setdefault(k, _Sent())
            if sent.done:
                continue
            text, calls, finish = shown_text(self.head, c) if self.head.chat else (c.text, [], None)
            text = text or ""
            end = len(text)
            delta = text[sent.chars :]
            if not delta and not c.finished and sent.role_sent:
                continue  # nothing printable yet; its tokens go out with the next text
            bodies.append(self._chunk(k, out, c, sent, delta, calls, finish))
            sent.chars = max(sent.chars, end)
            sent.tokens = len(c.token_ids)
            sent.role_sent = True
            sent.done = c.finished
        return bodies

    def _chunk(
        self,
        k: int,
        out: RequestOutput,
        c: CompletionOutput,
        sent: _Sent,
        delta: str,
        calls: list[tuple[str, p.OutFunctionCall]],
        finish: str | None,
    ) -> dict:
        """One chunk of choice ``k``: ``delta`` and, when it finished, ``calls`` and ``finish``
        (chat; the completions route reads its own)."""
        h = self.head
        if h.chat:
            logprobs = chat_logprobs(self.tokenizer, c, sent.tokens) if h.want_logprobs else None
            role = None if sent.role_sent else "assistant"
            # A call goes out whole in the sample's last chunk (clients accumulate deltas).
            tool_calls = [
                p.DeltaToolCall(index=j, id=i, function=f) for j, (i, f) in enumerate(calls)
            ] or None
            message = p.DeltaMessage(
                role=role, content=delta if delta or not calls else None, tool_calls=tool_calls
            )
            choice = p.ChatChunkChoice(
                index=k, delta=message, logprobs=logprobs, finish_reason=finish
            )
            body = p.ChatCompletionChunk(
                id=h.id, created=h.created_s, model=h.model, choices=[choice]
            )
        else:
            # Offsets follow the token strings, not the characters sent: the engine's
            # hold-back delays text but never moves a token.
            choice = completion_choice(
                h,
                self.tokenizer,
                self.echo,
                out,
                k // h.n,
                c,
                delta,
                sent.tokens,
                sent.token_chars,
                not sent.role_sent,
            )
            logprobs = choice.logprobs
            if logprobs is not None and logprobs.tokens:
                sent.token_chars = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            body = p.Completion(id=h.id, created=h.created_s, model=h.model, choices=[choice])
        data = p.dump(body)
        data.pop("usage", None)  # only the final usage chunk carries usage
        if h.chat:  # as OpenAI: the role only in a choice's first delta
            delta = data["choices"][0]["delta"]
            data["choices"][0]["delta"] = {k: v for k, v in delta.items() if v is not None}
        else:
            data.pop("system_fingerprint", None)
        return data

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        h = self.head
        kind = p.ChatCompletionChunk if h.chat else p.Completion
        if self.echo.score_only:
            outputs = [without_generation(o) for o in outputs]
        body = kind(id=h.id, created=h.created_s, model=h.model, choices=[], usage=usage(outputs))
        return p.dump(body)
