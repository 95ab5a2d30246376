"""The C++ kernel build prints one progress line per extension with its time, and a failed build
one line saying what it costs (issue 31)."""
from __future__ import annotations

import re

import pytest

import pagedllm.kernels.cpu_ops as cpu_ops


def test_progress_line_success(tmp_path, monkeypatch, capfd):
    import torch.utils.cpp_extension as ext

    built = tmp_path / "built.so"
    built.write_bytes(b"\x7fELF fake")

    class _Mod:
        __file__ = str(built)

    monkeypatch.setattr(ext, "load", lambda **kw: _Mod())
    so = tmp_path / "kernels" / "x.so"
    mod = cpu_ops.compile_extension("x", str(so), ["a.cpp"], "the C++ CPU kernels")
    assert mod is not None and so.read_bytes() == b"\x7fELF fake"
    err = capfd.readouterr().err
    assert re.fullmatch(rf"pagedllm: compiling the C\+\+ CPU kernels \(first run only; cached in "
                        rf"{re.escape(str(tmp_path / 'kernels'))}\) \.\.\. done in \d+\.\d s\n", err), err


def test_failed_build_is_one_line(tmp_path, monkeypatch, capfd):
    import torch.utils.cpp_extension as ext

    def fail(**kw):
        raise RuntimeError("Error building extension 'pagedllm_cpu_ops_x'\n[1/7] c++ ... long compiler output")

    monkeypatch.setattr(ext, "load", fail)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu_ops._CPU_OPS, "ops", None)
    monkeypatch.setattr(cpu_ops._CPU_OPS, "tried", False)
    assert cpu_ops.get_ops() is None
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"pagedllm: compiling the C\+\+ CPU kernels \(first run only; cached in .*\) \.\.\. "
                        r"failed after \d+\.\d s", lines[0]), lines[0]
    assert lines[1] == ("pagedllm: WARNING: the C++ CPU kernels could not be built (RuntimeError: Error building "
                        "extension 'pagedllm_cpu_ops_x'); the engine will run ~11x slower on the pure-torch path "
                        "(install g++ and restart; PAGEDLLM_CPU_KERNELS=0 silences this)")


@pytest.fixture(autouse=True)
def _restore_ops():
    """get_ops() state is process-wide: put the real module back for later tests."""
    ext = cpu_ops._CPU_OPS
    ops, tried, error = ext.ops, ext.tried, ext.error
    yield
    ext.ops, ext.tried, ext.error = ops, tried, error
