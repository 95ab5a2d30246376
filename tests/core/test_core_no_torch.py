import subprocess
import sys


def test_core_imports_no_torch():
    code = ("import sys; import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, "
            "pagedllm.core.block_pool, pagedllm.core.kv_cache_utils, pagedllm.core.request, "
            "pagedllm.core.sched_output; sys.path.insert(0, 'tests/core'); import core_helpers; "
            "assert 'torch' not in sys.modules, 'core imported torch'")
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
