"""``pagedllm run [MODEL] [serve flags]``: start a local server and chat with it (Ollama's ``ollama run``).

The server is ``pagedllm serve`` in a child process on a free port of 127.0.0.1 (its log goes to a
file, not the terminal); once ``/health`` answers, the chat client of ``pagedllm chat`` talks to it
(interactive with history and streaming, or one turn with ``-q``), and the server stops when the
chat ends. A mistake in the serve flags is the server's one-line error and its exit status.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Optional

from pagedllm.entrypoints.cli_utils import fail

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def add_run_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm run``'s own flags; every other flag is passed to ``pagedllm serve``."""
    # NOTE: MODEL is taken by split_model() before parsing (a positional here would swallow the
    # value of a serve flag, e.g. the 2048 of `--max-model-len 2048`); shown in the usage only.
    p.usage = "pagedllm run [MODEL] [-q MESSAGE] [--system-prompt TEXT] [...] [pagedllm serve flags]"
    p.add_argument("--system-prompt", default=None,
                   help="A system message put first in the conversation (default: none).")
    p.add_argument("-q", "--quick", dest="quick", default=None, metavar="MESSAGE",
                   help="Send this one message, print the answer and exit (default: interactive).")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens per answer (default: up to the context length).")
    p.add_argument("--temperature", type=float, default=None,
                   help="Sampling temperature (default: the model's generation config).")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="Seconds to wait for the server to load the model (default: 600).")


def split_model(words: list[str]) -> tuple[Optional[str], list[str]]:
    """``pagedllm run``'s words after ``run`` -> (MODEL if the first word is one, the rest)."""
    if words and not words[0].startswith("-"):
        return words[0], words[1:]
    return None, list(words)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def run_local(args: argparse.Namespace, serve_args: list[str]) -> int:
    """Start ``pagedllm serve MODEL *serve_args`` on a free port, chat with it, stop it.

    Args:
        args: ``pagedllm run``'s own flags (``add_run_args``).
        serve_args: the remaining command-line words, passed to ``pagedllm serve`` unchanged.

    Returns:
        The chat's exit status (0; 1 if the server failed while chatting; 130 on Ctrl-C), or the
        server's own status when it exits before it is ready (2 for a flag mistake, with its
        one-line error printed).
    """
    from pagedllm.entrypoints.chat_client import run_client

    model = getattr(args, "run_model", None) or DEFAULT_MODEL
    if any(a == "--port" or a.startswith("--port=") for a in serve_args):
        return fail("pagedllm run", "--port: the server of `pagedllm run` uses a free local port; to serve on a "
                    "port of your choice use `pagedllm serve` and `pagedllm chat --url`")
    port = _free_port()
    log_fd, log_path = tempfile.mkstemp(prefix="pagedllm-run-", suffix=".log")
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, *serve_args,
           "--host", "127.0.0.1", "--port", str(port)]
    print(f"pagedllm run: starting {model} (server log: {log_path}) ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    os.close(log_fd)
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            rc = proc.poll()
            if rc is not None:
                line = _last_line(log_path)
                print(line if line.startswith("pagedllm") else f"pagedllm run: error: the server exited "
                      f"(status {rc}): {line}", file=sys.stderr, flush=True)
                return rc or 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > args.startup_timeout:
                return fail("pagedllm run", f"the server did not answer /health within {args.startup_timeout:.0f} s "
                            f"(its log: {log_path})", status=1)
            time.sleep(0.25)
        print(f"pagedllm run: ready in {time.monotonic() - t0:.1f} s; type a message ('exit' or Ctrl-D ends)"
              if args.quick is None else f"pagedllm run: ready in {time.monotonic() - t0:.1f} s",
              file=sys.stderr, flush=True)
        client_args = argparse.Namespace(url=base + "/v1", model=None, api_key=None,
                                         system_prompt=args.system_prompt, quick=args.quick,
                                         max_tokens=args.max_tokens, temperature=args.temperature)
        return run_client(client_args, chat=True)
    finally:
        _stop(proc)
        if proc.returncode in (0, 2, -15, 143):  # kept for a crash: the message points at it
            try:
                os.unlink(log_path)
            except OSError:
                pass


def _stop(proc: subprocess.Popen, timeout: float = 15.0) -> Optional[int]:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
