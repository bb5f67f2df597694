"""The edge of the Serve application: a Serve config's ``args`` and ``serve --replicas``'s
flags become one ``ServeRayConfig``, judged before Ray is contacted; without ``--replicas``
nothing imports ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.commands.serve_app import app_config, flags_from_mapping
from pagedkv.errors import UsageError


def test_a_mapping_becomes_serve_s_flags():
    assert flags_from_mapping(
        {
            "kv-cache-memory": "64MiB",
            "fixed_threads": True,
            "model": None,
            "cuda-graphs": False,
            "replicas": 2,
        }
    ) == ["--kv-cache-memory", "64MiB", "--fixed-threads", "--replicas", "2"]
    with pytest.raises(UsageError, match="http_options"):
        flags_from_mapping({"port": 8000})


def test_a_serve_config_s_args_build_the_whole_config():
    cfg = app_config(
        {
            "replicas": 2,
            "kv-cache-memory": "64MiB",
            "block_size": 32,
            "replica-routing": "least-loaded",
            "balance-abs": 2,
            "stats-period": 0.25,
        }
    )
    assert cfg.num_replicas == 2 and cfg.routing == "least-loaded" and cfg.balance_abs == 2
    assert cfg.engine.kv_cache_memory_bytes == 64 << 20 and cfg.engine.block_size == 32
    assert cfg.stats_period_s == 0.25 and cfg.autoscaling is None
    assert app_config({}).num_replicas == 1  # a Serve config without replicas: one


def test_autoscaling_between_replicas_and_max_replicas():
    cfg = app_config({"replicas": 1, "max-replicas": 4, "target-ongoing-requests": 8})
    assert cfg.autoscaling == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"replicas": 0}, "--replicas must be an integer >= 1"),
        ({"replicas": 2, "max-replicas": 1}, "--max-replicas must be an integer >= --replicas"),
        ({"replica-routing": "random"}, "invalid choice: 'random'"),
        ({"no-such-flag": 1}, "unrecognized arguments: --no-such-flag"),
        ({"stats-period": 0}, "--stats-period must be > 0"),
        ({"balance-abs": -1}, "balance_abs must be an integer >= 0"),
        ({"replica-cpus": -1}, "--replica-cpus must be >= 0"),
        ({"prefill-replicas": 1}, "needs --kv-store"),
        ("replicas: 2", "args must be a mapping"),
    ],
)
def test_bad_args_are_one_usage_error_naming_the_flag(args, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        app_config(args)


def test_a_p_d_graph_s_two_sides():
    cfg = app_config(
        {
            "replicas": 2,
            "prefill-replicas": 1,
            "kv-store": "redis://127.0.0.1:6379",
            "kv-import": "relayout",
            "prefill": {"block-size": 32},
        }
    )
    assert cfg.prefill_replicas == 1 and cfg.prefill_engine.block_size == 32
    assert cfg.engine.block_size is None  # the decode side keeps its policy's block size
    assert (cfg.pd_decode.role, cfg.pd_decode.kv_import) == ("decode", "relayout")
    assert (cfg.pd_prefill.role, cfg.pd_prefill.kv_import) == ("prefill", "strict")
    assert cfg.pd_decode.kv_store == cfg.engine.kv_store == "redis://127.0.0.1:6379"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_serve_with_bad_replicas_is_one_line_exit_2_without_ray():
    proc = _run(
        "import sys; from pagedkv.cli import main; code = main(['serve', '--replicas', "
        "'0', '--port', '0']); assert 'ray' not in sys.modules; sys.exit(code)"
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "pagedkv serve: error: --replicas must be an integer >= 1, got 0"
    ]


def test_serve_without_replicas_never_imports_ray():
    """Parsing and every config ``serve`` builds before loading the model, and the serve
    command's modules themselves: ray stays out."""
    proc = _run(
        "import sys, argparse; from pagedkv.cli import build_parser; "
        "from pagedkv.commands import serve, serve_replicas, serve_app; "
        "from pagedkv.commands.engine_flags import engine_config; "
        "args = build_parser().parse_args(['serve', '--port', '0']); "
        "serve.server_config(args); engine_config(args); serve.pd_config(args); "
        "import pagedkv.serve_ray.config, pagedkv.serve_ray.ranking; "
        "assert args.replicas is None; assert 'ray' not in sys.modules, 'ray imported'"
    )
    assert proc.returncode == 0, proc.stderr


def test_the_checked_in_serve_config_builds_its_config():
    """docs/examples/serve_ray.yaml: its import path is the builder, its args parse whole."""
    from pathlib import Path

    import yaml

    from pagedkv.commands import serve_app

    path = Path(__file__).resolve().parents[2] / "docs" / "examples" / "serve_ray.yaml"
    (app,) = yaml.safe_load(path.read_text())["applications"]
    module, _, name = app["import_path"].partition(":")
    assert module == serve_app.__name__ and callable(getattr(serve_app, name))
    cfg = app_config(app["args"])
    assert cfg.num_replicas == 2 and cfg.routing == "prefix-aware"
    assert cfg.replica_num_cpus == 2 and cfg.engine.kv_cache_memory_bytes == 2 << 30
