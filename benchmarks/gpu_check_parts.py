"""What ``gpu_check.py`` builds its checks from: torch references of the kernels, the paged pools
they read, timers, the Llama-3-8B-shaped model with random weights (pagedkv's and transformers'
from the same tensors), a tokenizer-free workload from the Azure trace, and a smaller copy of the
embedded GGUF that fits the device machine's 64 MiB transfer.

Run as a script it writes that copy (``benchmarks/gpu_wheels.sh`` does):

    python benchmarks/gpu_check_parts.py small-gguf OUT.gguf [--layers 6]
"""

from __future__ import annotations

import csv
import itertools
import json
import random
import statistics
import time
from functools import partial
from pathlib import Path

import torch

NAN = float("nan")


# -- paged pools and references ---------------------------------------------------------------


def paged_pool(context_lens, block_size, num_kv_heads, head_dim, dtype, device, gen):
    """K/V pools holding each sequence's context in shuffled blocks (3 spare blocks, so the ids
    are not 0..n-1); every slot no sequence owns is NaN, so a kernel reading past a context
    shows it. Returns k_cache, v_cache [N, B, Hkv, D], block_tables int32 [S, W] (0-padded),
    context_lens int32 [S], all on ``device``."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=torch.float32)
    v_cache = torch.full(shape, NAN, dtype=torch.float32)
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(max(blocks_per_seq), 1), dtype=torch.int32)
    taken = 0
    for s, n in enumerate(context_lens):
        tables[s, : blocks_per_seq[s]] = ids[taken : taken + blocks_per_seq[s]].to(torch.int32)
        taken += blocks_per_seq[s]
        slots = _slots(tables[s], n, block_size)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            n, num_kv_heads, head_dim, generator=gen
        )
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            n, num_kv_heads, head_dim, generator=gen
        )
    context = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(device) for t in (k_cache.to(dtype), v_cache.to(dtype), tables, context)]


def _slots(table_row: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    t = torch.arange(n)
    return table_row.cpu().long()[t // block_size] * block_size + t % block_size


def attention_reference(q, k_cache, v_cache, tables, context_lens, query_start_loc, scale):
    """float64 softmax(q K^T * scale) V on the CPU, K/V gathered slot by slot through each
    block table; new token i of a sequence of q_len new tokens sees keys up to
    context - q_len + i (bottom-right causal). Decode is the case q_len = 1. q [T, Hq, D]."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    k_flat = k_cache.cpu().double().reshape(-1, num_kv_heads, head_dim)
    v_flat = v_cache.cpu().double().reshape(-1, num_kv_heads, head_dim)
    q64 = q.cpu().double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(len(query_start_loc) - 1):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        ctx, q_len = int(context_lens[s]), end - start
        if ctx == 0 or q_len == 0:
            continue  # a padding row: the kernels write zeros
        slots = _slots(tables[s], ctx, block_size)
        k = k_flat[slots].repeat_interleave(group, dim=1)  # [ctx, Hq, D]: head h reads h // G
        v = v_flat[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q64[start:end], k) * scale
        visible = torch.arange(ctx)[None, :] <= (ctx - q_len + torch.arange(q_len))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out


KERNEL_HEADS = (8, 2, 128)  # query heads, KV heads (GQA 4), head dim of the kernel cases


def kernel_shapes(block_size: int, dry_run: bool):
    """(decode contexts, prefill (context, new tokens) per sequence) at one block size: the
    edges of a block, a padding row (context 0), long contexts; a whole prompt, a chunk on a
    cached prefix, a decode row, a long chunk."""
    b = block_size
    if dry_run:
        return [1, b + 1, 40, 0], [(20, 20), (2 * b + 5, 7), (b + 3, 1)]
    return ([1, b - 1, b, b + 1, 3 * b + 5, 0, 517, 2000],
            [(300, 300), (2 * b + 5, 7), (b + 3, 1), (1000, 64), (b, b)])  # fmt: skip


