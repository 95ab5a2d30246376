#!/usr/bin/env bash
# One prepared GPU check (<= ~8 min on an H200): kernel tests on the GPU, model parity (GPU vs CPU
# greedy tokens), 64- and 256-request throughput with a table (tok/s, TTFT, decode HBM GB/s vs copy).
#
#   bash benchmarks/gpu_check.sh [gpu_check.py args...]     # from the repo root
#   e.g. bash benchmarks/gpu_check.sh --models-dir /path/with/ggufs
#        bash benchmarks/gpu_check.sh --device cpu --quick  # CPU dry run (interpreter tests)
#
# Needs torch + triton + transformers (+ pytest for the kernel tests; skipped if absent). No server,
# no package registry. Results also go to $OUT (if set) or ./gpu_check_out.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export TOKENIZERS_PARALLELISM=false
OUTDIR="${OUT:-gpu_check_out}"
mkdir -p "$OUTDIR"
# The system python (CUDA torch); NOT a carried .venv, whose torch may be the CPU build.
PY="${PYTHON:-python3}"

DEVICE=cuda
for a in "$@"; do [ "$a" = "cpu" ] && DEVICE=cpu; done
rc=0

echo "== kernel tests ($DEVICE) =="
if "$PY" -c "import pytest" 2>/dev/null; then
  if [ "$DEVICE" = cpu ]; then export TRITON_INTERPRET=1; fi
  timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/attention/test_triton_paged.py tests/attention/test_torch_paged.py \
    2>&1 | tee "$OUTDIR/kernel_tests.txt" | tail -25
  t=${PIPESTATUS[0]}; [ "$t" -ne 0 ] && { echo "kernel tests: exit $t"; rc=1; }
  # (TRITON_INTERPRET stays set on cpu: the kernel smoke in gpu_check.py needs it too)
else
  echo "pytest not installed: only gpu_check.py's built-in kernel smoke check runs"
fi

echo "== parity + throughput =="
timeout 360 "$PY" benchmarks/gpu_check.py --json-out "$OUTDIR/gpu_check.json" "$@" 2>&1 | tee "$OUTDIR/gpu_check.txt"
t=${PIPESTATUS[0]}; [ "$t" -ne 0 ] && { echo "gpu_check.py: exit $t"; rc=1; }
exit $rc
