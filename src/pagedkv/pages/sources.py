"""The one reader of a model's shape: a shipped preset, a Hugging Face ``config.json`` (or its
folder) or a GGUF header becomes one frozen ``ModelShape``. Pure Python: no torch.

Everyone asks this module: the planner's ``KVLayout``, the simulator's cost model, the engine's
start-up (before the weights load, to size the KV pool) and the model loader (``ModelConfig``
is built from a shape). Facts a planner does not need (norm epsilon, FFN width, ...) may be
None; ``ModelShape.require`` turns a missing one into an error naming the file's own key.

    shape = load_shape("llama-3-8b")      # or a config.json, its folder, a .gguf file
    shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.query_dim, shape.num_params
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.pages.gguf_header import gguf_shape_fields, read_gguf_header
from pagedkv.pages.mla_shape import mla_hf_fields
from pagedkv.pages.shape import Llama3RopeScaling, ModelShape

# -- Hugging Face config.json (and presets, which use its spelling) ---------------------------


def shape_from_hf_config(
    config: Mapping[str, Any], name: str, source: str = "hf", origin: str | None = None
) -> ModelShape:
    """The shape of a ``config.json`` dict (Llama, Qwen2, Mistral, DeepSeek MLA; transformers
    4.x or 5.x spelling). ``num_params`` is the dict's own when present (presets carry it), else
    estimated for dense models. UsageError naming the key that is missing or malformed."""
    origin = origin or repr(name)

    def get(key: str, default: Any = None) -> Any:
        value = config.get(key)
        return default if value is None else value

    try:
        num_heads = _int(config["num_attention_heads"], "num_attention_heads", 1)
        mla = bool(get("kv_lora_rank"))
        rope = dict(get("rope_parameters") or get("rope_scaling") or {})
        rope_type = str(rope.get("rope_type", rope.get("type")) or "default")
        window = get("sliding_window") if get("use_sliding_window", True) else None
        eos = get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        fields = {
            "architecture": get("model_type"),
            "attention": "mla" if mla else "mha",
            "num_layers": _int(config["num_hidden_layers"], "num_hidden_layers", 1),
            "num_heads": num_heads,
            "num_kv_heads": num_heads
            if mla
            else _int(get("num_key_value_heads", num_heads), "num_key_value_heads", 1),
            "head_dim": _int(get("head_dim"), "head_dim", 1)
            if get("head_dim")
            else _int(config["hidden_size"], "hidden_size", 1) // num_heads,
            "vocab_size": _int_or_none(get("vocab_size"), "vocab_size"),
            "hidden_size": _int_or_none(get("hidden_size"), "hidden_size"),
            "intermediate_size": _int_or_none(get("intermediate_size"), "intermediate_size"),
            "num_params": _int_or_none(get("num_params"), "num_params"),
            "max_context_tokens": _int(
                get("max_position_embeddings", 2048), "max_position_embeddings", 1
            ),
            "sliding_window_tokens": _int_or_none(window, "sliding_window"),
            "weight_dtype": str(get("torch_dtype") or get("dtype") or "bf16"),
            "rms_norm_eps": float(get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope.get("rope_theta", get("rope_theta", 10000.0))),
            "rope_scaling_type": rope_type,
            "rope_scaling": Llama3RopeScaling.from_dict(rope) if rope_type == "llama3" else None,
            "tie_word_embeddings": bool(get("tie_word_embeddings", False)),
            "attention_bias": None
            if get("attention_bias") is None
            else bool(get("attention_bias")),
            "bos_token_id": _int_or_none(get("bos_token_id"), "bos_token_id"),
            "eos_token_ids": tuple(int(e) for e in eos_ids),
        }
        fields.update(mla_hf_fields(config, rope, fields) if mla else {})  # DeepSeek's
    except KeyError as exc:
        raise UsageError(f"model config {origin} lacks the key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"model config {origin}: {exc}") from None
    if fields["num_params"] is None and not mla:
        fields["num_params"] = estimate_dense_num_params(config)
    return ModelShape(name=name, source=source, origin=origin, **fields)


def estimate_dense_num_params(config: Mapping[str, Any]) -> int | None:
    """Parameter count of a dense Llama/Qwen2/Qwen3/Mistral config (None if a needed key is
    missing). Embeddings (+ an untied LM head), per layer q/k/v/o projections (+ q/k/v biases
    for Qwen2, + Q and K's head norms for Qwen3), a gated MLP of three matrices and two RMSNorms,
    and the final norm.
    """
    try:
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_dim = int(config.get("head_dim") or hidden // num_heads)
        intermediate = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
        num_layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError):
        return None
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    per_layer = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    archs = " ".join(config.get("architectures") or [])
    if config.get("attention_bias") or "Qwen2" in archs or config.get("model_type") == "qwen2":
        per_layer += q_dim + 2 * kv_dim
    if config.get("model_type") == "qwen3" or "Qwen3" in archs:  # per-head Q and K RMSNorms
        per_layer += 2 * head_dim
    per_layer += 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return num_layers * per_layer + embeddings + hidden


def _int(value: Any, key: str, minimum: int = 0) -> int:
    """A count from a model config: an integer (2.0 is fine, 2.5 or "2" is not) >= minimum."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral:
        raise UsageError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise UsageError(f"{key} must be >= {minimum}, got {value!r}")
    return int(value)


def _int_or_none(value: Any, key: str) -> int | None:
    return None if value is None else _int(value, key)


# -- GGUF header ------------------------------------------------------------------------------


def shape_from_gguf(path: str | Path, architectures: Collection[str] | None = None) -> ModelShape:
    """The shape of a GGUF file, from its header only (no tensor data is read)."""
    metadata, tensor_shapes = read_gguf_header(path)
    if architectures is not None:
        _check_architecture(metadata.get("general.architecture"), "gguf", architectures)
    fields = gguf_shape_fields(metadata, tensor_shapes, str(path))
    fields.setdefault("name", Path(path).stem)
    return ModelShape(source="gguf", origin=str(path), **fields)


# -- presets and the dispatcher ---------------------------------------------------------------


def _presets_dir() -> Path:
    return Path(str(resources.files("pagedkv").joinpath("presets")))


def list_presets() -> list[str]:
    """Names of the shipped model presets, sorted."""
    return sorted(p.stem for p in _presets_dir().glob("*.json"))


def load_preset_config(name: str) -> dict[str, Any]:
    """The raw JSON dict of preset ``name`` (UsageError naming the known presets if unknown)."""
    path = _presets_dir() / f"{name}.json"
    if not path.is_file():
        raise UsageError(f"unknown model preset {name!r} (known: {', '.join(list_presets())})")
    return json.loads(path.read_text())


def load_shape(source: str | Path, architectures: Collection[str] | None = None) -> ModelShape:
    """The shape of a preset name, a ``config.json`` path, its folder, or a ``.gguf`` file.

    ``architectures``: when given, a source naming another architecture (or, for a config.json,
    none) is refused before any other key is read, so the error says what is really wrong.
    UsageError with one line for an unknown preset or an unreadable/invalid file.
    """
    text = str(source)
    path = Path(text)
    if text in list_presets():
        return shape_from_hf_config(load_preset_config(text), text, "preset")
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return shape_from_gguf(path, architectures)
    if not path.is_file():
        if path.suffix or "/" in text:
            raise UsageError(f"cannot read model config {text!r}: no such file")
        raise UsageError(f"unknown model preset {text!r} (known: {', '.join(list_presets())})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read model config {text!r}: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"model config {text!r} is not a JSON object")
    if architectures is not None:
        _check_architecture(config.get("model_type"), "hf", architectures)
    name = str(config.get("name") or path.parent.name)
    return shape_from_hf_config(config, name, origin=str(path))


def _check_architecture(name: Any, source: str, supported: Collection[str]) -> None:
    if source == "hf" and not isinstance(name, str):
        raise UsageError("config.json has no 'model_type'")
    if name not in supported:
        raise UsageError(
            f"unsupported model architecture {name!r} (from {source} metadata); "
            f"supported: {', '.join(sorted(supported))}"
        )
