#!/usr/bin/env bash
# What a lent GPU machine lacks for benchmarks/gpu_check.py, gathered into wheels/ (gitignored),
# which the device call carries (run's carry ["wheels"]; the machine has no network, and the
# working tree plus what is carried must stay under 64 MiB):
#
# * wheels of the Python packages its image does not hold, pinned to this .venv's versions,
#   for CPython 3.10-3.12 on manylinux x86_64, and wheels/requirements.txt naming them. Today
#   that is gguf alone (transformers' GGUF loading): the image has torch, triton, transformers,
#   accelerate, tokenizers, safetensors, jinja2, rich and prometheus-client (KINDS.md of the
#   device tool). --fallback adds those pagedkv needs too, for an image that lost them.
# * SmolLM2-135M-Instruct-6layers.gguf: the embedded GGUF's first 6 of 30 layers (the whole
#   file, 94 MiB, does not travel), for the greedy section;
# * traces/azure_llm_2023_conv.csv: the first 2000 requests of the shared trace (section 4).
#
#   bash benchmarks/gpu_wheels.sh [--fallback]
#
# Prints what it wrote and the total size; fails above 50 MiB. The device command is in
# gpu_check.py's docstring.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LIMIT_MIB=50

packages=(gguf)
if [[ "${1:-}" == "--fallback" ]]; then
    packages+=(tokenizers safetensors jinja2 markupsafe rich markdown-it-py mdurl pygments
               prometheus-client)
fi

rm -rf wheels
mkdir -p wheels/traces
: > wheels/requirements.txt
specs=()
for name in "${packages[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    specs+=("$name==$version")
    echo "$name==$version" >> wheels/requirements.txt
done
# Pure wheels are one file for every version; the compiled ones (markupsafe) one per version.
for python in 3.10 3.11 3.12; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version "$python" --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d wheels "${specs[@]}"
done

"$PY" benchmarks/gpu_check_gguf.py small-gguf wheels/SmolLM2-135M-Instruct-6layers.gguf \
    --layers 6

trace=$("$PY" -c "from pagedkv.traces import require_shared_trace as r; \
print(r('azure_llm_2023_conv.csv'))")
head -n 2001 "$trace" > wheels/traces/azure_llm_2023_conv.csv

ls -l wheels wheels/traces
total_kib=$(du -sk wheels | cut -f1)
echo "wheels/: $((total_kib / 1024)) MiB in all (limit ${LIMIT_MIB} MiB)"
if (( total_kib > LIMIT_MIB * 1024 )); then
    echo "wheels/ is over ${LIMIT_MIB} MiB: the device call carries at most 64 MiB" >&2
    exit 1
fi
