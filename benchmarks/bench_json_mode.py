"""Which JSON whitespace rule lets a small model close JSON mode: the embedded SmolLM2 answers
``response_format: json_object`` prompts under four rules, and we count the answers that
close within ``--max-tokens`` (48: the budget of issue 48's report).

* ``compact``: no whitespace at all (pagedkv before issue 48);
* ``dumps``: exactly ``json.dumps``' separators (``", "``, ``": "``), nothing else;
* ``free``: llguidance's flexible whitespace, unbounded, line breaks included;
* ``pagedkv``: blanks on one line, at most 4 a gap (``engine/structured/json_schema.py``).

Each rule answers every prompt greedily and with three seeds at temperature 1, all prompts
batched in one ``generate`` call; the rules share one engine and run one after another.

    python benchmarks/bench_json_mode.py [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from common import finish_meta, machine_line, machine_meta

PROMPTS = [
    "Return a JSON object with key a equal to 1.",
    "Return a JSON object with key b equal to 2.",
    "Give me a JSON object describing a cat with its name and age.",
    "Reply in JSON: what is the capital of France?",
    "Describe the weather in London as JSON.",
    "Return JSON with the fields name and email for a user called Bob.",
    "List three fruits as a JSON object.",
    "Return a JSON object with key x set to true.",
]
RUNS = [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]  # (temperature, seed)


def rules() -> dict[str, dict]:
    from pagedkv.engine.structured.json_schema import guidance_options

    return {
        "compact": {"whitespace_flexible": False},
        "dumps": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        "free": {"whitespace_flexible": True},
        "pagedkv": guidance_options(whitespace=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    meta = machine_meta()
    print(f"machine: {machine_line(meta)}")
    from llguidance import LLMatcher

    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams, grammar
    from pagedkv.engine.structured.spec import StructuredOutput

    engine = LLMEngine(EngineConfig(log_startup=False, max_model_len=1024,
                                    kv_cache_memory_bytes=512 << 20))  # fmt: skip
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS]
    spec = StructuredOutput("json_object", param="response_format")
    print(f"\n## JSON mode on the embedded model: answers closed within {args.max_tokens} tokens")
    print(f"{len(PROMPTS)} prompts x (greedy + 3 seeds at temperature 1)\n")
    print(
        "| rule | closed | greedy closed | median tokens of the closed | greedy answer to prompt 1 |"
    )
    print("|---|---|---|---|---|")
    for name, options in rules().items():
        text = json.dumps({"type": "object", "x-guidance": options})
        grammar._grammar = lambda _spec, text=text: LLMatcher.grammar_from_json_schema(text)
        engine.grammars = grammar.GrammarCache(tok, engine.info.vocab_size)  # a fresh cache
        closed, greedy, lengths, first = 0, 0, [], ""
        for temperature, seed in RUNS:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                    seed=seed, structured=spec)  # fmt: skip
            for k, out in enumerate(engine.generate(prompts, params)):
                c = out.outputs[0]
                ok = c.finish_reason == "stop"
                closed += ok
                greedy += ok and temperature == 0
                lengths += [len(c.token_ids)] if ok else []
                first = c.text if temperature == 0 and k == 0 else first
        total = len(PROMPTS) * len(RUNS)
        median = sorted(lengths)[len(lengths) // 2] if lengths else "-"
        print(f"| {name} | {closed}/{total} | {greedy}/{len(PROMPTS)} | {median} | `{json.dumps(first)[:70]}` |",
              flush=True)  # fmt: skip
    print(f"load average at the end: {finish_meta(meta)['load_avg_after'][0]:.2f}")


if __name__ == "__main__":
    main()
