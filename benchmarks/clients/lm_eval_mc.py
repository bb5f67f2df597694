"""lm-evaluation-harness 0.4.13 multiple choice: pagedkv serve scores as transformers does.

One local task (lm_eval_tasks/pagedkv_mc40.yaml: 40 hand-made four-choice questions, no
download) is run twice with --log_samples:

(a) lm-eval's ``hf`` model: transformers loads the embedded SmolLM2-135M-Instruct GGUF
    (dequantized to fp32, as pagedkv does) and scores every choice itself;
(b) lm-eval's ``local-completions`` model against `pagedkv serve` on the same GGUF: for each
    batch of (context + choice) token-id prompts it POSTs /v1/completions with
    ``echo: true, logprobs: 1, max_tokens: 1, temperature: 0`` and sums the echoed prompt
    token logprobs after the context.

(c) then compares: the accuracies (acc and acc_norm) must be equal and every choice's
    log-likelihood must agree within --tol (default 1e-3); it prints one row per question and
    exits 1 on a mismatch or when a run fails. (a) tokenizes with a folder exported from the
    GGUF; (b) by default leaves the choice to lm-eval, which takes the server's own tokenizer
    (/tokenizer_info + /tokenize) when both answer, so equal scores also mean equal token ids;
    --server-tokenizer hf gives (b) the exported folder instead.

Before (b) it sends lm-eval's own loglikelihood payload once and prints the server's answer,
and probes /tokenizer_info and /tokenize as lm-eval's tokenizer auto-detection does.

    /tmp/clients/bin/python benchmarks/clients/lm_eval_mc.py
    /tmp/clients/bin/python benchmarks/clients/lm_eval_mc.py --parts server   # (b) only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from _common import (
    DEFAULT_PAGEDKV,
    cache_dir,
    embedded_gguf,
    pagedkv_serve,
    refused,
    tokenizer_dir,
    verdict,
)

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
TASK = "pagedkv_mc40"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pagedkv", type=Path, default=DEFAULT_PAGEDKV, help="pagedkv command")
    p.add_argument("--parts", default="hf,server", help="which runs: hf, server or both")
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size (both runs)")
    p.add_argument(
        "--server-tokenizer",
        choices=["auto", "hf"],
        default="auto",
        help="(b)'s tokenizer: lm-eval's default detection (the server's /tokenizer_info and "
        "/tokenize when both answer) or the exported folder (tokenizer_backend=huggingface)",
    )
    p.add_argument("--tol", type=float, default=1e-3, help="max |log-likelihood difference|")
    p.add_argument("--out-dir", type=Path, default=cache_dir() / "lm_eval", help="outputs")
    return p.parse_args(argv)


def lm_eval(model: str, model_args: str, out: Path, batch_size: int, *extra: str) -> int:
    """One `lm_eval run` of the local task into ``out`` (emptied first)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
        "--tasks", TASK, "--include_path", str(TASKS), "--batch_size", str(batch_size),
        "--log_samples", "--output_path", str(out), *extra,
    ]  # fmt: skip
    print("running:", " ".join(cmd), flush=True)
    # data_files in the yaml is relative: lm-eval runs from the task folder.
    return subprocess.run(cmd, cwd=TASKS, env={**os.environ, **OFFLINE}).returncode


def read_run(out: Path) -> tuple[dict, dict[int, dict]]:
    """(aggregated results of the task, samples by doc_id) of one --log_samples run."""
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    lines = next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()
    samples = {s["doc_id"]: s for s in map(json.loads, lines)}
    return results, samples


