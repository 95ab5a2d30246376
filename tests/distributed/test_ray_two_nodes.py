"""Ray across two nodes on this machine: a head (``ray start --head``) and a second node (``ray
start --address``), separate processes with one CPU each (so a 2-rank placement group puts one
rank on each node) and a custom resource each; ``pagedllm serve --distributed-executor-backend
ray`` with TP=2 and with PP=2 on that cluster gives one process's tokens; with
``--data-parallel-size 2 --data-parallel-backend ray`` the two replicas' workers land one on each node, answer one process's
tokens, and when the second node dies (its raylet and everything under it killed) the stream in
flight on its replica ends with an error event, the other stream completes, ``/health`` names the
dead replica and later requests all go to the survivor. The cluster is stopped in teardown (the
data-parallel test, which kills a node, runs last)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time

import httpx
import psutil
import pytest
from server_helpers import free_port, serve, wait_for_status

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
    # RAY_health_check_*: the GCS declares a node dead after ~1.5 s without an answer (defaults: 15 s or more),
    # so the node-death test does not wait on Ray's detection.
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1",
               RAY_AUTH_MODE="disabled", RAY_health_check_period_ms="500", RAY_health_check_timeout_ms="500",
               RAY_health_check_failure_threshold="3", RAY_health_check_initial_delay_ms="0")
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
        second_node_port = int(ports[ports.index("--node-manager-port") + 1])
        yield address, dict(env, RAY_ADDRESS=address), second_node_port
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
    address, env, _ = cluster
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


def _kill_node(node_manager_port: int) -> int:
    """SIGKILL a Ray node as a machine failure would: its raylet (found by ``--node_manager_port``)
    and every process under it (the workers and what they started). Returns how many died."""
    raylets = [p for p in psutil.process_iter(["cmdline"])
               if any(a == f"--node_manager_port={node_manager_port}" for a in (p.info["cmdline"] or []))]
    assert len(raylets) == 1, [p.info["cmdline"] for p in raylets]
    procs = [raylets[0], *raylets[0].children(recursive=True)]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


async def _stream(base: str, prompt: list[int], started: asyncio.Event) -> tuple[str, list[dict]]:
    """One streamed greedy completion: (the replica URL that served it, its parsed data events)."""
    events: list[dict] = []
    async with httpx.AsyncClient(timeout=180) as c:
        async with c.stream("POST", base + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 480, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            replica = r.headers["x-pagedllm-replica"]
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        started.set()
    return replica, events


def test_two_node_ray_data_parallel_and_node_death(cluster, tiny_llama_dir, one_process_tokens, monkeypatch):
    """Runs last in this file: it kills the second node."""
    address, env, second_node_port = cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    flags = _common(tiny_llama_dir) + ["--data-parallel-size", "2", "--data-parallel-router", "least-load",
                                       "--data-parallel-backend", "ray", "--max-model-len", "512"]
    with serve(flags, timeout=300, stop_timeout=40) as (base, _):
        ray_bin = shutil.which("ray") or os.path.join(os.path.dirname(os.sys.executable), "ray")
        status = subprocess.run([ray_bin, "status", "--address", address], env=env, capture_output=True,
                                text=True, timeout=120).stdout
        assert "2.0/2.0 CPU" in status, status  # one replica's worker on each one-CPU node
        replicas = [r["url"] for r in httpx.get(base + "/router/replicas").json()["replicas"]]
        assert len(replicas) == 2
        # Greedy tokens through the front (least-load: in turn, so both replicas answer) equal one process's.
        assert _tokens(base) + _tokens(base) == one_process_tokens + one_process_tokens

        async def run() -> list:
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(_stream(base, p, e)) for p, e in zip(PROMPTS, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            assert _kill_node(second_node_port) >= 2  # the raylet and the replica's worker at least
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        streams = asyncio.run(run())
        assert {rep for rep, _ in streams} == set(replicas), streams
        done = [ev for _, ev in streams if ev and "error" not in ev[-1]]
        failed = [(rep, ev) for rep, ev in streams if ev and "error" in ev[-1]]
        # The survivor's stream is whole; the dead node's replica ends its stream with an error event.
        assert len(done) == 1 and len(failed) == 1, [ev[-1] for _, ev in streams]
        assert done[0][-1]["choices"][0]["finish_reason"] == "length"
        assert "(Ray actor) died" in failed[0][1][-1]["error"]["message"], failed[0][1][-1]
        dead_url = failed[0][0]
        survivor = next(u for u in replicas if u != dead_url)
        # /health names the dead replica (its engine lost its worker), within the router's health checks.
        h = wait_for_status(base + "/health", 503, timeout=60)
        assert h.status_code == 503 and dead_url in h.text, h.text
        # Later requests all go to the survivor, with one process's tokens.
        for _ in range(2):
            for p, ref in zip(PROMPTS, one_process_tokens):
                r = httpx.post(base + "/v1/completions", timeout=120, json={
                    "model": "tiny", "prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True,
                    "logprobs": 1})
                assert r.status_code == 200, r.text
                assert r.headers["x-pagedllm-replica"] == survivor
                assert r.json()["choices"][0]["logprobs"]["tokens"] == ref
