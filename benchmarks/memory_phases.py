"""Where a model's resident memory goes, phase by phase, in one process (issue 30.4).

After each phase the script runs ``gc.collect()`` and glibc's ``malloc_trim(0)`` and records VmRSS /
anonymous memory from ``/proc/self/smaps_rollup`` and ``pagedllm.metrics.memory.smaps_breakdown``
(glibc heap and arenas, lazily committed KV, other anonymous maps, mapped weights, libraries):

  python          the bare interpreter
  import torch
  server modules  ``pagedllm.entrypoints.openai.api_server`` (what ``pagedllm serve`` imports)
  kernels         the C++ CPU extensions loaded
  tokenizer       the tokenizer as served (``load_tokenizer``: transformers' fast tokenizer), then dropped
  engine          ``LLM(model, **kwargs)`` (weights mapped, KV reserved, nothing committed)
  traffic         two ~1,100-word prompts and 8 short ones, then the batch-empty trim
  idle release    ``EngineCore.release_idle_memory`` (what a server does after PAGEDLLM_IDLE_RELEASE_S)

and a census of the live CPU tensors that are not weights (grouped by shape and dtype).
``--tokenizer-parts`` instead loads the model's ``tokenizer.json`` with the bare ``tokenizers``
library, whole and without its merges / added tokens, to split the Rust tokenizer's own memory.

    python benchmarks/memory_phases.py gemma-3-270m --kv-cache-memory 64MiB [--json out.json]
    python benchmarks/memory_phases.py gemma-3-270m --tokenizer-parts

RSS figures do not depend on the machine's load; nothing here is a timing.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import sys

MiB = 1 << 20
_libc = ctypes.CDLL("libc.so.6")


def settle() -> dict[str, float]:
    """``gc.collect()`` + ``malloc_trim(0)``, then Rss / Anonymous of this process in MiB (smaps_rollup)."""
    gc.collect()
    _libc.malloc_trim(0)
    vals = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if v.strip().endswith("kB"):
                vals[k] = int(v.split()[0]) / 1024
    return {"rss": round(vals["Rss"], 1), "anon": round(vals["Anonymous"], 1)}


class Phases:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def mark(self, name: str) -> None:
        rec: dict = {"phase": name, **settle()}
        if "pagedllm.metrics.memory" in sys.modules:
            from pagedllm.metrics.memory import smaps_breakdown

            rec["smaps_mib"] = {k: round(v / MiB, 1) for k, v in smaps_breakdown().items()}
        if self.rows:
            rec["d_rss"] = round(rec["rss"] - self.rows[-1]["rss"], 1)
            rec["d_anon"] = round(rec["anon"] - self.rows[-1]["anon"], 1)
        self.rows.append(rec)
        print(json.dumps(rec), flush=True)


def tensor_census(torch) -> list[dict]:
    """Live CPU tensors reachable by the garbage collector (one entry per storage), by shape and dtype."""
    size: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    seen = set()
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                st = o.untyped_storage()
                if st.data_ptr() in seen or st.data_ptr() == 0:
                    continue
                seen.add(st.data_ptr())
                key = (tuple(o.shape), str(o.dtype).replace("torch.", ""))
                size[key] += st.nbytes()
                count[key] += 1
        except Exception:  # NOTE: tensor subclasses / freed storages mid-scan
            continue
    return [{"shape": list(k[0]), "dtype": k[1], "count": count[k], "mib": round(v / MiB, 2)}
            for k, v in size.most_common(12)]


def tokenizer_parts(model: str) -> dict:
    import tokenizers

    from pagedllm.loader.resolve import resolve_model_path
    from pagedllm.loader.tokenizer import gguf_tokenizer_cache_path, load_tokenizer

    path = resolve_model_path(model)
    load_tokenizer(path)  # makes sure the converted tokenizer.json is in the cache
    gc.collect()
    with open(os.path.join(gguf_tokenizer_cache_path(path), "tokenizer.json")) as f:
        full = json.load(f)
    out = {}
    for name, edit in (("whole", None), ("without merges", "merges"), ("without added tokens", "added")):
        spec = json.loads(json.dumps(full))
        if edit == "merges":
            spec["model"]["merges"] = []
        elif edit == "added":
            spec["added_tokens"] = []
        text = json.dumps(spec)
        del spec
        before = settle()["anon"]
        tok = tokenizers.Tokenizer.from_str(text)
        del text
        out[name] = round(settle()["anon"] - before, 1)
        del tok
    print(json.dumps(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument("--tokenizer-parts", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.tokenizer_parts:
        res: dict = {"model": a.model, "tokenizer_parts_anon_mib": tokenizer_parts(a.model)}
    else:
        ph = Phases()
        ph.mark("python")
        import torch

        ph.mark("import torch")
        import pagedllm.entrypoints.openai.api_server  # noqa: F401

        ph.mark("server modules")
        from pagedllm.kernels import cpu_ops

        cpu_ops.get_ops()
        cpu_ops.get_quant_ops()
        ph.mark("kernels")
        from pagedllm.loader.resolve import resolve_model_path
        from pagedllm.loader.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model_path(a.model))
        ph.mark("tokenizer (as served)")
        del tok
        ph.mark("tokenizer dropped")
        from pagedllm import LLM, SamplingParams

        llm = LLM(model=a.model, kv_cache_memory=a.kv_cache_memory)
        core = llm.llm_engine.core
        ph.mark("engine")
        long = " ".join(f"w{i % 97}" for i in range(1100))
        llm.generate([long, long + " x"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        llm.generate(["Hello there"] * 8, SamplingParams(max_tokens=16, temperature=0.8, seed=1), use_tqdm=False)
        core.executor.collective_rpc("trim_workspace")
        ph.mark("traffic + batch-empty trim")
        census = tensor_census(torch)
        core.release_idle_memory()
        ph.mark("idle release")
        res = {"model": a.model, "kv_cache_memory": a.kv_cache_memory, "phases": ph.rows, "live_tensors": census}
        for row in census:
            print("  live tensor", row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
