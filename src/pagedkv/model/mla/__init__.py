"""Multi-head latent attention (DeepSeek-V2/V3) over the paged pool: the attention part of the
one decoder layer for the "mla" families (``config.ARCHITECTURES``).

- ``attention.py``: ``MLAAttention``, the part's projections and its order (queries, the KV
  compression and its norm, RoPE on the rotary dims), then the backend's ``mla_attend`` op;
- ``latent.py``: the per-head weights of ``kv_b_proj`` and the two ways to attend over latents
  (absorbed: queries into latent space; decompressed: per-head K and V of the latents);
- ``paged.py``: the op in torch ops over the paged latent pool (the reference, and the CPU's);
- ``rope.py``: DeepSeek's YaRN frequencies and the interleaved rotary rows reordered at load.

The pool holds one latent record per token and layer (``pages/layout.py``: ``kv_lora_rank +
qk_rope_head_dim`` values); which way a prefill chunk attends is ``MLADims.decompress_prefill``
(``pages/mla_shape.py``). The Triton kernel is ``model/triton/mla_decode.py``.
"""
