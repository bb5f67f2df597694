"""``run_router``: start-up of ``pagedkv route`` -- bind, meet the replicas, load the
tokenizer, serve until interrupted."""

from __future__ import annotations

import sys

from pagedkv.errors import UsageError
from pagedkv.router.config import RouterConfig
from pagedkv.router.handshake import ReplicaInfo, check_compatible, fetch_all_infos


def load_tokenizer(model: str | None):
    """The tokenizer of ``model`` (a GGUF file, a folder holding one, a Hugging Face folder;
    None: the embedded SmolLM2) from its header or ``tokenizer.json`` alone: no weights are
    read. (Importing ``pagedkv.model`` still imports torch: its package imports the forward.)"""
    from pagedkv.model.loader import resolve_model_path
    from pagedkv.model.tokenizer import tokenizer_from_gguf_metadata, tokenizer_from_hf_folder
    from pagedkv.pages.gguf_header import read_gguf_header

    path = resolve_model_path(model)
    if path.is_dir():
        return tokenizer_from_hf_folder(path)
    try:
        return tokenizer_from_gguf_metadata(read_gguf_header(path)[0])
    except ValueError as exc:
        raise UsageError(f"{path}: {exc}", "model") from None


def check_tokenizer(fingerprint: str, model: str | None, replica: ReplicaInfo) -> None:
    """``UsageError`` when the router's tokenizer would give other ids than the replicas'."""
    if replica.tokenizer is not None and replica.tokenizer != fingerprint:
        source = model or "the embedded model"
        raise UsageError(
            f"tokenizer {fingerprint} (--model {source}) vs {replica.tokenizer} "
            f"({replica.url}): the router must tokenize as its replicas do; give --model the "
            "replicas' model",
            "model",
        )


def describe(infos: list[ReplicaInfo], config: RouterConfig) -> str:
    ref = infos[0]
    events = sum(i.kv_events is not None for i in infos)
    return (
        f"pagedkv route: {len(infos)} replicas of {ref.model!r} (block_size={ref.block_size}, "
        f"{ref.hash_algorithm}, max_model_len {ref.max_model_len}); policy {config.policy}; "
        f"{events} of {len(infos)} publish KV events; devices "
        + ", ".join(f"{i.device or '?'}/{i.dtype or '?'}" for i in infos)
    )


def run_router(config: RouterConfig, embedded_model_name: str) -> None:
    """Serve until interrupted. ``UsageError`` (exit 2) for a port in use, a replica that does
    not answer within ``config.wait_s``, or replicas that differ (one line naming both)."""
    import uvicorn

    from pagedkv.router.app import create_router_app
    from pagedkv.server.uvicorn_server import bind, url_of

    sock = bind(config.host, config.port)  # a port in use is an error now
    try:
        infos = fetch_all_infos(config.replica_urls, config.wait_s, config.api_key)
        check_compatible(infos)
        if config.model is None and infos[0].model != embedded_model_name:
            print(
                f"pagedkv route: warning: the replicas serve {infos[0].model!r}; the router "
                f"tokenizes with the embedded {embedded_model_name} (give --model PATH when "
                "they serve another model)",
                file=sys.stderr,
            )
        tokenizer = load_tokenizer(config.model)
        check_tokenizer(tokenizer.fingerprint(), config.model, infos[0])
    except BaseException:
        sock.close()
        raise
    print(describe(infos, config), file=sys.stderr, flush=True)
    if config.policy == "prefix-aware" and not any(i.kv_events for i in infos):
        print(
            "pagedkv route: warning: no replica publishes KV events (serve --kv-events): "
            "prefix-aware routes by load alone",
            file=sys.stderr,
        )
    app = create_router_app(config, infos, tokenizer)
    print(f"pagedkv route: listening on {url_of(sock)}/v1", flush=True)
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level=config.log_level, timeout_graceful_shutdown=5, timeout_keep_alive=30
        )
    )
    server.run(sockets=[sock])
