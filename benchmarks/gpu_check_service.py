"""Section ``service`` of ``gpu_check.py``: ``pagedkv serve`` on the device, driven over HTTP.

Real processes on loopback, fp32 (so a P/D pair's greedy text can equal a single server's), the
greedy section's GGUF (the 6-layer SmolLM2 on the device), ``--max-num-seqs 16``:

1. a prefill instance, then its decode instance, each sizing its pool from the card with its own
   ``--gpu-memory-utilization`` (two engines on one GPU), on one redis-server (the KV store);
2. then together: a single server ``single`` (KV events on), ``tiers`` (a pool of 40 blocks,
   swap preemption and a host tier), a decode instance with another block size (refused: exit
   2), one that re-pages it (``--kv-import relayout``), and a router over ``single`` and
   ``tiers``.

The cases: a chat, a stream, ``n = 4``, a repeated system prompt whose second request reports
cached tokens, logprobs with echo, a JSON schema, cache_salt, ``/metrics`` and ``/pagedkv/info``
naming the device; the P/D and relayout answers equal to ``single``'s; swap and host-tier
counters; a routed request; no blocks in use anywhere after. On the dry run the same code runs
on the CPU (``--device cpu``) with fixed pools.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from gpu_check_engine import greedy_model
from gpu_check_procs import get, metric, pagedkv, post, redis_server, stream
from gpu_check_run import Run, attempt
from pagedkv.pages.layout import load_layout

BLOCK = 16  # tokens
POOL_BLOCKS = 40  # the tiers server's usable blocks: 2,560 tokens, 5 sequences of 512
SYSTEM = ("You are a careful assistant for a paged KV cache engine. Answer in one short "
          "sentence, plainly, without lists, and never repeat the question. ") * 3  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "Name a prime number."}], "max_tokens": 16,
        "temperature": 0}  # fmt: skip


def check_service(run: Run) -> dict:
    """Start every process, run every case, stop everything; per case ``ok`` and what it saw."""
    gguf, source = greedy_model(run)
    on_gpu = run.device.type == "cuda"
    base = ["--model", str(gguf), "--device", "cuda" if on_gpu else "cpu", "--dtype", "float32",
            "--max-num-seqs", "16", "--max-model-len", "512"]  # fmt: skip
    card = ["--gpu-memory-utilization", "0.3"] if on_gpu else ["--kv-cache-memory", "16MiB"]
    fixed = ["--kv-cache-memory", "1GiB" if on_gpu else "16MiB"]
    record = load_layout(str(gguf), "fp32").record_bytes
    tiny_pool = str(record * BLOCK * (POOL_BLOCKS + 1))  # and the null block
    out: dict = {"model": source, "cases": {}, "startup": {}, "errors": {}}
    procs: dict = {}
    # A server that does not start (or a redis-server that cannot run here) fails its own
    # cases only, never the section.
    redis = attempt(out["errors"], "redis", redis_server, run.scratch)
    if redis is None:
        out["errors"].setdefault(
            "redis", "no redis-server: the P/D pair and KV events are not checked"
        )
    try:

        def start(name: str, *args: str):
            procs[name] = pagedkv(name, run.scratch, *args)
            return procs[name]

        if redis is not None:  # the pair first, one at a time: each measures its own card share
            store = ["--kv-store", redis.url]
            start("prefill", "serve", *base, *card, *store, "--role", "prefill")
            if _ready(run, out, procs, "prefill"):
                start("decode", "serve", *base, *card, *store, "--role", "decode",
                      "--prefill-url", procs["prefill"].url)  # fmt: skip
                _ready(run, out, procs, "decode")
                pd = [*store, "--role", "decode", "--prefill-url", procs["prefill"].url]
                start("decode_b32", "serve", *base, *fixed, *pd, "--block-size", "32")
                start("relayout", "serve", *base, *fixed, *pd, "--block-size", "32",
                      "--kv-import", "relayout")  # fmt: skip
        events = ["--kv-events", redis.url] if redis is not None else []
        start("single", "serve", *base, *fixed, *events)
        start("tiers", "serve", *base, "--kv-cache-memory", tiny_pool,
              "--preemption-mode", "swap", "--swap-space", "32MiB", "--host-kv-memory", "32MiB")  # fmt: skip
        for name in ("single", "tiers", "relayout"):
            if name in procs:
                _ready(run, out, procs, name)
        start("router", "route", "--model", str(gguf), "--replica", procs["single"].url,
              "--replica", procs["tiers"].url)  # fmt: skip
        _ready(run, out, procs, "router", path="/health")
        _cases(run, out, procs)
    finally:
        for proc in procs.values():
            proc.stop()
        if redis is not None:
            redis.stop()
    cases = out["cases"]
    out["all_ok"] = bool(cases) and all(c.get("ok") for c in cases.values())
    return out


def _ready(run: Run, out: dict, procs: dict, name: str, path: str = "/health") -> bool:
    """Wait for ``name``; keep its start-up lines (the pool's sizing, the device). False, and
    the reason in ``out["errors"]``, when it exited or never answered."""
    try:
        code = procs[name].wait_ready(path=path)
    except Exception as exc:  # a start that times out fails this server's cases only
        code = f"{type(exc).__name__}: {exc}"
    lines = [ln for ln in procs[name].log().splitlines() if ln.startswith("pagedkv")]
    out["startup"][name] = [ln for ln in lines if any(w in ln for w in
                            ("KV pool", "device", "CUDA graphs", "P/D", "route:"))]  # fmt: skip
    if code is not None:
        out["errors"][name] = f"did not start ({code}): {procs[name].log()[-1500:]}"
        run.log(f"  {name} did not start: {code}")
        return False
    out.setdefault("ready", []).append(name)
    run.log(f"  {name} ready at {procs[name].url}")
    return True


def _case(out: dict, name: str, fn, *args, needs: tuple[str, ...] = ()) -> None:
    """Case ``name``: ``fn(*args)``'s record, or a failure naming the servers in ``needs``
    that did not start."""
    if missing := [n for n in needs if n not in out.get("ready", [])]:
        out["cases"][name] = {"ok": False, "error": f"not run: {', '.join(missing)} not started"}
        return
    try:
        out["cases"][name] = fn(*args)
    except Exception as exc:  # one failing case must not lose the others
        out["cases"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _cases(run: Run, out: dict, procs: dict) -> None:
    single = procs["single"].url
    for name, fn in [("chat", _chat), ("stream", _stream), ("n4", _n4), ("cached", _cached),
                     ("logprobs_echo", _echo), ("json_schema", _json), ("cache_salt", _salt),
                     ("info_and_metrics", _info)]:  # fmt: skip
        _case(out, name, fn, single, run.device.type, needs=("single",))
        run.log(f"  {name}: {out['cases'][name].get('ok')}")
    reference = out["cases"].get("chat", {}).get("text")
    if "decode" in procs:
        _case(out, "pd_request", _same_text, procs["decode"].url, reference, needs=("decode",))
        _case(out, "pd_refused", _refused, procs["decode_b32"])
        _case(out, "pd_relayout", _same_text, procs["relayout"].url, reference,
              needs=("relayout",))  # fmt: skip
    _case(out, "host_tier", _host_tier, procs["tiers"].url, needs=("tiers",))
    _case(out, "swap", _swap, procs["tiers"].url, needs=("tiers",))
    _case(out, "route", _route, procs["router"].url, {single, procs["tiers"].url},
          needs=("router", "single", "tiers"))  # fmt: skip
    servers = [n for n in ("single", "tiers", "prefill", "decode", "relayout")
               if n in out.get("ready", [])]  # fmt: skip
    _case(out, "no_blocks_in_use", _idle, {n: procs[n].url for n in servers})
    for name in ("pd_request", "pd_refused", "pd_relayout", "host_tier", "swap", "route"):
        if name in out["cases"]:
            run.log(f"  {name}: {out['cases'][name].get('ok')}")


def _chat(url: str, _device: str) -> dict:
    status, body, _ = post(f"{url}/v1/chat/completions", CHAT)
    text = body["choices"][0]["message"]["content"] if status == 200 else None
    return {"ok": status == 200 and bool(text), "status": status, "text": text}


def _stream(url: str, _device: str) -> dict:
    status, events, done = stream(f"{url}/v1/chat/completions", CHAT)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return {"ok": status == 200 and done and bool(text), "events": len(events), "text": text}


def _n4(url: str, _device: str) -> dict:
    body = {"prompt": "Once upon a time", "n": 4, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    status, reply, _ = post(f"{url}/v1/completions", body)
    texts = [c["text"] for c in reply.get("choices", [])]
    return {"ok": status == 200 and len(texts) == 4, "distinct": len(set(texts)), "texts": texts}


def _cached(url: str, _device: str) -> dict:
    cached = []
    for question in ("What is paging?", "What is a block table?"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        status, body, _ = post(f"{url}/v1/chat/completions",
                               {"messages": messages, "max_tokens": 4, "temperature": 0})  # fmt: skip
        details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        cached.append(details.get("cached_tokens", 0) if status == 200 else None)
    return {"ok": cached[0] is not None and (cached[1] or 0) > 0, "cached_tokens": cached}


def _echo(url: str, _device: str) -> dict:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "logprobs": 2, "echo": True}  # fmt: skip
    status, reply, _ = post(f"{url}/v1/completions", body)
    lp = reply["choices"][0]["logprobs"] if status == 200 else {}
    tokens = len(lp.get("tokens") or [])
    prompt = (reply.get("usage") or {}).get("prompt_tokens", 0)
    return {"ok": status == 200 and tokens == prompt + 4, "tokens": tokens, "prompt": prompt}


def _json(url: str, _device: str) -> dict:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    body = {**CHAT, "max_tokens": 48, "response_format": fmt,
            "messages": [{"role": "user", "content": "Give a JSON object with a = 1."}]}  # fmt: skip
    status, reply, _ = post(f"{url}/v1/chat/completions", body)
    text = reply["choices"][0]["message"]["content"] if status == 200 else None
    return {"ok": status == 200 and bool(text) and text.lstrip().startswith("{"), "content": text}


def _salt(url: str, _device: str) -> dict:
    status, _, _ = post(f"{url}/v1/chat/completions", {**CHAT, "cache_salt": "tenant-a"})
    return {"ok": status == 200, "status": status}


def _info(url: str, device: str) -> dict:
    _, text = get(f"{url}/pagedkv/info")
    info = json.loads(text)
    _, metrics = get(f"{url}/metrics")
    series = metric(metrics, "pagedkv_engine_info", dtype="float32")
    named = f'device="{info.get("device")}"' in metrics
    ok = str(info.get("device", "")).startswith(device) and series == 1.0 and named
    return {"ok": ok, "device": info.get("device"), "dtype": info.get("dtype"),
            "attention_backend": info.get("attention_backend")}  # fmt: skip


def _same_text(url: str, reference: str | None) -> dict:
    status, body, _ = post(f"{url}/v1/chat/completions", CHAT)
    text = body["choices"][0]["message"]["content"] if status == 200 else None
    _, metrics = get(f"{url}/metrics")
    loaded = metric(metrics, "pagedkv_kv_tier_blocks_total", tier="store", kind="loaded")
    return {"ok": status == 200 and text == reference, "text": text, "store_blocks_loaded": loaded}


def _refused(proc) -> dict:
    code = proc.wait_ready()  # None would be a start: this one must exit
    last = [ln for ln in proc.log().splitlines() if "error" in ln][-1:]
    return {"ok": code == 2 and bool(last) and "block_size" in last[0], "exit": code,
            "line": last[0] if last else None}  # fmt: skip


def _host_tier(url: str) -> dict:
    """An 8-block prompt, then fillers until its blocks left the 40-block pool, then again."""

    def complete(first: int) -> int:
        body = {"prompt": list(range(first, first + 8 * BLOCK)), "max_tokens": 1}
        return post(f"{url}/v1/completions", body)[0]

    statuses = [complete(100)] + [complete(1000 + 200 * i) for i in range(6)] + [complete(100)]
    _, metrics = get(f"{url}/metrics")
    hits = metric(metrics, "pagedkv_prefix_hit_tokens_by_tier_total", tier="host")
    offloaded = metric(metrics, "pagedkv_kv_tier_blocks_total", tier="host", kind="offloaded")
    ok = all(s == 200 for s in statuses) and (hits or 0) > 0
    return {"ok": ok, "host_hit_tokens": hits, "host_blocks_offloaded": offloaded}


def _swap(url: str) -> dict:
    """Four sequences growing to 12 blocks each in a pool of 40: some must be swapped out."""
    body = {"max_tokens": 150, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, f"{url}/v1/completions",
                               {**body, "prompt": list(range(3000 + 50 * i, 3032 + 50 * i))})
                   for i in range(4)]  # fmt: skip
        statuses = [f.result()[0] for f in futures]
    _, metrics = get(f"{url}/metrics")
    # Sequences, not blocks: a swapped sequence whose blocks the prefix cache still holds
    # comes back without a copy.
    out_seqs = metric(metrics, "pagedkv_swap_out_sequences_total")
    in_seqs = metric(metrics, "pagedkv_swap_in_sequences_total")
    out_blocks = metric(metrics, "pagedkv_swap_out_blocks_total")
    ok = all(s == 200 for s in statuses) and (out_seqs or 0) > 0 and in_seqs == out_seqs
    return {"ok": ok, "swap_out_sequences": out_seqs, "swap_in_sequences": in_seqs,
            "swap_out_blocks": out_blocks}  # fmt: skip


def _route(url: str, replicas: set[str]) -> dict:
    status, _, headers = post(f"{url}/v1/chat/completions", CHAT)
    replica = {k.lower(): v for k, v in headers.items()}.get("x-pagedkv-replica")
    _, table = get(f"{url}/pagedkv/replicas")
    return {"ok": status == 200 and replica in replicas, "replica": replica, "table": table}


def _idle(urls: dict[str, str]) -> dict:
    used = {}
    for name, url in urls.items():
        _, metrics = get(f"{url}/metrics")
        used[name] = metric(metrics, "pagedkv_kv_blocks_used")
    return {"ok": all(v == 0 for v in used.values()), "blocks_used": used}
