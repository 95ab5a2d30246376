"""scripts/install.sh: the Python version is checked before any venv is made (issue 31)."""
from __future__ import annotations

import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _copy_scripts(tmp_path):
    (tmp_path / "scripts").mkdir()
    for name in ("install.sh", "constraints.txt"):
        shutil.copy(os.path.join(ROOT, "scripts", name), tmp_path / "scripts" / name)
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")


def _fake_python(tmp_path, version: str):
    """A 'python' that reports ``version`` and fails the >= 3.11 check as a real one would."""
    major, minor = (int(x) for x in version.split(".")[:2])
    exe = tmp_path / f"python{version}"
    exe.write_text("#!/bin/sh\n"
                   f"case \"$2\" in *platform*) echo {version}; exit 0;; "
                   f"*version_info*) [ {major} -gt 3 ] || [ {minor} -ge 11 ] && exit 0 || exit 1;; esac\n"
                   "exit 1\n")
    exe.chmod(0o755)
    return str(exe)


def test_old_python_refused_before_venv(tmp_path):
    _copy_scripts(tmp_path)
    py = _fake_python(tmp_path, "3.10.12")
    p = subprocess.run(["bash", "scripts/install.sh"], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=py), timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == (f"install.sh: error: '{py}' is Python 3.10.12: pagedllm needs Python >= 3.11 "
                                "(set PYTHON=/path/to/python3.11)")
    assert not (tmp_path / ".venv").exists()


def test_missing_python(tmp_path):
    _copy_scripts(tmp_path)
    p = subprocess.run(["bash", "scripts/install.sh"], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, PYTHON="no-such-python3.11"), timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == ("install.sh: error: 'no-such-python3.11' not found: pagedllm needs Python >= 3.11 "
                                "(set PYTHON=/path/to/python3.11)")


def test_venv_of_wrong_python_is_rebuilt(tmp_path):
    """A .venv whose python is too old (here: a stand-in) is removed and made again by $PYTHON;
    the run is stopped right after (PYTHON's venv module is a stub) so no pip runs."""
    _copy_scripts(tmp_path)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    old = _fake_python(tmp_path, "3.9.2")
    os.symlink(old, tmp_path / ".venv" / "bin" / "python")
    good = tmp_path / "python3.12"
    good.write_text("#!/bin/sh\n"
                    "case \"$2\" in *platform*) echo 3.12.1; exit 0;; *version_info*) exit 0;; esac\n"
                    "if [ \"$1\" = -m ] && [ \"$2\" = venv ]; then mkdir -p \"$3\"; echo made > \"$3/made-by-stub\"; "
                    "exit 3; fi\nexit 1\n")
    good.chmod(0o755)
    p = subprocess.run(["bash", "scripts/install.sh"], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=str(good)), timeout=60)
    assert p.returncode == 3, p.stderr
    assert p.stderr.splitlines() == [
        f"install.sh: .venv was made by Python 3.9.2 (needs >= 3.11): rebuilding it with {good}",
        f"install.sh: creating .venv with {good} (3.12.1)"]
    assert (tmp_path / ".venv" / "made-by-stub").read_text() == "made\n"
    assert not (tmp_path / ".venv" / "bin").exists()
