#!/usr/bin/env bash
# Install (first run) and serve the embedded default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
exec pagedllm serve "$@"
