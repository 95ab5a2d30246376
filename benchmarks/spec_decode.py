"""Speculative decoding benchmark: same-run ratios of output tokens/s against no speculation.

Workloads (greedy, so every configuration emits the same tokens):

* ``copy``: single stream, "repeat this ~300-token text word for word" (prompt lookup's case);
* ``chat``: single stream, ordinary chat prompts;
* ``batch``: ``--num-prompts`` requests at once (the builtin random-token workload of
  ``pagedllm bench throughput``), where the automatic switch-off should keep speculation from
  costing throughput;
* ``sweep``: ordinary chat prompts (repeated) batched 1..32 at once, to place the automatic
  switch-off (``pagedllm.worker.spec_decoder.AUTO_DISABLE_BATCH_SIZE``): run it with configs
  whose ``disable_by_batch_size`` is 0 (``ngram-on``, ``suffix-on``).

Every configuration is loaded once; runs alternate between them ``--repeats`` times and the
medians are reported with the mean acceptance length (1 + accepted drafts / drafts).

    PYTHONPATH=. python benchmarks/spec_decode.py --workloads copy,chat,batch --repeats 3 \\
        --json-output benchmarks/results/spec-decode-DATE.json

``--quantization`` is passed to ``LLM`` for the target (default None: a quantized GGUF keeps its
blocks; ``none`` dequantizes at load). The JSON records the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

CONFIGS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 5},
    "int4-self": {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "quantization": "int4",
                  "num_speculative_tokens": 3},
}
# The same with the automatic switch-off disabled (speculation in every step).
CONFIGS.update({f"{k}-on": {**v, "disable_by_batch_size": 0} for k, v in list(CONFIGS.items()) if v})

SENTENCES = [
    "Speculative decoding speeds up text generation by letting a cheap proposer guess several tokens ahead.",
    "The large model then checks all of the guesses in a single forward pass over the sequence.",
    "When the guesses are right, several tokens come out for the price of one step of the model.",
    "When a guess is wrong, it is replaced by the model's own choice, and nothing is lost.",
    "The method works best when the output repeats text that is already present in the context.",
    "Editing a document, fixing typos in a paragraph, or copying a list are common examples of this.",
    "Prompt lookup finds the last few tokens of the output somewhere in the prompt.",
    "It then proposes the tokens that followed them there as the next guesses.",
    "A draft model instead runs a smaller network to predict what the large model will say next.",
    "The rejection sampler keeps the output distribution exactly equal to the large model's own.",
    "Memory bandwidth, not arithmetic, limits how fast a single stream can be decoded on a CPU.",
    "Verifying a handful of tokens therefore costs about as much as generating a single one.",
    "Large batches are different: there the arithmetic dominates and extra tokens are not free.",
    "That is why the engine switches speculation off when a step holds many requests at once.",
]

CHAT = [
    "What is the capital of France? Answer in two sentences.",
    "Write a Python function that reverses a list, with a docstring.",
    "Explain what a hash map is to a beginner.",
    "Give me three tips for writing clear emails.",
    "Tell me a short story about a robot who learns to paint.",
    "What are the main differences between cats and dogs as pets?",
    "How does a refrigerator keep food cold?",
    "Suggest a weekend itinerary for a first visit to Rome.",
]


def copy_prompts(tok, n: int, target_tokens: int = 300) -> list[list[dict]]:
    """``n`` "repeat word for word" chats over ~``target_tokens``-token texts (rotated sentences)."""
    out = []
    for i in range(n):
        text, j = "", i
        while len(tok(text).input_ids) < target_tokens:
            text += SENTENCES[j % len(SENTENCES)] + " "
            j += 1
        out.append([{"role": "user", "content": "Repeat the following text word for word:\n\n" + text.strip()}])
    return out


def run_single_stream(llm, convs, max_tokens: int) -> tuple[int, float]:
    from pagedllm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    n, t0 = 0, time.perf_counter()
    for c in convs:
        n += len(llm.chat(c, sp, use_tqdm=False)[0].outputs[0].token_ids)
    return n, time.perf_counter() - t0


def run_batch(llm, prompts, max_tokens: int) -> tuple[int, float]:
    from pagedllm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def run_chat_batch(llm, convs, max_tokens: int) -> tuple[int, float]:
    from pagedllm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.chat(convs, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def spec_snapshot(llm):
    st = llm.llm_engine.core.scheduler.spec_stats
    return (st.num_drafts, st.num_accepted_tokens) if st is not None else (0, 0)


def main() -> None:
    from pagedllm import LLM
    from pagedllm.entrypoints.bench import builtin_workload

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--configs", default="none,ngram,suffix,int4-self")
    ap.add_argument("--workloads", default="copy,chat,batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-copy", type=int, default=2)
    ap.add_argument("--num-chat", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch-output-len", type=int, default=64)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--json-output", default=None)
    args = ap.parse_args()

    names = args.configs.split(",")
    wls = args.workloads.split(",")
    llms = {}
    for name in names:
        spec = CONFIGS[name]
        llms[name] = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, seed=0,
                         kv_cache_memory=384 * 1024**2, speculative_config=spec,
                         quantization=args.quantization)
    tok = llms[names[0]].get_tokenizer()
    work = {}
    if "copy" in wls:
        work["copy"] = ("single", copy_prompts(tok, args.num_copy))
    if "chat" in wls:
        work["chat"] = ("single", [[{"role": "user", "content": c}] for c in CHAT[:args.num_chat]])
    if "batch" in wls:
        work["batch"] = ("batch", builtin_workload(tok, args.num_prompts, 50, 300, 0))
    if "sweep" in wls:
        for b in (1, 2, 4, 8, 16, 32):
            convs = [[{"role": "user", "content": CHAT[i % len(CHAT)]}] for i in range(b)]
            work[f"sweep-b{b}"] = ("chat-batch", convs)
    res: dict = {"model": args.model, "dtype": str(llms[names[0]].llm_engine.core.dtype), "repeats": args.repeats,
                 "threads": args.num_threads, "quantization": args.quantization,
                 "loadavg_start": os.getloadavg(), "args": vars(args), "workloads": {}}
    for wl, (kind, data) in work.items():
        tps = {n: [] for n in names}
        acc = {n: [0, 0] for n in names}
        for rep in range(args.repeats + 1):
            for n in names:
                llm = llms[n]
                d0, a0 = spec_snapshot(llm)
                if kind == "single":
                    toks, el = run_single_stream(llm, data, args.max_tokens)
                elif kind == "chat-batch":
                    toks, el = run_chat_batch(llm, data, args.batch_output_len)
                else:
                    toks, el = run_batch(llm, data, args.batch_output_len)
                d1, a1 = spec_snapshot(llm)
                if rep == 0:
                    continue  # warm-up
                tps[n].append(toks / el)
                acc[n][0] += d1 - d0
                acc[n][1] += a1 - a0
        row = {}
        base = statistics.median(tps["none"]) if "none" in tps else None
        for n in names:
            m = statistics.median(tps[n])
            row[n] = {"output_tokens_per_s": m, "runs": tps[n],
                      "mean_acceptance_length": (1 + acc[n][1] / acc[n][0]) if acc[n][0] else None,
                      "ratio_vs_none": m / base if base else None}
        res["workloads"][wl] = row
        print(wl, json.dumps({n: (round(r["output_tokens_per_s"], 2), r["ratio_vs_none"] and round(r["ratio_vs_none"], 3),
                                  r["mean_acceptance_length"] and round(r["mean_acceptance_length"], 2))
                              for n, r in row.items()}), flush=True)
    res["loadavg_end"] = os.getloadavg()
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
