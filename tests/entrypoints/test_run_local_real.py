"""``pagedllm run``: a local server started, chatted with and stopped in one command."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "run", *args], env=env,
                          input=stdin, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_run_one_question_and_a_conversation_from_stdin():
    p = _run("SmolLM2-135M-Instruct", "-q", "Complete: one, two, three,", "--max-tokens", "8",
             "--temperature", "0", "--max-model-len", "1024")
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.strip()) > 0
    assert "ready in" in p.stderr and "pagedllm run: starting SmolLM2-135M-Instruct" in p.stderr
    # Interactive: two messages on stdin; the second answer sees the first turn (history kept).
    p = _run("--max-tokens", "6", "--temperature", "0", "--max-model-len", "1024",
             stdin="Say hello.\nSay it again.\n")
    assert p.returncode == 0, p.stderr
    assert len([ln for ln in p.stdout.splitlines() if ln.strip()]) >= 2


def test_serve_flag_mistakes_are_the_servers_one_line_error():
    p = _run("/no/such/model.gguf", "-q", "hi", timeout=120)
    assert p.returncode == 2
    errs = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert len(errs) == 1 and errs[0].startswith("pagedllm serve: error: cannot resolve model '/no/such/model.gguf'")
    assert "Traceback" not in p.stderr
    p = _run("--port", "9", "-q", "hi", timeout=60)
    assert p.returncode == 2 and p.stderr.strip().startswith("pagedllm run: error: --port")
