"""langchain-openai against `pagedkv serve`: invoke, stream and batch through ChatOpenAI.

Starts `pagedkv serve` (embedded SmolLM2-135M-Instruct) on a free loopback port and checks
that langchain's ChatOpenAI (which sends /v1/chat/completions with stream_options.include_usage
when streaming) gets a non-empty greedy answer, that streaming yields chunks whose text equals
the non-streamed answer, that usage metadata is filled in, and that a batch of three returns
three answers. Exits 1 on a failure.

    /tmp/clients/bin/python benchmarks/clients/langchain_smoke.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _common import DEFAULT_PAGEDKV, cache_dir, pagedkv_serve, refused, verdict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pagedkv", type=Path, default=DEFAULT_PAGEDKV, help="pagedkv command")
    p.add_argument("--out-dir", type=Path, default=cache_dir() / "langchain", help="outputs")
    args = p.parse_args(argv)
    import httpx
    from langchain_openai import ChatOpenAI

    sent: list[str] = []  # the JSON fields of every request langchain sends

    def record(request: httpx.Request) -> None:
        sent.append(", ".join(sorted(json.loads(request.content or b"{}"))))

    failures: list[str] = []
    log = args.out_dir / "serve.log"
    with pagedkv_serve(args.pagedkv, log) as (root, model):
        llm = ChatOpenAI(
            base_url=f"{root}/v1",
            api_key="unused",
            model=model,
            temperature=0,
            max_tokens=24,
            http_client=httpx.Client(event_hooks={"request": [record]}),
        )
        question = "What is the capital of France?"
        answer = llm.invoke(question)
        print(f"invoke: {answer.content!r} usage={answer.usage_metadata}")
        chunks = list(llm.stream(question, stream_usage=True))
        streamed = "".join(c.content for c in chunks)
        print(f"stream: {len(chunks)} chunks, {streamed!r}")
        batch = llm.batch(["Name a colour.", "Name a fruit.", "Name an animal."])
        print("batch:", [b.content for b in batch])
        if not answer.content:
            failures.append("empty answer")
        if streamed != answer.content:
            failures.append("streamed text differs from the invoked answer")
        if not (answer.usage_metadata or {}).get("output_tokens"):
            failures.append("no usage metadata")
        if len(batch) != 3 or not all(b.content for b in batch):
            failures.append("batch did not return three answers")
    for fields in dict.fromkeys(sent):
        print("langchain sent fields:", fields)
    for line in refused(log):
        failures.append(f"server refused: {line}")
    return verdict(failures)


if __name__ == "__main__":
    sys.exit(main())
