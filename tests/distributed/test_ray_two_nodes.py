"""Ray across two nodes on this machine: a head (``ray start --head``) and a second node (``ray
start --address``), separate processes with one CPU each (so a 2-rank placement group puts one
rank on each node) and a custom resource each; ``pagedllm serve --distributed-executor-backend
ray`` with TP=2 and with PP=2 on that cluster gives one process's tokens. The cluster is stopped
in teardown."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import httpx
import pytest
from server_helpers import free_port, serve

pytest.importorskip("ray", reason="ray is not installed (pip install ray)")
pytestmark = pytest.mark.slow

PROMPTS = [[1, 17, 3, 88, 42, 9, 61, 23], [5, 6, 7, 8, 200, 13]]
N = 6


@pytest.fixture(scope="module")
def cluster():
    """A two-node Ray cluster: (address, env for its clients)."""
    ray_bin = shutil.which("ray") or os.path.join(os.path.dirname(os.sys.executable), "ray")
    tmp = tempfile.mkdtemp(prefix="ray2n-")
    port = free_port()
    # RAY_AUTH_MODE=disabled: a token left in ~/.ray/auth_token would otherwise be required of
    # every node and client.
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1",
               RAY_AUTH_MODE="disabled")
    common = ["--num-cpus", "1", "--num-gpus", "0", "--disable-usage-stats", "--object-store-memory",
              str(80 * 1024**2)]
    p = subprocess.run([ray_bin, "start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
                        "--include-dashboard=false", "--temp-dir", tmp, "--resources", '{"node_head": 1}', *common],
                       env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    address = f"127.0.0.1:{port}"
    try:
        # A second node on the same machine: its own ports (the defaults would collide with the head's).
        ports = []
        for name in ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                     "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"):
            ports += [name, str(free_port())]
        p = subprocess.run([ray_bin, "start", "--address", address, "--node-ip-address", "127.0.0.1",
                            "--resources", '{"node_second": 1}', *common, *ports],
                           env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        # The second node registers with the head asynchronously: wait (bounded) until both CPUs show.
        deadline = time.time() + 90
        while True:
            status = subprocess.run([ray_bin, "status", "--address", address], env=env, capture_output=True,
                                    text=True, timeout=120).stdout
            if "/2.0 CPU" in status or time.time() > deadline:
                break
            time.sleep(1)
        assert "/2.0 CPU" in status, status
        yield address, dict(env, RAY_ADDRESS=address)
    finally:
        # NOTE: not `ray stop`: it kills every Ray process on the machine, including a local
        # cluster another test worker may be using; only the processes of this cluster (their
        # command lines name its --temp-dir or its GCS address) are stopped.
        _kill_cluster(tmp, address)
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_cluster(temp_dir: str, address: str) -> None:
    """SIGKILL the processes whose command line names ``temp_dir`` or ``address`` (raylets, GCS,
    workers and agents of the cluster this module started)."""
    import signal

    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmd or address in cmd:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def _tokens(base):
    out = []
    for p in PROMPTS:
        r = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "logprobs": 1})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        out.append(c["logprobs"]["tokens"])
    return out


def _common(model_dir):
    return [model_dir, "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", "4MiB",
            "--disable-log-stats"]


@pytest.fixture(scope="module")
def one_process_tokens(tiny_llama_dir):
    """The tokens of the same server flags in one process (no Ray): the reference of both tests."""
    with serve(_common(tiny_llama_dir)) as (base, _):
        return _tokens(base)


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_two_node_ray_equals_one_process(cluster, tiny_llama_dir, one_process_tokens, flag, monkeypatch):
    address, env = cluster
    common = _common(tiny_llama_dir)
    ref = one_process_tokens
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with serve(common + [flag, "2", "--distributed-executor-backend", "ray"], timeout=300) as (base, _):
        # Both nodes' CPUs are taken: one rank on each (each node has one CPU).
        ray_bin = shutil.which("ray") or os.path.join(os.path.dirname(os.sys.executable), "ray")
        status = subprocess.run([ray_bin, "status", "--address", address], env=env, capture_output=True,
                                text=True, timeout=120).stdout
        assert "2.0/2.0 CPU" in status, status
        assert _tokens(base) == ref
