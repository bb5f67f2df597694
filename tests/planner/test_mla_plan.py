"""The first article's MLA thought experiment end to end (issue 55): the DeepSeek-V2-Lite preset
(27 layers, one latent record of 512 + 64 values per layer and token), each framework's page
for it in `pagedkv plan`, the capacity comparison on one pool (`pagedkv capacity`), and
`pagedkv simulate` on the same record the engine prints. Expected numbers by hand."""

from __future__ import annotations

import contextlib
import io
import json

from pagedkv.cli import main
from pagedkv.pages.layout import load_layout
from tests.planner.helpers import plan_json

V2_LITE_RECORD = 27 * (512 + 64) * 2  # bf16: 31,104 bytes per token
LLAMA3_8B_RECORD = 2 * 32 * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16: 131,072


def _cli(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def test_the_preset_is_deepseek_v2_lite():
    layout = load_layout("deepseek-v2-lite")
    assert (layout.attention, layout.kv_lora_rank, layout.qk_rope_head_dim) == ("mla", 512, 64)
    assert layout.record_bytes == V2_LITE_RECORD
    assert layout.num_params == 15_706_485_888  # every expert: DeepSeek's "15.7B"


def test_plan_shows_each_frameworks_page():
    report = plan_json("--model", "deepseek-v2-lite", "--num-seqs", "64", "--mean-len", "4096",
                       "--memory", "40GiB")  # fmt: skip
    pages = {p["framework"]: p for p in report["framework_pages"]}
    sizes = {name: p["block_size"] for name, p in pages.items()}
    assert sizes == {
        "vLLM + FlashMLA": 64,  # its 16 rewritten by FlashMLA's rule
        "SGLang (FlashInfer/Triton MLA)": 1,
        "SGLang + FlashMLA": 64,
        "TensorRT-LLM": 64,
        "DeepInfer (MXFP8 records)": 128,
        "DeepInfer (FP4 records)": 128,
        "pagedkv (Triton MLA)": 16,  # any B: its default
    }
    assert "16 -> 64: flashmla only supports 64" in pages["vLLM + FlashMLA"]["why"]
    assert pages["vLLM + FlashMLA"]["block_bytes"] == 64 * V2_LITE_RECORD
    # MXFP8: 576 values + one scale byte per 32 = 594 bytes a layer; FP4: 288 + 36 = 324
    assert pages["DeepInfer (MXFP8 records)"]["layer_block_bytes"] == 128 * 594
    assert pages["DeepInfer (FP4 records)"]["layer_block_bytes"] == 128 * 324
    assert pages["pagedkv (Triton MLA)"]["pool_tokens"] == 40 * 2**30 // (16 * V2_LITE_RECORD) * 16
    mha = plan_json("--model", "llama-3-8b", "--num-seqs", "8", "--mean-len", "100")
    assert "framework_pages" not in mha  # the thought experiment is MLA's


def test_capacity_on_one_pool_mla_against_gqa():
    out = json.loads(_cli("capacity", "--memory", "40GiB", "--json"))
    mla, gqa = out["models"]
    assert (mla["model"], gqa["model"]) == ("deepseek-v2-lite", "llama-3-8b")
    assert (mla["record_bytes"], gqa["record_bytes"]) == (V2_LITE_RECORD, LLAMA3_8B_RECORD)
    assert mla["tokens"] == 40 * 2**30 // (16 * V2_LITE_RECORD) * 16 == 1_380_832
    assert gqa["tokens"] == 40 * 2**30 // (16 * LLAMA3_8B_RECORD) * 16 == 327_680
    assert round(gqa["x_first"], 3) == round(327_680 / 1_380_832, 3)
    table = _cli("capacity", "--models", "deepseek-v2-lite,llama-3-8b", "--memory", "40GiB")
    assert "1,380,832" in table and "327,680" in table


def test_simulate_runs_mla_on_the_engines_record():
    out = _cli("simulate", "--synthetic", "requests=20,prompt=300-600,output=20-40",
               "--model", "deepseek-v2-lite", "--gpu", "H100-80GB", "--kv-memory", "1GiB",
               "--policy", "vllm,deepinfer", "--json")  # fmt: skip
    runs = {r["policy"]: r for r in json.loads(out)}
    assert runs["vllm"]["num_kv_slots"] == 2**30 // V2_LITE_RECORD
    assert runs["deepinfer"]["block_size"] == 128
    assert all(r["num_finished"] == 20 for r in runs.values())
