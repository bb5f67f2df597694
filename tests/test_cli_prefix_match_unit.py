"""``--prefix-match-unit`` at every command's edge: a unit the policy cannot honour (not
dividing the block size, below 1, a policy without a prefix cache, a radix page above 1) is
one error line and exit 2, before any model loads or trace replays."""

from __future__ import annotations

import pytest

from pagedkv import cli
from pagedkv.engine import EngineConfig
from pagedkv.errors import UsageError

ENGINE_CASES = [
    (
        ["--prefix-match-unit", "3"],
        "the prefix match unit (3 tokens) must divide the block size (16)",
    ),
    (["--prefix-match-unit", "0"], "the prefix match unit must be an integer >= 1 token, got 0"),
    (["--policy", "reserved", "--prefix-match-unit", "1"], "policy reserved has no prefix cache"),
    (["--policy", "llamacpp", "--prefix-match-unit", "1"], "policy llamacpp has no prefix cache"),
    (
        ["--policy", "radix:16", "--prefix-match-unit", "4"],
        "the radix allocator matches whole pages of 16",
    ),
    (
        ["--block-size", "64", "--prefix-match-unit", "48"],
        "(48 tokens) must divide the block size (64)",
    ),
]


@pytest.mark.parametrize(("flags", "message"), ENGINE_CASES)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_engine_commands_refuse_a_unit_in_one_line(command, flags, message, capsys):
    argv = [command, *flags] + (["hello"] if command == "generate" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pagedkv {command}: error: --prefix-match-unit: ")
    assert message in err[0]


def test_the_config_names_the_field_and_keeps_the_default_unit():
    with pytest.raises(UsageError) as caught:
        EngineConfig(prefix_match_unit=5)
    assert caught.value.param == "prefix_match_unit"
    assert EngineConfig().engine_policy(None).prefix_match_unit is None
    assert EngineConfig(policy="trtllm").engine_policy(None).prefix_match_unit == 1  # as shipped
    assert EngineConfig(prefix_match_unit=16).engine_policy(16).unit_problem() is None


SIMULATE_CASES = [
    (["vllm", "5"], "vllm: the prefix match unit (5 tokens) must divide the block size (16)"),
    (["vllm", "1,x"], "--prefix-match-unit: expected whole numbers >= 1 or B, got '1,x'"),
    (["sglang", "1", "--block-sizes", "8"], "the radix allocator matches whole pages of 8"),
]


@pytest.mark.parametrize(("flags", "message"), SIMULATE_CASES)
def test_simulate_refuses_a_unit_in_one_line(flags, message, capsys):
    policy, unit, *more = flags
    workload = ["--synthetic", "requests=2,prompt=10,output=2"]
    argv = ["simulate", *workload, "--policy", policy, "--prefix-match-unit", unit, *more]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_generate_json_splits_the_cached_tokens(tmp_path, capsys):
    """One request after the other (one running at a time): the second's 38 cached tokens
    (BOS + 37 shared characters) are 32 of two whole blocks and 6 of a third, copied."""
    import json

    from tests.model.tiny import make_tiny_model

    make_tiny_model("llama", tmp_path)
    stem = "the quick brown fox jumps over a lazy"
    prompts = [stem + " dog and runs away quickly", stem + " cat sat"]
    flags = ["--block-size", "16", "--prefix-match-unit", "1", "--max-num-seqs", "1"]
    argv = ["generate", "--model", str(tmp_path), "--json", "--max-tokens", "3", *flags, *prompts]
    assert cli.main(argv) == 0
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (first["cached_tokens"], first["partial_cached_tokens"]) == (0, 0)
    assert (second["cached_tokens"], second["partial_cached_tokens"]) == (38, 6)
    assert second["prefix_copied_bytes"] == 6 * 512  # the tiny model: 512 bytes a token
