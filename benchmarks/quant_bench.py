"""Quantized checkpoints: decode speed, memory and perplexity per format, in one run (issue 21).

    .venv/bin/python benchmarks/quant_bench.py speed --model gemma3 --threads 1 --json-output q.json
    .venv/bin/python benchmarks/quant_bench.py ppl --json-output ppl.json

``speed``: for one GGUF file, each mode in its own process (so peak RSS is that mode's), modes
interleaved over ``--repeats``: pagedllm with native blocks (the default) in float32 and bfloat16
activations, the file dequantized at load (``--quantization none``) to float32 and bfloat16, and
llama-cpp-python on the same file when ``benchmarks/.peers/llama-cpp-python`` is installed
(``compare.py --install-peers llama-cpp-python``), and llama.cpp through node-llama-cpp's prebuilt
CPU binaries (``benchmarks/peers/node_llama_cpp_decode.mjs``, run with ``node``) when it is
installed under ``--node-llama-cpp-dir`` (default ``$NODE_LLAMA_CPP_DIR``, else
``benchmarks/.peers/node-llama-cpp``)::

    npm install --prefix benchmarks/.peers/node-llama-cpp node-llama-cpp@3.22.1

``--modes`` picks a subset (comma-separated labels: native-fp32, native-bf16, dequantized-fp32,
dequantized-bf16, llama-cpp-python, llama.cpp). Per mode: single-stream decode tok/s (one request,
64-token prompt, greedy, 1 / median over runs of the mean time per output token), 16-way batch
decode tok/s (16 requests decoding together; the llama.cpp peers are run with one sequence, so
they have none), weight bytes, RSS after load and peak RSS. The JSON output holds every run, the
median per mode, ratios against dequantized-fp32 and against llama.cpp (same run), and the load
average before and after.

``ppl``: perplexity of a fixed 400-token text (``pagedllm.entrypoints.bench._SENTENCES``) for
SmolLM2 as the Q4_1 GGUF (native blocks, and dequantized to float32), and as GPTQ / AWQ /
compressed-tensors (W4A16, W8A8, FP8) checkpoints written from the float32 weights
(``tests/quantization/format_writers.py``), each vs the float32 weights.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_PY = os.path.join(ROOT, "benchmarks", ".peers", "llama-cpp-python", "bin", "python")
NODE_PEER = os.path.join(ROOT, "benchmarks", "peers", "node_llama_cpp_decode.mjs")
MODES = {"native-fp32": ("float32", None), "native-bf16": ("bfloat16", None),
         "dequantized-fp32": ("float32", "none"), "dequantized-bf16": ("bfloat16", "none")}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model_path(name: str) -> str:
    sys.path.insert(0, ROOT)
    from pagedllm.loader import get_gemma3_gguf_path, get_smollm2_gguf_path

    return {"gemma3": get_gemma3_gguf_path, "smollm2": get_smollm2_gguf_path}[name]() if name in (
        "gemma3", "smollm2") else name


def _prompt_ids(tok, n: int, seed: int = 0) -> list[int]:
    from pagedllm.entrypoints.bench import _SENTENCES

    ids = tok.encode(" ".join(_SENTENCES[seed:] + _SENTENCES[:seed]), add_special_tokens=False)
    return ids[:n]


def worker_pagedllm(a) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    t0 = time.perf_counter()
    llm = LLM(a.path, dtype=a.dtype, quantization=a.quantization, num_threads=a.threads,
              kv_cache_memory=256 * 1024**2, max_num_batched_tokens=1024, seed=0)
    load_s = time.perf_counter() - t0
    core = llm.llm_engine.core
    rss_load = _rss()
    eng = llm.llm_engine
    tok = llm.get_tokenizer()

    def run(n_req: int, out_len: int) -> list[list[float]]:
        llm.reset_prefix_cache()
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        times: dict[str, list[float]] = {}
        for i in range(n_req):
            rid = f"r{time.perf_counter_ns()}-{i}"
            eng.add_request(rid, {"prompt_token_ids": _prompt_ids(tok, 64, i)}, sp)
            times[rid] = []
        left = n_req
        while left:
            for o in eng.step():
                times[o.request_id].append(time.perf_counter())
                left -= o.finished
        return list(times.values())

    run(1, 8)  # warm-up
    single = []
    for _ in range(2):
        (t,) = run(1, 64)
        single.append((t[-1] - t[0]) / (len(t) - 1))
    batch = []
    for _ in range(2):
        ts = run(16, 64)
        start = max(t[0] for t in ts)  # every request decoding from here on
        end = max(t[-1] for t in ts)
        n = sum(sum(1 for x in t if x > start) for t in ts)
        batch.append(n / (end - start))
    del torch
    return {"mode": a.label, "load_s": load_s, "weight_bytes": core.weight_bytes,
            "single_decode_tok_s": 1.0 / statistics.median(single), "batch16_decode_tok_s": statistics.median(batch),
            "rss_after_load": rss_load, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def worker_llama(a) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=a.path, n_ctx=512, n_batch=512, n_threads=a.threads, n_threads_batch=a.threads,
                seed=0, verbose=False)
    load_s = time.perf_counter() - t0
    rss_load = _rss()
    prompt = llm.tokenize((" ".join(["The history of the printing press begins in the fifteenth century."] * 8))
                          .encode(), add_bos=True)[:64]

    def run(n):
        llm.reset()
        times = []
        for _tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) >= n:
                break
        return times

    run(8)
    single = []
    for _ in range(2):
        t = run(64)
        single.append((t[-1] - t[0]) / (len(t) - 1))
    import llama_cpp

    return {"mode": a.label, "version": llama_cpp.__version__, "load_s": load_s,
            "single_decode_tok_s": 1.0 / statistics.median(single), "batch16_decode_tok_s": None,
            "rss_after_load": rss_load, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def _node_llama_dir(args) -> str | None:
    d = args.node_llama_cpp_dir or os.environ.get("NODE_LLAMA_CPP_DIR") or os.path.join(
        ROOT, "benchmarks", ".peers", "node-llama-cpp")
    ok = os.path.exists(os.path.join(d, "node_modules", "node-llama-cpp", "package.json"))
    return os.path.abspath(d) if ok else None


def _node_llama_run(args, path: str, label: str) -> dict | None:
    """One llama.cpp (node-llama-cpp) process on ``path``: the same 64-token prompt text, greedy."""
    sys.path.insert(0, ROOT)
    from pagedllm.entrypoints.bench import _SENTENCES

    spec = {"model": path, "prompt": " ".join(_SENTENCES), "threads": args.threads, "prompt_tokens": 64,
            "output_tokens": 64, "runs": 2, "node_llama_cpp_dir": _node_llama_dir(args)}
    out = subprocess.run([args.node, NODE_PEER, json.dumps(spec)], capture_output=True, text=True, timeout=1800)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
        return None
    r = json.loads(line[-1][7:])
    r["mode"] = label
    return r


def _summary(results: list[dict]) -> dict:
    keys = ("single_decode_tok_s", "batch16_decode_tok_s", "weight_bytes", "rss_after_load", "peak_rss")
    med: dict[str, dict] = {}
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = [r for r in results if r["mode"] == mode]
        med[mode] = {k: statistics.median([r[k] for r in rs]) if all(r.get(k) is not None for r in rs) else None
                     for k in keys}
        med[mode]["runs"] = len(rs)
    for mode, m in med.items():
        for ref, name in (("dequantized-fp32", "vs_dequantized_fp32"), ("llama.cpp", "vs_llama_cpp")):
            if ref in med and ref != mode:
                m[name] = {k: m[k] / med[ref][k] for k in ("single_decode_tok_s", "batch16_decode_tok_s", "peak_rss")
                           if m[k] is not None and med[ref][k]}
    return med


def speed(args) -> dict:
    path = _model_path(args.model)
    want = args.modes.split(",") if args.modes else None
    modes = [(label, dt, q) for label, (dt, q) in MODES.items() if want is None or label in want]
    have_llama = os.path.exists(PEER_PY) and not args.no_llama and (want is None or "llama-cpp-python" in want)
    have_node = (_node_llama_dir(args) is not None and not args.no_llama and (want is None or "llama.cpp" in want))
    if want and "llama.cpp" in want and not have_node:
        raise SystemExit("llama.cpp mode: node-llama-cpp not found (npm install --prefix "
                         "benchmarks/.peers/node-llama-cpp node-llama-cpp@3.22.1, or --node-llama-cpp-dir)")
    results: list[dict] = []
    load_before = _loadavg()
    t_start = time.time()
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(args.threads), PAGEDLLM_NUM_THREADS=str(args.threads))
    for rep in range(args.repeats):
        runs = [(label, sys.executable, ["--dtype", dt] + (["--quantization", q] if q else []))
                for label, dt, q in modes]
        if have_llama:
            runs.append(("llama-cpp-python", PEER_PY, ["--llama"]))
        if have_node:
            runs.append(("llama.cpp", None, None))
        for label, py, extra in runs:
            if py is None:
                r = _node_llama_run(args, path, label)
                if r is None:
                    continue
            else:
                cmd = [py, os.path.abspath(__file__), "worker", "--path", path, "--label", label,
                       "--threads", str(args.threads), *extra]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                if not line:
                    print(out.stderr[-3000:], file=sys.stderr)
                    continue
                r = json.loads(line[-1][7:])
            r["repeat"] = rep
            r["loadavg"] = _loadavg()
            results.append(r)
            print(json.dumps(r), flush=True)
    summary = _summary(results)
    print(json.dumps(summary, indent=1), flush=True)
    return {"model": args.model, "path": path, "file_bytes": os.path.getsize(path), "threads": args.threads,
            "repeats": args.repeats, "cpu_count": os.cpu_count(), "started": time.strftime(
                "%Y-%m-%dT%H:%M:%S", time.localtime(t_start)), "wall_s": time.time() - t_start,
            "loadavg_before": load_before, "loadavg_after": _loadavg(), "runs": results, "median": summary}


def ppl(args) -> list[dict]:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests", "quantization"))
    import math

    import torch
    from format_writers import awq_tensors, ct_scheme, ct_tensors, gptq_tensors

    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.bench import _SENTENCES
    from pagedllm.loader import load_model

    path = _model_path("smollm2")
    lm = load_model(path, quantization="none")
    sd = {k: v.clone() for k, v in lm.weights()}
    cfg = lm.hf_config.to_transformers().to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    text = " ".join(_SENTENCES)
    ids = lm.tokenizer.encode(text, add_special_tokens=False)[:400]
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def write(d, qc, fn):
        from safetensors.torch import save_file

        os.makedirs(d, exist_ok=True)
        out = {}
        for name, t in sd.items():
            mod, _, leaf = name.rpartition(".")
            if fn is not None and leaf == "weight" and mod.rsplit(".", 1)[-1] in linears:
                out.update({f"{mod}.{k}": v for k, v in fn(t)[0].items()})
            else:
                out[name] = t
        c = dict(cfg)
        if qc:
            c["quantization_config"] = qc
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
        lm.tokenizer.save_pretrained(d)
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(d, "model.safetensors"))
        return d

    def ct(fmt, scheme):
        return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                "ignore": ["lm_head"], "config_groups": {"group_0": scheme.model_dump(exclude_none=True)}}

    tmp = tempfile.mkdtemp(prefix="quant-bench-")
    cases = [
        ("float32 (GGUF dequantized)", path, "none"),
        ("GGUF Q4_1 native", path, None),
        ("gptq 4-bit g64 act-order", write(f"{tmp}/gptq", {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                                            "desc_act": True, "sym": False},
                                           lambda w: gptq_tensors(w, 4, 64, False, True, True)), None),
        ("awq 4-bit g64", write(f"{tmp}/awq", {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                               "version": "gemm"}, lambda w: awq_tensors(w, 64)), None),
        ("compressed-tensors W4A16 g64", write(f"{tmp}/w4a16", ct("pack-quantized", ct_scheme("W4A16", group_size=64)),
                                               lambda w: ct_tensors(w, ct_scheme("W4A16", group_size=64),
                                                                    "pack-quantized")), None),
        ("compressed-tensors W8A8", write(f"{tmp}/w8a8", ct("int-quantized", ct_scheme("W8A8")),
                                          lambda w: ct_tensors(w, ct_scheme("W8A8"), "int-quantized")), None),
        ("compressed-tensors FP8 (channel)", write(f"{tmp}/fp8", ct("float-quantized", ct_scheme("FP8_DYNAMIC")),
                                                   lambda w: ct_tensors(w, ct_scheme("FP8_DYNAMIC"),
                                                                        "float-quantized")), None),
    ]
    results = []
    for label, p, q in cases:
        llm = LLM(p, dtype="float32", quantization=q, kv_cache_memory=64 * 1024**2, max_num_batched_tokens=512,
                  num_threads=args.threads, seed=0)
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                       temperature=0), use_tqdm=False)[0]
        lps = [pl[t].logprob for pl, t in zip(out.prompt_logprobs[1:], ids[1:])]
        r = {"case": label, "perplexity": math.exp(-sum(lps) / len(lps)),
             "weight_bytes": llm.llm_engine.core.weight_bytes}
        results.append(r)
        print(json.dumps(r), flush=True)
        del llm
        torch.set_num_threads(args.threads)
    base = results[0]["perplexity"]
    for r in results:
        r["vs_float32"] = r["perplexity"] / base
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--model", default="gemma3", help="gemma3, smollm2 or a .gguf path")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--repeats", type=int, default=1)
    s.add_argument("--no-llama", action="store_true", help="skip both llama.cpp peers")
    s.add_argument("--modes", default=None, help="comma-separated mode labels (default: all available)")
    s.add_argument("--node-llama-cpp-dir", default=None,
                   help="npm prefix holding node-llama-cpp (default $NODE_LLAMA_CPP_DIR, else "
                        "benchmarks/.peers/node-llama-cpp)")
    s.add_argument("--node", default="node", help="the node executable (>= 20)")
    s.add_argument("--json-output", default=None)
    p = sub.add_parser("ppl")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json-output", default=None)
    w = sub.add_parser("worker")
    w.add_argument("--path")
    w.add_argument("--label")
    w.add_argument("--threads", type=int, default=1)
    w.add_argument("--dtype", default="float32")
    w.add_argument("--quantization", default=None)
    w.add_argument("--llama", action="store_true")
    a = ap.parse_args()
    if a.cmd == "worker":
        r = worker_llama(a) if a.llama else worker_pagedllm(a)
        print("RESULT " + json.dumps(r), flush=True)
        return
    res = speed(a) if a.cmd == "speed" else ppl(a)
    if a.json_output:
        with open(a.json_output, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
