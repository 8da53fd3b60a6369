#!/usr/bin/env bash
# Downloads, HERE (not on the device), the wheels tokenwire needs on the GPU machine beyond its
# image (which has grpcio 1.84 and no grpcio-health-checking etc.) into .whl-tw/ (git-ignored
# through .git/info/exclude), ~12 MB. Every benchmarks/run_*_device.sh installs them through
# device_env.sh when the call carries them: run(..., carry=[".whl-tw"]).
set -eu
cd "$(dirname "$0")/.."
dest=${1:-.whl-tw}
if [[ "$dest" != /* ]]; then  # a folder of the checkout: keep it out of git (it still travels)
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx "/$dest/" "$exclude" 2>/dev/null || echo "/$dest/" >> "$exclude"
fi
py=${PYTHON:-python3}
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_35_x86_64 \
  -d "$dest" \
  grpcio==1.85.3 grpcio-status==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  protobuf==7.36.2 googleapis-common-protos==1.76.0 llguidance==1.9.1 gguf==0.19.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-instrumentation==0.66b2 \
  opentelemetry-instrumentation-grpc==0.66b2 \
  pillow==13.0.0
ls "$dest"; du -sh "$dest"
