"""`pagedkv serve` argument handling: validated at the edge before any model is loaded."""

from __future__ import annotations

import socket

import pytest

import pagedkv.engine
from pagedkv.cli import build_parser, main
from pagedkv.commands.serve import DEFAULT_MAX_SAMPLES_PER_REQUEST, server_config
from pagedkv.server import config as config_module
from pagedkv.server.config import API_KEY_ENV, ServerConfig


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_are_loopback_and_no_key(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = server_config(parse())
    assert config.host == "127.0.0.1" and config.port == 8000 and config.api_key is None
    assert config.served_model_name == "SmolLM2-135M-Instruct"


def test_api_key_from_flag_or_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_config(parse()).api_key == "from-env"
    assert server_config(parse("--api-key", "from-flag")).api_key == "from-flag"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert server_config(parse()).api_key is None


def test_served_model_name_follows_the_model_path():
    assert server_config(parse("--model", "/models/qwen2-0.5b")).served_model_name == "qwen2-0.5b"
    assert server_config(parse("--model", "/m/llama.Q4_0.gguf")).served_model_name == "llama.Q4_0"
    assert server_config(parse("--served-model-name", "x")).served_model_name == "x"


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "70000"],
        ["--port", "-1"],
        ["--api-key", " "],
        ["--host", ""],
        ["--served-model-name", ""],  # an error, not a silent fallback to the default name
        ["--served-model-name", "  "],
        ["--max-samples-per-request", "0"],
    ],
)
def test_bad_flags_exit_2_before_loading_a_model(argv, capsys):
    assert main(["serve", *argv]) == 2
    assert "pagedkv serve: error:" in capsys.readouterr().err


def test_config_is_frozen_and_validated():
    config = ServerConfig(served_model_name="m")
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="log-level"):
        ServerConfig(served_model_name="m", log_level="loud")
    with pytest.raises(ValueError, match="served-model-name"):
        ServerConfig(served_model_name="")


def test_max_samples_default_is_the_servers():
    assert DEFAULT_MAX_SAMPLES_PER_REQUEST == config_module.DEFAULT_MAX_SAMPLES_PER_REQUEST
    assert server_config(parse()).max_samples_per_request == DEFAULT_MAX_SAMPLES_PER_REQUEST
    assert server_config(parse("--max-samples-per-request", "8")).max_samples_per_request == 8


def test_port_in_use_is_reported_before_the_model_loads(monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(pagedkv.engine, "LLMEngine", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "pagedkv serve: error: cannot listen on 127.0.0.1:" in err and "in use" in err