def http(url: str, body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def probe(root: str, model: str, tokenizer: Path) -> None:
    """Send lm-eval's own loglikelihood payload (built by LocalCompletionsAPI._create_payload)
    for one choice, and its two tokenizer-detection requests; print what the server says."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tokenizer))("Question: 2+2?\nAnswer: 4").input_ids
    payload = LocalCompletionsAPI._create_payload(SimpleNamespace(model=model), [ids])
    status, text = http(f"{root}/v1/completions", payload)
    print(f"probe POST /v1/completions {json.dumps(payload)}\n  -> {status} {text[:600]}")
    status, text = http(f"{root}/tokenizer_info")
    print(f"probe GET /tokenizer_info -> {status} {text[:300]}")
    status, text = http(f"{root}/tokenize", {"prompt": "test", "add_special_tokens": False})
    print(f"probe POST /tokenize -> {status} {text[:300]}", flush=True)


def compare(hf: Path, srv: Path, tol: float) -> list[str]:
    """Print per-question scores of both runs; return the failed checks."""
    (hf_res, hf_s), (srv_res, srv_s) = read_run(hf), read_run(srv)
    failures: list[str] = []
    if hf_s.keys() != srv_s.keys():
        return [f"different documents: {sorted(hf_s.keys() ^ srv_s.keys())}"]
    worst = 0.0
    greedy_diff = 0
    print(f"\n{'doc':>3} {'target':>6} {'hf pick':>7} {'srv pick':>8} {'max |dLL|':>10}  question")
    for doc_id in sorted(hf_s):
        a, b = hf_s[doc_id]["filtered_resps"], srv_s[doc_id]["filtered_resps"]
        lla, llb = [float(x[0]) for x in a], [float(x[0]) for x in b]
        greedy_diff += sum(x[1] != y[1] for x, y in zip(a, b, strict=True))
        diff = max(abs(x - y) for x, y in zip(lla, llb, strict=True))
        worst = max(worst, diff)
        pick_a, pick_b = lla.index(max(lla)), llb.index(max(llb))
        doc = hf_s[doc_id]["doc"]
        print(
            f"{doc_id:>3} {doc['answer']:>6} {pick_a:>7} {pick_b:>8} {diff:>10.2e}  {doc['question']}"
        )
        if diff > tol:
            failures.append(f"doc {doc_id}: log-likelihoods differ by {diff:.3e} > {tol}")
    print(f"\n{'metric':<14} {'hf':>8} {'server':>8}")
    for metric in ("acc,none", "acc_norm,none"):
        print(f"{metric:<14} {hf_res[metric]:>8.4f} {srv_res[metric]:>8.4f}")
        if hf_res[metric] != srv_res[metric]:
            failures.append(f"{metric}: hf {hf_res[metric]} != server {srv_res[metric]}")
    print(f"max |log-likelihood difference| over all choices: {worst:.3e} (tol {tol})")
    print(f"is_greedy flags that differ: {greedy_diff}")
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = set(args.parts.split(","))
    gguf_path = embedded_gguf(args.pagedkv)
    tokenizer = tokenizer_dir(gguf_path)
    hf_out, srv_out = args.out_dir / "hf", args.out_dir / "server"
    failures: list[str] = []
    if "hf" in parts:
        hf_args = (
            f"pretrained={gguf_path.parent},gguf_file={gguf_path.name},"
            f"tokenizer={tokenizer},dtype=float32"
        )
        if lm_eval("hf", hf_args, hf_out, args.batch_size, "--device", "cpu") != 0:
            failures.append("lm-eval hf run failed")
    if "server" in parts:
        log = args.out_dir / "serve.log"
        with pagedkv_serve(args.pagedkv, log) as (root, model):
            probe(root, model, tokenizer)
            srv_args = f"model={model},base_url={root}/v1/completions"
            if args.server_tokenizer == "hf":
                srv_args += f",tokenizer={tokenizer},tokenizer_backend=huggingface"
            rc = lm_eval("local-completions", srv_args, srv_out, args.batch_size)
        for line in refused(log)[:5]:
            print("server refused:", line)
        if rc != 0:
            failures.append(f"lm-eval local-completions run failed (exit {rc}); log {log}")
    if not failures and {"hf", "server"} <= parts:
        failures = compare(hf_out, srv_out, args.tol)
    both = ": equal accuracies, log-likelihoods within tol" if len(parts) > 1 else ""
    return verdict(failures, "OK" + both)


if __name__ == "__main__":
    sys.exit(main())
