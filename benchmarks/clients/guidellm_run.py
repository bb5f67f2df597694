"""guidellm 0.8.1's default streaming benchmark against `pagedkv serve` on the embedded model.

Starts `pagedkv serve` (embedded SmolLM2-135M-Instruct, fp32) on a free loopback port, runs
`guidellm run` with its default backend (openai_http: streaming /v1/chat/completions with
stream_options.include_usage + continuous_usage_stats, max_completion_tokens and ignore_eos)
on synthetic text sized for a small CPU, once per concurrency level, then reads guidellm's JSON
report and checks, for every benchmark:

* every request completed: none errored, none incomplete, as many as were asked for;
* each completed request produced exactly --output-tokens tokens (ignore_eos honoured);
* TTFT and ITL are reported, with non-zero medians.

It prints one row per benchmark and exits 1 if a check fails. guidellm needs a tokenizer to
build the synthetic prompts; an offline Hugging Face folder is exported once from the GGUF.

    /tmp/clients/bin/python benchmarks/clients/guidellm_run.py            # 1 and 4 streams
    /tmp/clients/bin/python benchmarks/clients/guidellm_run.py --streams 1 --requests 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _common import (
    DEFAULT_PAGEDKV,
    cache_dir,
    embedded_gguf,
    pagedkv_serve,
    refused,
    tokenizer_dir,
    verdict,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pagedkv", type=Path, default=DEFAULT_PAGEDKV, help="pagedkv command")
    p.add_argument("--prompt-tokens", type=int, default=64, help="synthetic prompt length")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--streams", default="1,4", help="concurrency levels, one benchmark each")
    p.add_argument("--requests", type=int, default=12, help="requests per benchmark")
    p.add_argument("--max-seconds", type=float, default=120, help="time cap per benchmark")
    p.add_argument(
        "--request-format",
        default="/v1/chat/completions",
        choices=["/v1/chat/completions", "/v1/completions"],
        help="guidellm's request format (its default: chat)",
    )
    p.add_argument("--out-dir", type=Path, default=cache_dir() / "guidellm", help="outputs")
    return p.parse_args(argv)


def run_guidellm(root: str, model: str, tokenizer: Path, report: Path, args) -> int:
    cmd = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={root},model={model},request_format={args.request_format}",
        "--profile", f"kind=concurrent,streams={args.streams.split(',')[0]}",
        "--override", "profile.streams", args.streams,
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--constraint", f"kind=max_duration,seconds={args.max_seconds}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--output", f"kind=json,path={report}",
        "--output", "kind=console",
        "--disable-console-interactive",
    ]  # fmt: skip
    print("running:", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(cmd, env=env).returncode


def check(report: Path, args) -> list[str]:
    """Print one row per benchmark of guidellm's JSON report; return the failed checks."""
    failures: list[str] = []
    benchmarks = json.loads(report.read_text())["benchmarks"]
    print(
        f"\n{'streams':>7} {'ok':>3} {'err':>3} {'inc':>3} {'out tok':>7} {'TTFT mdn ms':>11}"
        f" {'TTFT p95':>8} {'ITL mdn ms':>10} {'ITL p95':>7} {'out tok/s':>9} {'req/s':>6}"
    )
    for b in benchmarks:
        m = b["metrics"]
        streams = b["config"]["strategy"].get("max_concurrency") or b["config"]["strategy"]
        totals = m["request_totals"]
        ttft, itl = (
            m["time_to_first_token_ms"]["successful"],
            m["inter_token_latency_ms"]["successful"],
        )
        out_tok = m["output_token_count"]["successful"]
        print(
            f"{streams:>7} {totals['successful']:>3} {totals['errored']:>3} {totals['incomplete']:>3}"
            f" {out_tok['median']:>7.0f} {ttft['median']:>11.1f} {ttft['percentiles']['p95']:>8.1f}"
            f" {itl['median']:>10.1f} {itl['percentiles']['p95']:>7.1f}"
            f" {m['output_tokens_per_second']['total']['mean']:>9.1f}"
            f" {m['requests_per_second']['successful']['mean']:>6.2f}"
        )
        label = f"streams={streams}"
        if totals["errored"] or totals["incomplete"]:
            failures.append(
                f"{label}: {totals['errored']} errored, {totals['incomplete']} incomplete"
            )
            for r in (b["requests"].get("errored") or [])[:3]:
                failures.append(f"  error: {r.get('info', {}).get('error')}")
        if totals["successful"] != args.requests:
            failures.append(f"{label}: {totals['successful']} completed of {args.requests} asked")
        if not (out_tok["min"] == out_tok["max"] == args.output_tokens):
            failures.append(f"{label}: output tokens {out_tok['min']}..{out_tok['max']}")
        if not ttft["median"] > 0 or not itl["median"] > 0:
            failures.append(f"{label}: TTFT median {ttft['median']}, ITL median {itl['median']}")
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = args.out_dir / "benchmarks.json"
    report.unlink(missing_ok=True)
    tokenizer = tokenizer_dir(embedded_gguf(args.pagedkv))
    with pagedkv_serve(args.pagedkv, args.out_dir / "serve.log") as (root, model):
        rc = run_guidellm(root, model, tokenizer, report, args)
    for line in refused(args.out_dir / "serve.log"):
        print("server refused:", line)
    if rc != 0 or not report.is_file():
        print(f"FAIL: guidellm exited {rc}; server log {args.out_dir / 'serve.log'}")
        return 1
    failures = check(report, args)
    return verdict(failures, "\nOK: every request completed; TTFT and ITL reported")


if __name__ == "__main__":
    sys.exit(main())