def kernel_cases(kernels, block_size: int, dtype, device, gen, dry_run: bool):
    """[(label, a call returning the kernel's max abs error against its reference)]: decode
    one-pass and split-K (2, 3 and ``decode_splits``' choice), prefill, KV write, block copy."""
    from pagedkv.model.triton.attention import PREFILL_BLOCK_M  # the engine's query tile
    from pagedkv.model.triton.kernels import num_sms

    num_q_heads, num_kv_heads, head_dim = KERNEL_HEADS
    scale = head_dim**-0.5
    decode_lens, prefill = kernel_shapes(block_size, dry_run)

    def decode(splits: int) -> float:
        pool = paged_pool(decode_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
        q = torch.randn(len(decode_lens), num_q_heads, head_dim, generator=gen).to(dtype)
        got = kernels.paged_decode(q.to(device), *pool, scale, num_splits=splits)
        starts = list(range(len(decode_lens) + 1))  # one new token each
        return max_abs_error(got, attention_reference(q, *pool, starts, scale))

    def prefill_error() -> float:
        pool = paged_pool([c for c, _ in prefill], block_size, num_kv_heads, head_dim, dtype,
                          device, gen)  # fmt: skip
        starts = list(itertools.accumulate([n for _, n in prefill], initial=0))
        q = torch.randn(starts[-1], num_q_heads, head_dim, generator=gen).to(dtype)
        tiles = torch.tensor(kernels.prefill_tiles(starts, PREFILL_BLOCK_M), dtype=torch.int32)
        got = kernels.paged_prefill(
            q.to(device), *pool, torch.tensor(starts, dtype=torch.int32, device=device),
            tiles.to(device), scale, block_m=PREFILL_BLOCK_M,
        )  # fmt: skip
        return max_abs_error(got, attention_reference(q, *pool, starts, scale))

    rule = kernels.decode_splits(len(decode_lens), num_kv_heads, max(decode_lens), block_size,
                                 num_sms(device))  # fmt: skip
    cases = []
    for splits in sorted({1, 2, 3, rule}):
        label = "decode one-pass" if splits == 1 else f"decode split {splits}"
        cases.append((label + (" (rule)" if splits == rule else ""), partial(decode, splits)))
    return [*cases, ("prefill (prefix, ragged, decode row)", prefill_error),
            ("write_kv (slot -1 skipped)", partial(write_kv_error, kernels, block_size, dtype,
                                                   device, gen)),
            ("copy_blocks", partial(copy_blocks_error, kernels, block_size, dtype, device,
                                    gen))]  # fmt: skip


def write_kv_error(kernels, block_size: int, dtype, device, gen) -> float:
    """``write_kv`` of 2B+3 tokens into shuffled slots of a 6-block pool, every 4th slot -1,
    against ``index_copy_`` of the kept rows (exact: the values are already in ``dtype``)."""
    _, num_kv_heads, head_dim = KERNEL_HEADS
    shape = (6, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    num_tokens = 2 * block_size + 3
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padded rows: nothing written
    new = [torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
           for _ in range(2)]  # fmt: skip
    keep = slots >= 0
    wants = [c.clone().view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], x[keep])
             for c, x in zip(caches, new, strict=True)]  # fmt: skip
    on = [t.to(device) for t in (*new, *caches, slots)]
    kernels.write_kv(*on)
    written = zip(on[2:4], wants, strict=True)
    return max(max_abs_error(c.view(-1, num_kv_heads, head_dim), w) for c, w in written)


