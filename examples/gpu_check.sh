#!/usr/bin/env bash
# One prepared check for a CUDA machine, finishing in under 7 minutes:
#   1. the CUDA tests (tests/test_gpu.py) plus the window and memory tests, and the CUDA
#      test of tests/test_compile.py (mode="reduce-overhead", no host synchronisation);
#   2. a short benchmark on the GPU (aadl_func vs the AADL-style step vs the two-pass bound),
#      written to bench_results/benchmark_cuda.json.
# Usage: examples/gpu_check.sh            (from anywhere; PYTHON=... picks the interpreter)
# Needs a Python with a CUDA build of torch and optree, pytest, numpy (no network needed:
# aadl_func is imported from this checkout).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  for candidate in .venv/bin/python python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 \
      && "$candidate" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        >/dev/null 2>&1; then
      PYTHON=$candidate
      break
    fi
  done
fi
if [[ -z "${PYTHON:-}" ]]; then
  echo "gpu_check: no Python with a CUDA build of torch found (set PYTHON=...)" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p bench_results
"$PYTHON" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF

status=0
echo "== tests (CUDA, window, memory)"
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider \
  tests/test_gpu.py tests/test_window.py tests/test_memory.py || status=1

echo "== compiled step on CUDA (CUDA graphs, no host sync)"
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_compile.py -k cuda || status=1

echo "== benchmark (CUDA)"
timeout 120 "$PYTHON" examples/benchmark.py --device cuda --sizes 20,22,24 --depths 3,10,20 \
  --repeats 20 --style-repeats 5 --budget 2 --no-compile --ensemble none \
  --out bench_results/benchmark_cuda.json || status=1

echo "== benchmark (CPU, the machine's own cores, one size)"
timeout 60 "$PYTHON" examples/benchmark.py --device cpu --sizes 22 --depths 10 \
  --repeats 10 --style-repeats 3 --budget 2 --out bench_results/benchmark_cpu.json || status=1

exit $status
