#!/usr/bin/env bash
# Install everything (first run) and run the whole test suite, real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
. .venv/bin/activate
# Tests use one torch thread: two threads collapse when another process is busy
# (docs/hardware-and-models.md, "OpenMP thread oversubscription").
export PAGEDLLM_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# Two workers (one per core; each test file stays on one worker, so its module fixtures load once).
# PYTEST_WORKERS=0 runs serially.
exec python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
