"""One engine process on a shared store: ``python -m tests.kvstore.store_worker MODEL URL SALT``
reads prompts (JSON list of strings) on stdin, runs them greedily with ``check_invariants``
after every step, flushes its writes and prints one JSON line: tokens, prefix-hit tokens and
the store counters."""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch

    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
    from pagedkv.engine.startup import build_parts
    from pagedkv.model import load_model

    torch.set_num_threads(1)
    model, url, salt = sys.argv[1], sys.argv[2], sys.argv[3] or None
    prompts = json.loads(sys.stdin.read())
    config = EngineConfig(log_startup=False, max_model_len=128, kv_store=url)
    engine = LLMEngine(config, parts=build_parts(config, load_model(model, progress=False)))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(p, params, cache_salt=salt) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.allocator.check_invariants()
    store = engine.parts.kv_store
    assert store.flush(30)
    print(json.dumps({
        "tokens": [done[r].outputs[0].token_ids for r in ids],
        "cached_tokens": [done[r].num_cached_tokens for r in ids],
        "store": store.counters.as_dict(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
