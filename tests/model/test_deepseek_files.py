"""DeepSeek checkpoints as files (issue 55): a GGUF ``deepseek2`` written the way llama.cpp's
converter writes one (``tiny_deepseek_gguf.py``: gguf-py's own tensor names, experts stacked,
``kv_b_proj`` whole or split per head) loads to transformers' logits and greedy tokens; and bad
files or configs (a missing MLA or expert tensor, inconsistent ranks or head dims, an unknown
scoring function, a GGUF without MLA metadata) are one clear ``UsageError`` naming the field,
one ``error:`` line and exit 2 on the command line."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv import cli
from pagedkv.errors import UsageError
from pagedkv.model import load_model
from tests.model.helpers import greedy_paged
from tests.model.tiny import hf_config, make_tiny_model
from tests.model.tiny_deepseek_gguf import write_deepseek_gguf

PROMPT = list(range(30, 70))


def v3_for_gguf():
    """The tiny V3 with DeepSeek's equal YaRN mscales (a GGUF has one ``yarn_log_multiplier``:
    llama.cpp takes mscale = mscale_all_dim, as every DeepSeek checkpoint has them)."""
    config = hf_config("deepseek_v3")
    config.rope_parameters["mscale"] = config.rope_parameters["mscale_all_dim"]
    return config


@pytest.mark.parametrize(("arch", "split_kv_b"), [("deepseek_v2", False), ("deepseek_v3", True)])
def test_a_gguf_deepseek2_gives_transformers_logits(tmp_path, arch, split_kv_b):
    config = v3_for_gguf() if arch == "deepseek_v3" else None
    hf = make_tiny_model(arch, tmp_path, config=config)
    path = tmp_path / "tiny.gguf"
    write_deepseek_gguf(hf, path, split_kv_b)
    cfg, model, _ = load_model(path, progress=False)
    assert cfg.architecture == "deepseek2" and cfg.mla.q_lora_rank == hf.config.q_lora_rank
    assert cfg.moe.scoring == ("sigmoid" if arch == "deepseek_v3" else "softmax")
    assert cfg.moe.topk_method == ("noaux_tc" if arch == "deepseek_v3" else "group_limited_greedy")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want_logits = hf(ids).logits[0]
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                           do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    tokens, logits = greedy_paged(model, [PROMPT], 6, 16)
    assert (logits[0] - want_logits).abs().max().item() < 1e-4
    assert tokens[0] == want[0, len(PROMPT) :].tolist()


def test_a_gguf_without_mla_metadata_is_refused(tmp_path):
    hf = make_tiny_model("deepseek_v2", tmp_path)
    path = tmp_path / "tiny.gguf"
    write_deepseek_gguf(hf, path, split_kv_b=True, drop=("kv_lora_rank",))
    with pytest.raises(UsageError, match="lacks deepseek2.attention.kv_lora_rank"):
        load_model(path, progress=False)
    write_deepseek_gguf(hf, path, split_kv_b=True, drop=("rope_dimension_count",))
    with pytest.raises(UsageError, match="lacks deepseek2.rope.dimension_count"):
        load_model(path, progress=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-bad")
    make_tiny_model("deepseek_v3", path)
    return path


def _copy(folder, tmp_path, drop: str | None = None, **config_changes):
    """``folder`` copied into ``tmp_path`` without tensor ``drop`` and with the config
    changed."""
    from safetensors.torch import load_file, save_file

    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((folder / f).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **config_changes}))
    tensors = load_file(folder / "model.safetensors")
    tensors.pop(drop, None)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize(
    ("drop", "changes", "words"),
    [
        ("model.layers.1.self_attn.kv_b_proj.weight", {}, r"missing \['layers.1.kv_b_proj.weight'\]"),
        ("model.layers.2.mlp.experts.5.up_proj.weight", {},
         r"missing \['layers.2.experts.5.up_proj.weight'\]"),
        ("model.layers.1.mlp.gate.e_score_correction_bias", {}, r"missing \['layers.1.router.bias'\]"),
        (None, {"kv_lora_rank": 48}, r"layers.0.kv_a_proj.weight: 40 rows, not heads of 56"),
        (None, {"qk_nope_head_dim": 12}, r"layers.0.q_b_proj.weight: 96 rows, not heads of 20"),
        (None, {"v_head_dim": 8}, r"layers.0.o_proj.weight: shape \(64, 64\), model wants \(64, 32\)"),
        (None, {"scoring_func": "tanh"}, "scoring_func must be one of softmax, sigmoid, got 'tanh'"),
        (None, {"topk_method": "random"}, "topk_method must be one of"),
        (None, {"qk_rope_head_dim": 7}, "qk_rope_head_dim must be an even integer"),
        (None, {"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(8\)"),
        (None, {"attention_bias": True}, "attention_bias is not supported for MLA"),
    ],
)  # fmt: skip
def test_bad_checkpoints_are_one_line_naming_the_field(folder, tmp_path, capsys, drop, changes,
                                                       words):  # fmt: skip
    bad = _copy(folder, tmp_path, drop, **changes)
    with pytest.raises(UsageError, match=words):
        load_model(bad, progress=False)
    assert cli.main(["generate", "--model", str(bad), "--max-tokens", "2", "hi"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("pagedkv generate: error:"), errors


def test_tensor_parallel_mla_is_refused_in_one_line_before_any_worker_starts(folder, capsys):
    """MLA's latent projections and experts have no rank shares: at --tensor-parallel-size 2 a
    DeepSeek model is one line naming the flag, exit 2, before the weights load or a worker
    process starts (start-up's checks run first)."""
    import multiprocessing

    args = ["generate", "--model", str(folder), "--max-tokens", "2"]
    assert cli.main([*args, "--tensor-parallel-size", "2", "hi"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "--tensor-parallel-size 2" in errors[0], errors
    assert "MLA" in errors[0] and not multiprocessing.active_children()
