"""``load_model``: any supported model path (or the embedded default) → config, model, tokenizer."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pagedkv.errors import UsageError
from pagedkv.model import native
from pagedkv.model.config import ARCHITECTURES, ModelConfig
from pagedkv.model.embedded import embedded_model_path
from pagedkv.model.gguf import gguf_metadata, iter_gguf_weights, read_gguf
from pagedkv.model.llama import CausalLM, build_model
from pagedkv.model.parallel import TensorRank, parallelize
from pagedkv.model.quant import QuantizingFactory
from pagedkv.model.safetensors import iter_hf_weights
from pagedkv.model.shards import WeightsDigest
from pagedkv.model.tokenizer import (
    Tokenizer,
    tokenizer_from_gguf_metadata,
    tokenizer_from_hf_folder,
)
from pagedkv.pages.kv_dtypes import ENGINE_DTYPES
from pagedkv.pages.shape import ModelShape
from pagedkv.pages.sources import load_shape, shape_from_gguf
from pagedkv.placement import WEIGHT_FORMATS

# The engine's dtype names (pages/kv_dtypes.py owns them) → torch's.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ENGINE_DTYPES}


class _StatusLine:
    """A one-line progress report on stderr (rewritten in place on a terminal)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.tty = sys.stderr.isatty()
        self.started = time.perf_counter()
        self.last_percent = -1

    def __call__(self, done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        if not self.enabled or percent == self.last_percent or (not self.tty and percent % 25):
            return
        self.last_percent = percent
        end = "\n" if not self.tty or done == total else ""
        print(
            f"\r{self.label}: {done}/{total} tensors ({percent}%)",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    def finish(self, what: str) -> None:
        if self.enabled:
            print(
                f"{what} in {time.perf_counter() - self.started:.1f} s", file=sys.stderr, flush=True
            )


@contextmanager
def _one_thread() -> Iterator[None]:
    """Decoding and copying weights is memory-bound elementwise work on many small tensors:
    two threads gained nothing on a quiet machine and were 10x slower on a busy one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def resolve_model_path(path: str | os.PathLike[str] | None) -> Path:
    """None → the embedded GGUF; a ``.gguf`` file; a folder with ``config.json``; or a folder
    holding exactly one ``.gguf``. Anything else: ``FileNotFoundError`` / ``UsageError``."""
    if path is None:
        return embedded_model_path()
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path not found: {p}")
    if p.is_file():
        return p
    if (p / "config.json").is_file():
        return p
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise UsageError(
        f"{p} holds neither config.json nor exactly one .gguf file ({len(ggufs)} found)"
    )


def read_model_shape(path: str | os.PathLike[str] | None = None) -> ModelShape:
    """The shape of the model ``load_model(path)`` would load, from its ``config.json`` or GGUF
    header alone (no weights: well under a second), so that start-up can check what depends
    on it before the slow load. Same errors as ``load_model`` for a bad path or file."""
    resolved = resolve_model_path(path)
    if resolved.is_file():  # a GGUF whatever its name, as load_model reads it
        return shape_from_gguf(resolved, architectures=ARCHITECTURES)
    return load_shape(resolved, architectures=ARCHITECTURES)


def _read(
    resolved: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    status: _StatusLine,
    digest: WeightsDigest,
    rank: TensorRank | None,
) -> tuple[Tokenizer, dict[str, torch.Tensor]]:
    """The tokenizer and the canonical tensors of ``resolved`` (each in ``digest`` as read;
    only ``rank``'s share of it kept)."""

    def kept(stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            digest.update(name, tensor)
            yield name, tensor if rank is None else rank.shard.slice(name, tensor)

    if resolved.is_dir():
        tokenizer = tokenizer_from_hf_folder(resolved, config.eos_token_ids)
        return tokenizer, dict(kept(iter_hf_weights(resolved, config, dtype, status)))
    reader = read_gguf(resolved)
    tokenizer = tokenizer_from_gguf_metadata(gguf_metadata(reader))
    tensors = dict(kept(iter_gguf_weights(reader, config, dtype, status)))
    del reader  # releases the memory map: every tensor is a copy now
    return tokenizer, tensors


def load_model(
    path: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
    progress: bool = True,
    weights: str = "float",
    device: torch.device | str = "cpu",
    rank: TensorRank | None = None,
) -> tuple[ModelConfig, CausalLM, Tokenizer]:
    """Load a model for inference (eval mode, no grads, activations in ``dtype``).

    ``path``: None (embedded SmolLM2-135M-Instruct), a GGUF file, or a Hugging Face folder.
    ``weights``: "float" (in ``dtype``, the reference) or a quantized option of
    ``placement.WEIGHT_FORMATS`` (weight-only, the kernel per shape by ``quant.py``'s rule; the
    choice is kept in ``model.weights_report``).
    The load time is printed when ``progress``; the engine's start-up report prints the choice.
    ``device``: where the weights go (read on the host, converted, moved); quantized weights
    run on the CPU only.
    ``rank``: load tensor-parallel rank ``rank.group.rank``'s share only (``shards.py``: each
    tensor sliced as it is read), made parallel (``parallel.py``); the config returned is the
    whole model's, the model's own its share's. The model's ``weights_digest`` is of the weights
    as read, the same at every split.
    Progress goes to stderr when ``progress``. Errors: ``FileNotFoundError`` for a missing
    path, ``UsageError`` for anything unreadable or unsupported (e.g. the architecture).
    """
    if dtype not in TORCH_DTYPES:
        raise UsageError(f"unsupported dtype {dtype!r} (supported: {sorted(TORCH_DTYPES)})")
    if weights not in WEIGHT_FORMATS:  # EngineConfig.weights, checked there first
        raise UsageError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    torch_dtype = TORCH_DTYPES[dtype]
    if weights != "float" and torch.device(device).type != "cpu":
        raise UsageError(f"--weights {weights} runs on the CPU only (its kernels are pagedkv's C)")
    factory = QuantizingFactory(weights, torch_dtype) if weights != "float" else None
    resolved = resolve_model_path(path)
    config = ModelConfig.from_shape(read_model_shape(resolved))
    status = _StatusLine(f"loading {resolved.name}", progress)
    digest = WeightsDigest(torch_dtype, weights)
    with _one_thread():
        tokenizer, tensors = _read(resolved, config, torch_dtype, status, digest, rank)
        model = build_model(config if rank is None else rank.shard.local_config())
        try:
            model.load_weights(tensors, torch_dtype, factory, device)
        except ValueError as exc:  # the file's tensors do not fit its own config
            raise UsageError(f"{resolved}: {exc}") from None
        del tensors
        if rank is not None:
            parallelize(model, rank.group, rank.shard)
    model.weights_digest = digest.hexdigest()
    model.eval()
    if factory is not None:
        model.weights_report = factory.report()
    else:
        model.weights_report = f"weights {dtype}, {model.lm_head.describe()}"
        on_cpu = torch.device(device).type == "cpu"
        if dtype == "float32" and on_cpu and native.kernels() is None:
            model.weights_report += f" (native kernels off: {native.unavailable_reason()})"
    status.finish(
        f"loaded {config.architecture} ({config.num_layers} layers, hidden {config.hidden_size}, "
        f"{dtype}, weights {weights})"
    )
    return config, model, tokenizer