def copy_blocks_error(kernels, block_size: int, dtype, device, gen) -> float:
    """``copy_blocks`` of 3 shuffled pairs in an 8-block pool against indexing."""
    _, num_kv_heads, head_dim = KERNEL_HEADS
    cache = torch.randn((8, block_size, num_kv_heads, head_dim), generator=gen).to(dtype)
    src, dst = torch.tensor([0, 3, 5]), torch.tensor([6, 1, 7])
    want = cache.clone()
    want[dst] = cache[src]
    on = cache.to(device)
    kernels.copy_blocks(on, src.to(device), dst.to(device))
    return max_abs_error(on, want)


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| (NaN anywhere: inf, so it never passes a tolerance)."""
    diff = (got.cpu().double() - want.cpu().double()).abs()
    return float("inf") if torch.isnan(diff).any() else float(diff.max()) if diff.numel() else 0.0


def patch_interpreter_bf16_dot() -> bool:
    """Triton's interpreter keeps bf16 as raw uint16 bits (numpy has no bf16) and its tl.dot
    multiplies those bits as integers; widen bf16 dot operands to fp32 (exact) so the kernels'
    bf16 paths compute under the interpreter what a GPU computes. Only for the dry run (the
    tests' fixture does the same); a compiled kernel never meets it. True when patched."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16  # bf16 is the top half of an fp32
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        return original(self, widen(a), widen(b), d, *args)

    interpreter.InterpreterBuilder.create_dot = create_dot
    return True


# -- timing ---------------------------------------------------------------------------------------


def time_ms(fn, device: torch.device, repeats: int, warmup: int, flush: torch.Tensor | None):
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones. On a
    GPU: CUDA events around each call, the L2 cleared first (``flush`` zeroed: a decode step
    reads its KV from memory, not cache) and the GPU kept busy (``torch.cuda._sleep``) while the
    host queues the call, so the launch's host cost is not timed. On the CPU: the wall clock."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(200_000)  # ~0.1 ms of GPU work: the timed launch queues behind it
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Bytes read plus written per second of a device-to-device copy of ``num_bytes`` (the
    median of ``repeats``): the ceiling a memory-bound kernel is held against."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = statistics.median(time_ms(lambda: dst.copy_(src), device, repeats, 2, None))
    return 2 * num_bytes / (ms / 1e3) / 1e9


def decode_times(
    kernels,
    k_flat,
    v_flat,
    context_len: int,
    batch: int,
    block_size: int,
    num_q_heads: int,
    repeats: int,
    warmup: int,
    flush,
) -> list[dict]:
    """Paged decode over ``batch`` sequences of ``context_len`` tokens in shuffled blocks of a
    pool viewed from ``k_flat``/``v_flat`` [tokens, Hkv, D]: the median time and the bandwidth
    with the split count ``decode_splits`` chooses, and with one pass when that is not 1."""
    from pagedkv.model.triton.kernels import num_sms

    device, (_, num_kv_heads, head_dim) = k_flat.device, k_flat.shape
    num_blocks = batch * -(-context_len // block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = k_flat[: num_blocks * block_size].view(shape)
    v_cache = v_flat[: num_blocks * block_size].view(shape)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), context_len, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_q_heads, head_dim, dtype=k_flat.dtype, device=device)
    out = torch.empty_like(q)
    # K and V of every context token, q in and out back, the block tables.
    moved = batch * context_len * 2 * k_flat[0].nbytes + 2 * q.nbytes + tables.nbytes
    rule = kernels.decode_splits(batch, num_kv_heads, context_len, block_size, num_sms(device))
    timed = []
    for variant, splits in (("rule", rule), ("one pass", 1))[: 1 if rule == 1 else 2]:

        def call(splits=splits):
            kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5,
                                 num_splits=splits, out=out)  # fmt: skip

        ms = statistics.median(time_ms(call, device, repeats, warmup, flush))
        timed.append({"variant": variant, "num_splits": splits, "median_ms": ms,
                      "bytes": moved, "gb_s": moved / (ms / 1e3) / 1e9})  # fmt: skip
    return timed


# -- a Llama-shaped model with random weights ------------------------------------------------------


def llama3_8b_config():
    """Llama-3-8B's ``ModelConfig``: the shapes from the shipped preset, the rest of its
    config.json by hand (RoPE theta 500000 without the llama3 scaling: the weights are random)."""
    from pagedkv.model.config import ModelConfig

    preset = Path(__file__).resolve().parents[1] / "src/pagedkv/presets/llama-3-8b.json"
    p = json.loads(preset.read_text())
    return ModelConfig(
        architecture="llama", vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"], num_layers=p["num_hidden_layers"],
        num_heads=p["num_attention_heads"], num_kv_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"], rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=p["max_position_embeddings"],
        tie_word_embeddings=p["tie_word_embeddings"], attention_bias=False,
    )  # fmt: skip


def tiny_llama_config():
    """The dry run's stand-in: 2 layers, 4 query and 2 KV heads of 32, a vocabulary of 512."""
    from pagedkv.model.config import ModelConfig

    return ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=512, tie_word_embeddings=False,
        attention_bias=False,
    )  # fmt: skip


