"""pagedllm/envs.py declares every environment variable the package reads, and the docs list them."""
from __future__ import annotations

import os
import re

import pytest

from pagedllm import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_pagedllm_variable_in_the_package_is_declared():
    used: dict[str, str] = {}
    for d, _, files in os.walk(os.path.join(ROOT, "pagedllm")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                text = open(path, encoding="utf-8").read()
                # Preprocessor macros passed to the C++ compiler ("-DPAGEDLLM_...") are not variables.
                for name in re.findall(r"(?<![-\w])(?<!-D)PAGEDLLM_[A-Z0-9_]*[A-Z0-9]", text):
                    used.setdefault(name, os.path.relpath(path, ROOT))
    assert len(used) >= 20
    missing = {n: p for n, p in used.items() if n not in envs.ENV_VARS}
    assert not missing, f"declare these in pagedllm/envs.py: {missing}"


def test_docs_table_equals_the_declarations():
    doc = open(os.path.join(ROOT, "docs", "environment.md"), encoding="utf-8").read()
    assert envs.markdown_table() in doc, "regenerate docs/environment.md with python -m pagedllm.envs"


def test_values_parse_to_their_types_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_IDLE_RELEASE_S", raising=False)
    assert envs.get("PAGEDLLM_IDLE_RELEASE_S") == 10.0
    monkeypatch.setenv("PAGEDLLM_IDLE_RELEASE_S", "2.5")
    assert envs.PAGEDLLM_IDLE_RELEASE_S == 2.5                # attribute access reads it now
    monkeypatch.setenv("PAGEDLLM_KV_LAZY", "off")
    assert envs.get("PAGEDLLM_KV_LAZY") is False
    monkeypatch.setenv("PAGEDLLM_CPU_ALLOCATOR_CACHE", "512MiB")
    assert envs.get("PAGEDLLM_CPU_ALLOCATOR_CACHE") == 512 * 1024**2
    monkeypatch.setenv("PAGEDLLM_THREAD_POLICY", " Fixed ")
    assert envs.get("PAGEDLLM_THREAD_POLICY") == "fixed"
    monkeypatch.setenv("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S: 'soon'"):
        envs.get("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S")
    monkeypatch.setenv("PAGEDLLM_THREAD_POLICY", "spin")
    with pytest.raises(ValueError, match="PAGEDLLM_THREAD_POLICY.*adaptive"):
        envs.get("PAGEDLLM_THREAD_POLICY")
    monkeypatch.setenv("PAGEDLLM_DEBUG", "")
    assert envs.get("PAGEDLLM_DEBUG") is False                # empty = unset
    with pytest.raises(AttributeError):
        envs.PAGEDLLM_NO_SUCH_VARIABLE


def test_aliases_are_read_when_the_own_name_is_unset(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert envs.get("PAGEDLLM_BATCH_INVARIANT") is True and envs.is_set("PAGEDLLM_BATCH_INVARIANT")
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "0")
    assert envs.get("PAGEDLLM_BATCH_INVARIANT") is False      # the own name wins


def test_the_package_reads_its_variables_through_envs():
    """No module but ``envs.py`` reads a ``PAGEDLLM_*`` variable from ``os.environ`` / ``os.getenv``
    itself (so every read gets the declared type, default and error); the worker processes'
    connection variables, which pagedllm sets for its own children, are the exception."""
    own_children = {"PAGEDLLM_WORKER_ADDRESS", "PAGEDLLM_WORKER_AUTHKEY"}
    direct = re.compile(r"""(?:os\.environ\.get|os\.getenv|os\.environ\[)\(?\s*["'](PAGEDLLM_[A-Z0-9_]+)""")
    found = []
    for d, _, files in os.walk(os.path.join(ROOT, "pagedllm")):
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".py") and path != os.path.join(ROOT, "pagedllm", "envs.py"):
                for name in direct.findall(open(path, encoding="utf-8").read()):
                    if name not in own_children:
                        found.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert not found, found
