"""The C++ CPU kernels are compiled with ``-march=native`` on the machine that runs them, so a
source whose ISA blocks (``#if defined(__AVX512BF16__)`` ...) are mis-nested builds here and fails
on another CPU kind -- and a failed build drops the engine to the ~11x slower pure-torch path. The
attention kernels' file (the most ISA blocks) is checked with ``g++ -fsyntax-only`` for the other
CPU kinds CI runs on: AVX2 only (Zen 1-3), AVX-512 with VNNI but no bf16 (Cascade Lake Xeon), and
plain x86-64 (the portable path)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig

import pytest

CSRC = os.path.join(os.path.dirname(__file__), "..", "..", "pagedllm", "kernels", "csrc")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("march", ["x86-64-v3", "cascadelake", "x86-64"])
def test_attention_kernels_compile_for_other_cpu_kinds(march):
    from torch.utils.cpp_extension import include_paths

    cmd = ["g++", "-fsyntax-only", "-std=c++17", f"-march={march}", "-fopenmp", "-ffast-math",
           *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}",
           os.path.join(CSRC, "paged_decode.cpp")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert p.returncode == 0 and not errors, "\n".join(errors[:10]) or p.stderr[-2000:]
