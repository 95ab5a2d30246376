"""Lint (ruff) and type check (mypy) as part of the suite, configured in pyproject.toml.

ruff: pyflakes + pycodestyle + bugbear over ``pagedllm/``; mypy: ``core/``, ``config.py`` and
``engine/`` (``[tool.mypy] files``). Both are in the ``dev`` extra, so CI runs them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name: str) -> str:
    exe = shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)
    assert os.path.exists(exe), f"{name} is not installed (it is in the dev extra: pip install -e '.[dev]')"
    return exe


def test_ruff_lint_passes():
    p = subprocess.run([_tool("ruff"), "check", "--no-cache", "pagedllm"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy_passes_on_core_engine_config():
    p = subprocess.run([_tool("mypy"), "--cache-dir", os.path.join(ROOT, ".mypy_cache")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "Success" in p.stdout, p.stdout + p.stderr
