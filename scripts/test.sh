#!/usr/bin/env bash
# Install everything (first run) and run the whole test suite, real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is cached (pip installs with --no-compile, so Python writes it on first import): an
# environment with PYTHONDONTWRITEBYTECODE=1 would otherwise compile torch's and transformers' sources
# again in every process the suite starts (+2.4 s per `import torch`, a `pagedllm serve` ready in 9.3 s
# instead of 4.9 s on a 2-core Zen 1).
unset PYTHONDONTWRITEBYTECODE
bash scripts/install.sh --test
. .venv/bin/activate
# Tests use one torch thread: two threads collapse when another process is busy
# (docs/hardware-and-models.md, "OpenMP thread oversubscription").
export PAGEDLLM_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# Two workers (one per core; each test file stays on one worker, so its module fixtures load once).
# PYTEST_WORKERS=0 runs serially.
exec python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
