#!/usr/bin/env bash
# The one device call of issue 30 (docs/benchmarks.md, "GPU check"): from the repository root on
# a machine with an NVIDIA GPU, torch with CUDA, triton and transformers:
#
#     bash bench/gpu_check.sh          # writes $OUT/gpu_check.json and $OUT/gpu_check.log
#
# The wheels the image lacks (grpcio >= 1.85.1, grpcio-health-checking, gguf, prometheus-client,
# psutil, pytest) come from .device-wheels/ (bench/gpu_wheels.sh fills it where PyPI is reachable);
# they are installed into a private folder put first on PYTHONPATH, so the image's own packages
# stay as they are. splitserve itself is not installed: its package-dir mapping is rebuilt as
# symlinks. Runs at most ~7.5 minutes (the Python part is cut at 440 s).
set -u
OUT="${OUT:-bench-out/gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python
{
  echo "== $(date -u)  $($PY --version 2>&1)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  if [ "$gpus" -ge 2 ]; then echo "$gpus GPUs visible: the tensor_parallel phase runs TP 2 against TP 1"
  else echo "$gpus GPU(s) visible: the tensor_parallel phase (TP 2) needs 2 and is skipped"; fi
  SITE="$(mktemp -d)/site"
  missing=$("$PY" - <<'PYEOF'
import importlib.metadata as md
want = {"grpcio": (1, 85, 1), "grpcio-health-checking": (1, 85, 1), "gguf": (0, 17), "prometheus-client": (0,),
        "psutil": (5,), "pytest": (8,), "pluggy": (1, 6), "iniconfig": (2,), "pygments": (2, 15)}
for name, minimum in want.items():
    try:
        have = tuple(int(p) for p in md.version(name).split(".")[:3] if p.isdigit())
    except md.PackageNotFoundError:
        have = None
    if have is None or have < minimum:
        print(name)
PYEOF
)
  echo "installing from .device-wheels: ${missing:-nothing}"
  if [ -n "$missing" ]; then
    # shellcheck disable=SC2086
    "$PY" -m pip install --quiet --no-deps --no-index --find-links .device-wheels --target "$SITE" $missing \
      || echo "pip install failed: the phases that need these packages will say so"
  fi
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/splitserve"
  for d in platform workers router operator planner rayserve bench; do ln -s "$PWD/$d" "$SHIM/splitserve/$d"; done
  export PYTHONPATH="$SITE:$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  export OUT
  timeout 440 "$PY" bench/gpu_check.py
  echo "== gpu_check.py exit status $?  $(date -u)"
} 2>&1 | tee "$OUT/gpu_check.log"
