#!/usr/bin/env bash
# What a lent GPU machine lacks for benchmarks/gpu_check.py, gathered into wheels/ (gitignored),
# which the device call carries (run's carry ["wheels"]; the machine has no network, and the
# working tree plus what is carried must stay under 64 MiB):
#
# * wheels of the Python packages its image does not hold, pinned to this .venv's versions,
#   for the device image's CPython 3.12 on manylinux x86_64, and wheels/requirements.txt naming them: gguf
#   (transformers' GGUF loading), and what `pagedkv serve` / `route` need beyond the image
#   (the service section): fastapi (0.165 imports opentelemetry), starlette, uvicorn, pydantic,
#   redis (the KV store, KV events), llguidance (structured output) and their needs the image
#   lacks or holds too old. The image has torch, triton, transformers, accelerate, tokenizers,
#   safetensors, jinja2, rich, prometheus-client, httpx, anyio, h11 and click (KINDS.md of the
#   device tool). --fallback adds those pagedkv needs too, for an image that lost them.
# * redis-server (this machine's, from Debian's package: `make redis`) and the libraries it
#   links beyond those every CUDA image has (glibc, OpenSSL 3, libstdc++, compression), in
#   wheels/redis/, for the P/D pair, the KV store and KV events (~3 MiB);
# * SmolLM2-135M-Instruct-6layers.gguf: the embedded GGUF's first 6 of 30 layers (the whole
#   file, 94 MiB, does not travel), for the greedy section;
# * traces/azure_llm_2023_conv.csv: the first 2000 requests of the shared trace (section 4).
#
#   bash benchmarks/gpu_wheels.sh [--fallback]
#
# Prints what it wrote and the total size; fails above 56 MiB. The device command is in
# gpu_check.py's docstring.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LIMIT_MIB=56  # the working tree (~5 MiB) travels too: 64 MiB in all

packages=(gguf fastapi starlette uvicorn pydantic pydantic-core annotated-types
          typing-inspection opentelemetry-api typing-extensions redis llguidance)
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
# The device image's Python (KINDS.md: 3.12.3); compiled wheels are per version.
for python in 3.12; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version "$python" --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d wheels "${specs[@]}"
done

redis=$(command -v redis-server || true)
if [[ -n "$redis" ]]; then
    mkdir -p wheels/redis/lib
    cp "$(readlink -f "$redis")" wheels/redis/redis-server  # it runs as what argv[0] names
    ldd wheels/redis/redis-server | awk '/=> \//{print $3}' \
        | grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libssl|libcrypto|libstdc\+\+|libgcc_s|libzstd|liblzma|liblz4|libgcrypt|libgpg-error|libcap)\.so' \
        | xargs -r -I{} cp -L {} wheels/redis/lib/
else
    echo "no redis-server here (make redis): the service section's P/D pair will be skipped" >&2
fi

"$PY" benchmarks/gpu_check_gguf.py small-gguf wheels/SmolLM2-135M-Instruct-6layers.gguf \
    --layers 6

trace=$("$PY" -c "from pagedkv.traces import require_shared_trace as r; \
print(r('azure_llm_2023_conv.csv'))")
head -n 2001 "$trace" > wheels/traces/azure_llm_2023_conv.csv

ls -l wheels wheels/traces wheels/redis wheels/redis/lib 2>/dev/null || true
total_kib=$(du -sk wheels | cut -f1)
echo "wheels/: $((total_kib / 1024)) MiB in all (limit ${LIMIT_MIB} MiB)"
if (( total_kib > LIMIT_MIB * 1024 )); then
    echo "wheels/ is over ${LIMIT_MIB} MiB: the device call carries at most 64 MiB" >&2
    exit 1
fi