def random_llama_weights(cfg, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """Canonical-named weights (``CausalLM.load_weights``'s names), made on ``device``: matrices
    N(0, 0.02^2), norms 1. Nothing is read from disk."""
    torch.manual_seed(seed)
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

    weights = {
        "embed_tokens.weight": matrix(cfg.vocab_size, hidden),
        "norm.weight": torch.ones(hidden, device=device, dtype=dtype),
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = matrix(cfg.vocab_size, hidden)
    for i in range(cfg.num_layers):
        layer = {
            "q_proj.weight": matrix(q_rows, hidden),
            "k_proj.weight": matrix(kv_rows, hidden),
            "v_proj.weight": matrix(kv_rows, hidden),
            "o_proj.weight": matrix(hidden, q_rows),
            "gate_proj.weight": matrix(inter, hidden),
            "up_proj.weight": matrix(inter, hidden),
            "down_proj.weight": matrix(hidden, inter),
            "input_layernorm.weight": torch.ones(hidden, device=device, dtype=dtype),
            "post_attention_layernorm.weight": torch.ones(hidden, device=device, dtype=dtype),
        }
        weights.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return weights


_HF_LAYER_NAMES = {
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}


def hf_llama(cfg, weights: dict, device: torch.device, dtype: torch.dtype):
    """transformers' ``LlamaForCausalLM`` of ``cfg`` holding ``weights``' own tensors (assigned,
    not copied: no second copy on the device), in eval mode."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
    )  # fmt: skip
    state = {"model.embed_tokens.weight": weights["embed_tokens.weight"],
             "model.norm.weight": weights["norm.weight"],
             "lm_head.weight": weights.get("lm_head.weight", weights["embed_tokens.weight"])}  # fmt: skip
    for i in range(cfg.num_layers):
        for ours, theirs in _HF_LAYER_NAMES.items():
            state[f"model.layers.{i}.{theirs}"] = weights[f"layers.{i}.{ours}"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the model dtype, on the device: no fp32 detour
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(previous)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def synthetic_tokenizer(vocab_size: int):
    """A valid pagedkv ``Tokenizer`` of exactly ``vocab_size`` ids for a model without one: the
    256 byte-level symbols, then strings of two and three of them (decoding any id gives
    text, as the engine's detokenizer needs); no merges, EOS the last id."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from pagedkv.model.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = itertools.chain(
        alphabet, ("".join(p) for n in (2, 3) for p in itertools.product(alphabet, repeat=n))
    )
    vocab = {w: i for i, w in zip(range(vocab_size), words, strict=False)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    eos = vocab_size - 1
    return Tokenizer(backend, chat_template=None, bos_token_id=None, eos_token_id=eos,
                     stop_token_ids=(eos,))  # fmt: skip


# -- workloads and peers ---------------------------------------------------------------------------


def trace_workload(path, count: int, vocab_size: int, max_prompt: int, max_output: int, seed=0):
    """The first ``count`` requests of an Azure trace CSV: prompts of its ContextTokens and
    outputs of its GeneratedTokens, each capped (and at least 1); prompt ids drawn at random
    (fixed seed, ids >= 256). Returns (prompt ids, output lengths)."""
    rng = random.Random(seed)
    ids, outs = [], []
    with open(path, newline="") as f:
        for row in itertools.islice(csv.DictReader(f), count):
            prompt = min(max(int(row["ContextTokens"]), 1), max_prompt)
            outs.append(min(max(int(row["GeneratedTokens"]), 1), max_output))
            ids.append([rng.randrange(256, vocab_size) for _ in range(prompt)])
    return ids, outs


def hf_generate(model, prompts, new_tokens, batch_size: int, pad_id: int, max_s: float):
    """transformers ``generate``, greedy, EOS ignored, in static left-padded batches of
    ``batch_size`` in order; a batch runs to its longest output (only the requested tokens
    count). Stops starting batches once ``max_s`` seconds are spent. Returns (seconds, useful
    tokens, requests run, the tokens of each request run)."""
    from transformers import GenerationConfig

    device = model.device
    elapsed, useful, done, tokens = 0.0, 0, 0, []
    for start in range(0, len(prompts), batch_size):
        if elapsed > max_s:
            break
        chunk, outs = prompts[start : start + batch_size], new_tokens[start : start + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        cfg = GenerationConfig(max_new_tokens=max(outs), min_new_tokens=max(outs),
                               do_sample=False, pad_token_id=pad_id, eos_token_id=None)  # fmt: skip
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        _sync(device)
        elapsed += time.perf_counter() - t0
        useful += sum(outs)
        done += len(chunk)
        tokens += [row[width : width + n].tolist() for row, n in zip(out, outs, strict=True)]
    return elapsed, useful, done, tokens


class ReplayedGraph:
    """The dry run's stand-in for ``torch.cuda.CUDAGraph`` (as the tests have it): ``record``
    runs the step once and keeps it, ``replay`` reruns it into the recorded output. Everything
    of ``DecodeGraphs`` runs but the recording itself."""

    def record(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self):
        with torch.inference_mode():
            self.out.copy_(self.fn())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- a smaller GGUF of the embedded model ----------------------------------------------------------


def truncate_gguf(src: Path, dst: Path, num_layers: int) -> Path:
    """Write ``dst``: the GGUF ``src`` with only its first ``num_layers`` transformer blocks
    (``llama.block_count`` rewritten, every other key, the tokenizer and the remaining tensors'
    bytes copied as they are). The embedded SmolLM2 (94 MiB) does not fit the device machine's
    transfer; 6 of its 30 layers (about 43 MiB) do, with the real vocabulary and weights."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    count_key = f"{arch}.block_count"
    kept = [t for t in reader.tensors if not _layer_beyond(t.name, num_layers)]
    kv = [f for name, f in reader.fields.items() if not name.startswith("GGUF.")]
    alignment = reader.alignment
    out = bytearray(b"GGUF")
    out += bytes(reader.fields["GGUF.version"].parts[0])
    out += np.array([len(kept), len(kv)], dtype=np.uint64).tobytes()
    for field in kv:
        parts = list(field.parts)
        if field.name == count_key:
            parts[-1] = np.array([num_layers], dtype=parts[-1].dtype)
        out += b"".join(bytes(p) for p in parts)
    offset, infos = 0, []
    for t in kept:
        infos.append((t, offset))
        offset += -(-int(t.n_bytes) // alignment) * alignment
    for t, at in infos:  # name, dims, type as read; the offset is the new one
        out += b"".join(bytes(p) for p in t.field.parts[:-1])
        out += np.array([at], dtype=np.uint64).tobytes()
    out += bytes(-len(out) % alignment)  # the data section starts aligned
    for t, _ in infos:  # in offset order, each padded as its offset was counted
        data = bytes(reader.data[t.data_offset : t.data_offset + int(t.n_bytes)])
        out += data + bytes(-len(data) % alignment)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(bytes(out))
    return dst


def _layer_beyond(name: str, num_layers: int) -> bool:
    return name.startswith("blk.") and int(name.split(".")[1]) >= num_layers


# -- the record and the summary -------------------------------------------------------------------


def versions() -> dict:
    """The versions a device run depends on (None: not installed)."""
    import importlib.metadata as md

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for package in ("triton", "transformers", "tokenizers", "gguf", "accelerate"):
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            out[package] = None
    return out


def summary_markdown(results: dict) -> str:
    """The run as markdown: a header per section (its error when it failed), then its table."""
    meta, v = results["meta"], results["meta"]["versions"]
    lines = [
        f"# gpu_check on {meta['device_name']}" + (" (dry run)" if meta["dry_run"] else ""),
        "",
        f"{meta['started_utc']}, torch {v['torch']} (CUDA {v['cuda']}), triton {v['triton']}, "
        f"transformers {v['transformers']}; load {meta['load_avg_before']}; "
        f"{meta.get('wall_s', '?')} s in all",
    ]
    for name, entry in results["sections"].items():
        lines += ["", f"## {name} ({entry['wall_s']} s)", ""]
        if not entry["ok"]:
            lines.append(f"error: {entry['error']}")
            continue
        lines += _RENDER[name](entry["result"])
    return "\n".join(lines)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _kernels(r: dict) -> list[str]:
    passed = sum(c["ok"] for c in r["cases"])
    rows = [[c["kernel"], c["dtype"], c["block_size"],
             c.get("error") or f"{c['max_abs_error']:.2e}", f"{c['tolerance']:g}",
             "ok" if c["ok"] else "**FAIL**"] for c in r["cases"]]  # fmt: skip
    return [f"{passed}/{len(rows)} cases pass (GQA {r['num_q_heads']}/{r['num_kv_heads']}, "
            f"head dim {r['head_dim']})", "",
            *_table(["kernel", "dtype", "B", "max abs error", "tolerance", ""], rows)]  # fmt: skip


def _greedy(r: dict) -> list[str]:
    rows = [[name, f"{c['identical']}/{r['prompts']}", c["first_divergence"]]
            for name, c in r["comparisons"].items()]  # fmt: skip
    out = [f"{r['model']}, {r['prompts']} prompts x {r['tokens_per_prompt']} tokens, fp32, "
           f"against {r['reference']}", "",
           *_table(["run", "identical", "first divergence per prompt"], rows)]  # fmt: skip
    return out + [f"- {name} failed: {error}" for name, error in r["errors"].items()]


def _ledger(r: dict) -> list[str]:
    rows, refused = [], set()
    for row in r["rows"]:
        where = [row["block_size"], row["context_len"], row["batch"]]
        if "refused" in row:
            refused.add(f"B={row['block_size']}: {'; '.join(row['refused'])}")
        elif "median_ms" not in row:
            rows.append([*where, "-", "-", "-", row.get("skipped") or row.get("error")])
        else:
            rows.append([*where, f"{row['variant']} ({row['num_splits']})",
                         f"{row['median_ms']:.3f}", f"{row['gb_s']:.0f}",
                         f"{row['of_copy_bw']:.0%}"])  # fmt: skip
    s = r["shape"]
    return [f"decode attention, {s['num_q_heads']}/{s['num_kv_heads']} heads of {s['head_dim']}"
            f", {s['dtype']}; device-to-device copy {r['copy_gb_s']:.0f} GB/s", "",
            *_table(["B", "context", "batch", "splits", "ms", "GB/s", "of copy"], rows),
            "", *sorted(refused)]  # fmt: skip


def _engine(r: dict) -> list[str]:
    ratios = r.get("ratio_vs_transformers", {})
    rows = [[f"pagedkv {k}", f"{v['tokens_per_s']:.0f}", f"{v['seconds']:.1f}", v["steps"],
             v["graph_replays"], v["preemptions"], f"{ratios[k]:.2f}x" if k in ratios else "-"]
            for k, v in r["pagedkv"].items()]  # fmt: skip
    if t := r.get("transformers"):
        rows.append([f"transformers generate (batches of {t['batch_size']}, {t['requests_run']}"
                     " requests)", f"{t['tokens_per_s']:.0f}", f"{t['seconds']:.1f}", "-", "-",
                     "-", "1x"])  # fmt: skip
    speedup = r.get("cuda_graphs_speedup")
    return [f"{r['model']}, {r['requests']} requests, {r['prompt_tokens']} prompt and "
            f"{r['output_tokens']} output tokens"
            + (f"; CUDA graphs {speedup:.2f}x eager" if speedup else ""), "",
            *_table(["run", "output tok/s", "s", "steps", "graph replays", "preemptions",
                     "vs transformers"], rows),
            *[f"- {name} failed: {error}" for name, error in r["errors"].items()]]  # fmt: skip


def _profile_sim(r: dict) -> list[str]:
    return [r["profile"], "",
            f"measured {r['measured_s']:.2f} s, simulator {r['predicted_s']:.2f} s: "
            f"{r['rel_error']:+.1%}; steps {r['steps']}, preemptions {r['preemptions']}"]  # fmt: skip


_RENDER = {"kernels": _kernels, "greedy": _greedy, "ledger": _ledger, "engine": _engine,
           "profile_sim": _profile_sim}  # fmt: skip

if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    small = sub.add_parser("small-gguf", help="the embedded GGUF's first --layers blocks")
    small.add_argument("output", type=Path)
    small.add_argument("--layers", type=int, default=6)
    args = p.parse_args()
    from pagedkv.model.embedded import embedded_model_path

    path = truncate_gguf(embedded_model_path(), args.output, args.layers)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.layers} layers)")
