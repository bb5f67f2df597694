"""The Serve config entry point: ``import_path: pagedkv.commands.serve_app:build_app``.

``args`` holds ``pagedkv serve``'s flags by name (``model``, ``kv-cache-memory`` or
``kv_cache_memory``, ``replicas``, ``replica-routing``, ...; ``true`` for a flag without a
value), parsed by ``serve``'s own parser, so a Serve config and the command line accept the
same flags with the same checks and defaults. Host, port and the Ray cluster are the Serve
config's (``http_options``, ``serve deploy --address``), not flags. Example:
docs/examples/serve_ray.yaml.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Mapping
from typing import Any

from pagedkv.errors import UsageError

# ``args.prefill``: the flags in which the prefill side's engines differ (P/D, with
# ``prefill-replicas``), e.g. ``{"block-size": 32}`` with ``kv-import: relayout``.
PREFILL_KEY = "prefill"
# Flags a Serve config does not take: Serve owns the endpoint and the cluster.
_NOT_IN_CONFIG = ("host", "port", "ray_address", "ray_num_cpus")


def flags_from_mapping(args: Mapping[str, Any]) -> list[str]:
    """``{"kv-cache-memory": "256MiB", "fixed_threads": True}`` -> ``["--kv-cache-memory",
    "256MiB", "--fixed-threads"]``; ``False`` / ``None`` leave a flag out."""
    argv: list[str] = []
    for key, value in args.items():
        if not isinstance(key, str) or not key.strip("-_"):
            raise UsageError(f"args: {key!r} is not a flag name", "args")
        name = key.strip("-").replace("_", "-")
        if name.replace("-", "_") in _NOT_IN_CONFIG:
            raise UsageError(
                f"args: {key!r} is set by the Serve config itself (http_options, "
                "the cluster), not by pagedkv's args",
                key,
            )
        if value is True:
            argv.append(f"--{name}")
        elif value is not None and value is not False:
            argv += [f"--{name}", str(value)]
    return argv


def parse_serve_flags(argv: list[str]) -> argparse.Namespace:
    """``pagedkv serve``'s parser over ``argv``; a bad flag is a ``UsageError`` carrying
    argparse's message (never a ``SystemExit`` inside Serve's build)."""
    from pagedkv.commands import serve

    parser = argparse.ArgumentParser(prog="pagedkv")
    serve.register(parser.add_subparsers(dest="command"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(["serve", *argv])
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise UsageError(f"args: {lines[-1] if lines else 'invalid flags'}", "args") from None


def app_config(args: Mapping[str, Any]):
    """The ``ServeRayConfig`` a Serve config's ``args`` describe (judged whole, here)."""
    from pagedkv.commands.engine_flags import engine_config
    from pagedkv.commands.serve import pd_config, server_config
    from pagedkv.commands.serve_replicas import serve_ray_config

    if not isinstance(args, Mapping):
        raise UsageError("args must be a mapping of pagedkv serve's flags", "args")
    base = {k: v for k, v in args.items() if k != PREFILL_KEY}
    ns = parse_serve_flags(flags_from_mapping(base))
    if ns.replicas is None:
        ns.replicas = 1
    prefill = args.get(PREFILL_KEY)
    prefill_engine = None
    if prefill is not None:  # the prefill side's engine: the same flags, these changed
        if not isinstance(prefill, Mapping):
            raise UsageError(f"args.{PREFILL_KEY} must be a mapping of serve flags", PREFILL_KEY)
        prefill_ns = parse_serve_flags(flags_from_mapping({**base, **prefill}))
        prefill_engine = engine_config(prefill_ns)
    return serve_ray_config(ns, engine_config(ns), server_config(ns), pd_config, prefill_engine)


def build_app(args: dict[str, Any]) -> Any:
    """Serve's application builder (``serve run`` / ``serve deploy`` / a RayService call it)."""
    from pagedkv.serve_ray.app import build_application

    return build_application(app_config(args or {}))
