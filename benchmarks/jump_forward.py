"""Jump-forward structured decoding benchmark: output tokens/s with and without, in one run.

Workload: SmolLM2 (greedy, so both configurations must emit the same tokens: checked) fills a
JSON schema of 20 required properties (strings, integers, numbers, booleans, enums); one
request alone (``single``) and 8 at once (``batch8``). Each layout of the JSON is measured:
``default`` (whitespace allowed between tokens, at most ``max_whitespace_cnt`` per run) and
``compact`` (``disable_any_whitespace``: no whitespace, so every key and its punctuation is
forced). Both engines are loaded once; runs alternate between them ``--repeats`` times and the
medians are reported with the engine steps each run took (``EngineCore.step`` calls) and the
jump-forward counters (drafts, draft tokens, accepted tokens).

    PYTHONPATH=. python benchmarks/jump_forward.py --repeats 3 \\
        --json-output benchmarks/results/jump-forward-DATE.json

The JSON records the CPU, the load average before and after, and the per-run figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

_KINDS = [{"type": "string", "maxLength": 24}, {"type": "integer", "minimum": 0, "maximum": 100000},
          {"type": "boolean"}, {"enum": ["low", "medium", "high"]}, {"type": "number"}]
_NAMES = ["first_name", "last_name", "age", "is_active", "priority", "height_cm", "email", "employee_id",
          "has_license", "department", "salary", "city", "zip_code", "is_remote", "seniority",
          "rating", "country", "years_of_service", "is_manager", "clearance_level"]
SCHEMA = {"type": "object",
          "properties": {n: _KINDS[[0, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3][i]]
                         for i, n in enumerate(_NAMES)},
          "required": _NAMES}
PROMPTS = [
    "Invent an employee record for a software engineer in Berlin, as JSON.",
    "Create a JSON profile for a nurse who works night shifts in Lyon.",
    "Describe a fictional sales manager from Toronto as a JSON object.",
    "Make up a JSON record for a junior data analyst in Madrid.",
    "Give a JSON record for a remote product designer living in Oslo.",
    "Write a JSON entry for a warehouse supervisor in Chicago.",
    "Produce a JSON record of a senior accountant based in Tokyo.",
    "Generate a JSON description of a marketing intern in Sydney.",
]


def _cpu() -> dict:
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    fl = line.split(":", 1)[1].split()
                    flags = [x for x in fl if x.startswith(("avx", "amx"))]
    except OSError:
        pass
    return {"model": model, "isa_flags": flags, "cores": os.cpu_count()}


def _run(llm, prompts: list[str], sp) -> dict:
    core = llm.llm_engine.core
    steps = [0]
    orig = core.step

    def counted():
        steps[0] += 1
        return orig()

    core.step = counted
    before = dict(core.get_scheduler_stats())
    t0 = time.perf_counter()
    try:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False)
    finally:
        core.step = orig
    dt = time.perf_counter() - t0
    after = core.get_scheduler_stats()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        json.loads(o.outputs[0].text)  # valid JSON (or the run is wrong)
    jf = {k: after.get(k, 0) - before.get(k, 0) for k in
          ("jump_forward_num_drafts", "jump_forward_num_draft_tokens", "jump_forward_num_accepted_tokens")}
    return {"seconds": dt, "output_tokens": n, "output_tokens_per_s": n / dt, "engine_steps": steps[0],
            "token_ids": [list(o.outputs[0].token_ids) for o in outs], **jf}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--layouts", default="default,compact")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--json-output", default=None)
    args = ap.parse_args()

    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    load_before = os.getloadavg()
    llms = {jf: LLM(args.model, seed=0, quantization=args.quantization, max_num_batched_tokens=1024,
                    structured_outputs_config={"jump_forward": jf}) for jf in (True, False)}
    results: dict = {}
    for layout in args.layouts.split(","):
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=layout == "compact")
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=so)
        for wl, prompts in (("single", PROMPTS[:1]), ("batch8", PROMPTS)):
            runs: dict = {True: [], False: []}
            _run(llms[True], prompts[:1], sp)  # warm-up (grammar compile, first-step costs)
            _run(llms[False], prompts[:1], sp)
            for _ in range(args.repeats):
                for jf in (True, False):
                    runs[jf].append(_run(llms[jf], prompts, sp))
            same = all(a["token_ids"] == runs[False][0]["token_ids"] for a in runs[True] + runs[False])
            med = {jf: statistics.median(r["output_tokens_per_s"] for r in runs[jf]) for jf in runs}
            key = f"{layout}/{wl}"
            results[key] = {
                "identical_outputs": same,
                "output_tokens": runs[True][0]["output_tokens"],
                "on": {"median_output_tokens_per_s": med[True], "engine_steps": runs[True][0]["engine_steps"],
                       **{k: runs[True][0][k] for k in runs[True][0] if k.startswith("jump_forward")},
                       "runs_output_tokens_per_s": [r["output_tokens_per_s"] for r in runs[True]]},
                "off": {"median_output_tokens_per_s": med[False], "engine_steps": runs[False][0]["engine_steps"],
                        "runs_output_tokens_per_s": [r["output_tokens_per_s"] for r in runs[False]]},
                "ratio": med[True] / med[False],
                "step_ratio": runs[False][0]["engine_steps"] / max(1, runs[True][0]["engine_steps"]),
            }
            print(f"{key:16s} on {med[True]:7.1f} tok/s  off {med[False]:7.1f} tok/s  ratio {med[True] / med[False]:.2f}x"
                  f"  steps {runs[True][0]['engine_steps']} vs {runs[False][0]['engine_steps']}  identical={same}",
                  flush=True)
    out = {"benchmark": "jump_forward", "model": args.model, "quantization": args.quantization,
           "max_tokens": args.max_tokens, "repeats": args.repeats, "schema_properties": len(_NAMES),
           "cpu": _cpu(), "threads": os.environ.get("PAGEDLLM_NUM_THREADS"),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({k: {"ratio": v["ratio"], "step_ratio": v["step_ratio"]} for k, v in results.items()}))


if __name__ == "__main__":
    main()
