#!/usr/bin/env bash
# Fill .device-wheels/ with what bench/gpu_check.sh installs on the GPU image (which has torch,
# triton, transformers, protobuf and grpcio 1.84 but no gguf). Run where PyPI is reachable; about
# 22 MB (grpcio for CPython 3.11, 3.12 and 3.13, as the image's Python is not pinned here).
set -eu
cd "$(dirname "$0")/.."
PIP="${PIP:-.venv/bin/pip}"
mkdir -p .device-wheels
for v in 3.11 3.12 3.13; do
  "$PIP" download --quiet --no-deps --only-binary=:all: --python-version "$v" --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .device-wheels "grpcio>=1.85.1"
done
"$PIP" download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .device-wheels psutil
"$PIP" download --quiet --no-deps --only-binary=:all: -d .device-wheels "grpcio-health-checking>=1.85.1" "gguf>=0.17" \
  prometheus-client pytest pluggy iniconfig pygments
ls -l .device-wheels
