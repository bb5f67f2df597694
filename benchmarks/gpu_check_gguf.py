"""A smaller copy of the embedded GGUF that fits the device machine's 64 MiB transfer: its
first layers, with the real vocabulary and weights.

Run as a script it writes that copy (``benchmarks/gpu_wheels.sh`` does):

    python benchmarks/gpu_check_gguf.py small-gguf OUT.gguf [--layers 6]
"""

from __future__ import annotations

from pathlib import Path

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
