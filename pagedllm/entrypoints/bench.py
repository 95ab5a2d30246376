"""``pagedllm bench throughput | latency | hardware``: offline benchmarks (vLLM's output names).

Speed is reported as ratios against a baseline measured in the same run; nothing here is a test.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any, Optional

from pagedllm.config import QUANTIZATION_CHOICES
from pagedllm.entrypoints.cli_utils import positive_int
from pagedllm import envs

# A fixed bank of plain English sentences; prompts are drawn from it with a seeded RNG.
_SENTENCES = [
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were made.",
    "Rivers shape the land around them slowly, carrying sand and stones from the mountains down to the sea.",
    "A good recipe for bread needs only flour, water, salt and yeast, but patience matters more than any ingredient.",
    "In the morning the market fills with farmers selling apples, cheese, fresh eggs and loaves still warm from the oven.",
    "Engineers who design bridges must think about wind, traffic, temperature and the weight of the structure itself.",
    "Many birds travel thousands of kilometres every year, following the same routes their ancestors used.",
    "The library on the corner of the square has a reading room with tall windows and long wooden tables.",
    "When the train left the station, the passengers settled into their seats and watched the city disappear.",
    "Learning a new language takes time, but speaking with native speakers every day speeds it up a great deal.",
    "The museum's newest exhibition explains how ancient sailors used the stars to find their way across the ocean.",
    "Solar panels turn sunlight into electricity, and their price has fallen sharply over the last twenty years.",
    "Our neighbours planted a small garden with tomatoes, beans, herbs and a row of bright yellow sunflowers.",
    "A computer program is a list of instructions that tells the machine exactly what to do, step by step.",
    "The old lighthouse still stands on the cliff, although ships now rely on satellites rather than its lamp.",
    "Doctors recommend regular exercise, enough sleep and a varied diet as the basis of a healthy life.",
    "During the winter the lake freezes, and families come on weekends to skate and drink hot chocolate.",
    "The committee met on Tuesday to discuss the budget, the new schedule and the plans for the summer festival.",
    "Mountains affect the weather, forcing moist air upward where it cools and falls as rain or snow.",
    "She opened the letter carefully, unsure whether it would bring good news or bad.",
    "Coffee was first grown in Africa and later spread to Arabia, Europe and the rest of the world.",
    "Good teachers explain difficult ideas with simple examples and encourage students to ask questions.",
    "The city council approved a plan to add more bicycle lanes and plant trees along the main avenue.",
    "Volcanoes form where molten rock rises from deep inside the earth and breaks through the surface.",
    "After the storm, the streets were covered with leaves and broken branches, and the air smelled of rain.",
    "A well written report states its question, describes the method, presents the results and discusses them.",
    "Honeybees communicate the location of flowers to each other with a dance performed inside the hive.",
    "The orchestra rehearsed for weeks before the concert, practising the difficult passages again and again.",
    "Saving a little money every month is easier than trying to save a large amount all at once.",
    "Ancient roads built by the Romans connected distant cities and allowed trade to flourish across the empire.",
    "The children built a small boat from wood and string and watched it float down the stream.",
    "Please summarize the main ideas of the text above in three short sentences.",
    "Explain in simple words why the sky looks blue during the day and red at sunset.",
]


def builtin_workload(tokenizer: Any, num_prompts: int = 64, min_len: int = 50, max_len: int = 300,
                     seed: int = 0) -> list[list[int]]:
    """Deterministic natural-English prompts as token ids.

    Args:
        tokenizer: encodes the text.
        num_prompts: how many prompts.
        min_len, max_len: prompt length range in tokens (uniform, inclusive).
        seed: RNG seed; the same seed gives the same prompts.

    Returns:
        list of ``num_prompts`` token-id lists.
    """
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        target = rng.randint(min_len, max_len)
        text, ids = "", []
        while len(ids) < target:
            text += (" " if text else "") + rng.choice(_SENTENCES)
            ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append(list(ids[:target]))
    return prompts


def sharegpt_like_workload(tokenizer: Any, num_prompts: int = 64, seed: int = 0
                           ) -> tuple[list[list[int]], list[int]]:
    """Variable lengths like ShareGPT: prompt and output lengths from lognormal draws.

    Returns:
        (prompt token ids, output lengths in tokens).
    """
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        plen = int(min(1024, max(8, rng.lognormvariate(4.8, 0.9))))
        olen = int(min(512, max(8, rng.lognormvariate(5.0, 0.8))))
        prompts.append(builtin_workload(tokenizer, 1, plen, plen, rng.randrange(1 << 30))[0])
        outs.append(olen)
    return prompts, outs


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kw = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs or 128,
          "max_num_batched_tokens": args.max_num_batched_tokens or 2048, "seed": args.seed,
          "enable_prefix_caching": not args.no_enable_prefix_caching}
    if args.num_threads:
        kw["num_threads"] = args.num_threads
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.kv_cache_memory is not None:
        kw["kv_cache_memory"] = int(args.kv_cache_memory)
    if getattr(args, "quantization", None):
        kw["quantization"] = args.quantization
    if getattr(args, "kv_cache_dtype", None):
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "batch_invariant", False):
        kw["batch_invariant"] = True
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend"):
        if getattr(args, name, None):
            kw[name] = getattr(args, name)
    if getattr(args, "speculative_config", None):
        kw["speculative_config"] = args.speculative_config
    return kw


def _common(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.cli_utils import positive_human_int
    from pagedllm.entrypoints.openai.cli_args import parse_bytes

    p.add_argument("model", nargs="?", default="SmolLM2-135M-Instruct",
                   help="Model to benchmark, as `pagedllm serve` takes it (default: SmolLM2-135M-Instruct).")
    p.add_argument("--dtype", default="auto", help="Weight and activation dtype, as serve (default: auto).")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="int8/int4: weight-only; w8a8: int8 weights and dynamic per-token int8 activations "
                        "(default: the checkpoint's own format)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache storage (fp8: 8-bit floats, CPU only)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads for the engine (default: all cores)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="max requests per engine step (default: 128)")
    p.add_argument("--max-num-batched-tokens", type=positive_human_int, default=None,
                   help="max tokens per engine step (suffixes as serve: 8k, 8K; default: 2048)")
    p.add_argument("--max-model-len", type=positive_human_int, default=None,
                   help="max tokens per request (suffixes as serve: 32k = 32,000, 32K = 32,768; "
                        "default: the model's context length, capped by the KV cache)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache budget in bytes; accepts suffixes like 2GiB, 512MiB, 1.5G (as serve; "
                        "default: 2GiB on CPU)")
    p.add_argument("--no-enable-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant mode (outputs independent of batching, chunking and caching)")
    p.add_argument("--seed", type=int, default=0, help="engine and workload seed")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="tensor-parallel ranks (default: 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                   help="pipeline stages (default: 1)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="how ranks run, as serve (default: uni for one rank, else mp)")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--output-json", default=None, help="also write results to this file")


# ``pagedllm bench NAME`` over the engine flags (``_common``): (one-line help, description, its
# integer flags as (flag, default, help), added first).
_BENCH_COMMANDS: dict[str, tuple[str, str, tuple[tuple[str, int, str], ...]]] = {
    "throughput": ("offline throughput on a fixed workload",
                   "Offline throughput (tokens/s) on a fixed, seeded workload.", ()),
    "latency": ("single-request latency (TTFT, TPOT)",
                "Single-request latency: time to first token and per output token.",
                (("--input-len", 128, "prompt tokens"), ("--output-len", 128, "output tokens"),
                 ("--num-iters", 3, "repetitions (the median is reported)"))),
    "prefix-caching": ("shared system prompt workload: TTFT and total time, prefix caching on vs off",
                       "A shared system prompt workload, run with prefix caching on and off.",
                       (("--num-prompts", 32, "number of requests"),
                        ("--system-len", 1000, "shared system prompt tokens"),
                        ("--question-len", 50, "per-request question tokens"),
                        ("--output-len", 64, "output tokens per request"))),
    "embed": ("embedding throughput (pooling runner) vs transformers padded batches",
              "Embedding throughput of the pooling runner.",
              (("--num-prompts", 256, "number of inputs"), ("--input-len-min", 20, "shortest input in tokens"),
               ("--input-len-max", 500, "longest input in tokens"))),
}


def _add_bench_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    """``pagedllm bench NAME`` (``_BENCH_COMMANDS``): the engine flags, then its integer flags."""
    help_, description, int_flags = _BENCH_COMMANDS[name]
    p = sub.add_parser(name, help=help_, description=description)
    _common(p)
    for flag, default, text in int_flags:
        p.add_argument(flag, type=positive_int, default=default, help=text)
    return p


def _add_transformers_flags(p: argparse.ArgumentParser, help_: str) -> None:
    """``--compare-transformers`` (described by ``help_``) and its ``--hf-batch-size``."""
    p.add_argument("--compare-transformers", action="store_true", help=help_)
    p.add_argument("--hf-batch-size", type=int, default=16, help="batch size of the transformers comparison")


def add_throughput_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedllm bench throughput``."""
    p = _add_bench_parser(sub, "throughput")
    p.add_argument("--dataset", choices=["builtin", "sharegpt-like"], default="builtin",
                   help="builtin: fixed English prompts; sharegpt-like: lognormal prompt/output lengths")
    p.add_argument("--num-prompts", type=positive_int, default=64, help="number of requests")
    p.add_argument("--input-len-min", type=positive_int, default=50, help="shortest prompt in tokens (builtin)")
    p.add_argument("--input-len-max", type=positive_int, default=300, help="longest prompt in tokens (builtin)")
    p.add_argument("--input-len", type=positive_int, default=None,
                   help="every prompt this many tokens (vLLM's flag; sets --input-len-min and --input-len-max)")
    p.add_argument("--output-len", type=positive_int, default=128, help="output tokens per request (builtin)")
    _add_transformers_flags(p, "run the same requests through transformers generate (batched, left-padded)")
    p.add_argument("--null-model", action="store_true",
                   help="host time per decode step by phase: the real engine, scheduler, sampler, output "
                        "processor and the model's tokenizer over a model whose forward costs ~nothing "
                        "(pagedllm.worker.null_model); all requests decode together (max-num-seqs and "
                        "max-num-batched-tokens default to fit them)")
    p.add_argument("--null-model-vocab-size", type=int, default=512,
                   help="logits width of the null model (default 512: the vocabulary-wide sampling "
                        "kernels are device work, kept small so the report is host work; 0 = the model's)")


def add_latency_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedllm bench latency``."""
    p = _add_bench_parser(sub, "latency")
    p.add_argument("--num-iters-warmup", type=positive_int, default=1,
                   help="untimed repetitions first (vLLM's flag; default %(default)s)")


def add_prefix_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedllm bench prefix-caching``."""
    _add_bench_parser(sub, "prefix-caching")


def add_embed_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedllm bench embed``."""
    p = _add_bench_parser(sub, "embed")
    p.add_argument("--pooling-type", default="LAST", help="pooling: LAST, MEAN, CLS, ...")
    _add_transformers_flags(p, "also time transformers on padded batches")


def add_hardware_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedllm bench hardware``."""
    p = sub.add_parser("hardware", help="this machine's matmul GFLOP/s and memory bandwidth",
                       description="This machine's matmul GFLOP/s and memory bandwidth.")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--output-json", default=None, help="also write results to this file")


def _emit(res: dict, args: argparse.Namespace) -> None:
    if getattr(args, "json", False):
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:<40} {v:.3f}" if isinstance(v, float) else f"{k:<40} {v}")
    if getattr(args, "output_json", None):
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)


def run_throughput(args: argparse.Namespace) -> dict:
    if getattr(args, "null_model", False):
        return run_null_model_throughput(args)
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, **_engine_kwargs(args))
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    if args.dataset == "builtin":
        prompts = builtin_workload(tok, args.num_prompts, args.input_len_min, args.input_len_max, args.seed)
        out_lens = [args.output_len] * len(prompts)
    else:
        prompts, out_lens = sharegpt_like_workload(tok, args.num_prompts, args.seed)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in out_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    # Warm-up (first-call allocations), not timed.
    llm.generate(inputs[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    spec0 = _spec_snapshot(llm)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    el = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    res = {
        "engine": "pagedllm", "model": args.model, "dtype": str(llm.llm_engine.core.dtype),
        "num_requests": len(prompts), "total_prompt_tokens": n_in, "total_output_tokens": n_out,
        "elapsed_s": el, "requests_per_s": len(prompts) / el, "output_tokens_per_s": n_out / el,
        "total_tokens_per_s": (n_in + n_out) / el, "startup_s": load_s,
    }
    res.update(_spec_results(llm, spec0))
    if args.compare_transformers:
        hf = _transformers_throughput(llm, prompts, out_lens, args)
        res.update({f"transformers_{k}": v for k, v in hf.items()})
        res["ratio_output_tokens_per_s_vs_transformers"] = res["output_tokens_per_s"] / hf["output_tokens_per_s"]
    return res


def _spec_snapshot(llm: Any) -> Optional[tuple[int, int, int]]:
    """(drafts, draft tokens, accepted tokens) so far, or None without speculative decoding."""
    st = llm.llm_engine.core.scheduler.spec_stats
    return None if st is None else (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)


def _spec_results(llm: Any, before: Optional[tuple[int, int, int]]) -> dict:
    """The timed run's speculative decoding figures: method, drafts, acceptance rate (accepted
    / draft tokens) and mean acceptance length (1 + accepted / drafts); {} when off."""
    now = _spec_snapshot(llm)
    if now is None or before is None:
        return {}
    d, t, a = (x - y for x, y in zip(now, before))
    return {"spec_decode_method": llm.llm_engine.core.spec_config.method, "spec_decode_num_drafts": d,
            "spec_decode_acceptance_rate": a / t if t else 0.0,
            "spec_decode_mean_acceptance_length": 1.0 + a / d if d else 1.0}


# The null model's engine: the real tokenizer and config, shrunk to one tiny layer (weights are
# never read: load_format "dummy"), then the model swapped for a NullModel.
_NULL_CONFIG = {"num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 1,
                "num_key_value_heads": 1, "head_dim": 8, "tie_word_embeddings": True}


def build_null_model_llm(model: str, num_prompts: int, max_prompt_len: int, output_len: int,
                         vocab_size: int = 512, seed: int = 0, **engine_kwargs: Any) -> Any:
    """An in-process ``LLM`` over :class:`pagedllm.worker.null_model.NullModel`.

    Args:
        model: whose tokenizer and config (``LLM``'s ``model``).
        num_prompts, max_prompt_len, output_len: the workload; size ``max_num_seqs``,
            ``max_num_batched_tokens``, ``max_model_len`` and the KV cache (unless given in
            ``engine_kwargs``) so that every request is admitted in the first step.
        vocab_size: logits width (0: the model's; prompts must then use ids below it).
        seed: engine seed (and the null model's logits table).
        engine_kwargs: other ``EngineArgs`` fields.

    Returns:
        the ``LLM`` (its runner's model is the NullModel).
    """
    from pagedllm import LLM
    from pagedllm.worker.null_model import NullModel

    overrides = dict(_NULL_CONFIG)
    if vocab_size:
        overrides["vocab_size"] = int(vocab_size)
    mml = max_prompt_len + output_len + 16
    kw = {"max_num_seqs": max(num_prompts, 1), "max_num_batched_tokens": max(2048, num_prompts * max_prompt_len),
          "max_model_len": mml, "dtype": "float32", "enable_prefix_caching": False,
          # 1 layer x 1 KV head x head_dim 8 x K and V x 4 bytes = 64 bytes a token, + slack blocks
          "kv_cache_memory": (max(num_prompts, 1) * -(-mml // 16) + 64) * 16 * 64}
    kw.update({k: v for k, v in engine_kwargs.items() if v is not None})
    kw.update(load_format="dummy", hf_overrides=overrides, seed=seed, distributed_executor_backend="uni")
    llm = LLM(model, **kw)
    core = llm.llm_engine.core
    V = int(core.vocab_size)
    null = NullModel(V, seed=seed, token_range=(256, V) if V > 512 // 2 + 1 else None)
    core.runner.model = null
    core.runner.decode_accelerator = None  # built for the real model's layers, not the null one
    core._driver_worker().model = null
    return llm


# ``bench throughput --null-model``'s bounds: (argument, least value, why).
_NULL_MODEL_MINIMUMS = (("output_len", 2, " with --null-model (decode steps follow the first token)"),
                        ("null_model_vocab_size", 0, ""))


def run_null_model_throughput(args: argparse.Namespace) -> dict:
    """``bench throughput --null-model``: host milliseconds per decode step, by phase.

    Two timed passes over the same greedy requests (prompts re-tokenized into the null
    vocabulary): one timing whole steps only (``host_ms_per_decode_step``), one timing the
    phases too (``phases_ms_per_decode_step``, see ``pagedllm.entrypoints.host_time``).
    """
    from pagedllm import SamplingParams
    from pagedllm.entrypoints.host_time import HostTimeProfiler

    for name, low, why in _NULL_MODEL_MINIMUMS:
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= {low}{why}, got {getattr(args, name)}")
    explicit = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                "num_threads": args.num_threads, "max_model_len": args.max_model_len}
    t0 = time.perf_counter()
    llm = build_null_model_llm(args.model, args.num_prompts, args.input_len_max, args.output_len,
                               args.null_model_vocab_size, args.seed, **explicit)
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    V = int(llm.llm_engine.core.vocab_size)
    prompts = builtin_workload(tok, args.num_prompts, args.input_len_min, args.input_len_max, args.seed)
    prompts = [[t % V for t in p] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    # Warm-up, not timed: the same requests (the first full-size pass grows the input batch,
    # block pool and allocator caches; it is ~2x slower than the next).
    llm.generate(inputs, params, use_tqdm=False)
    res: dict = {"engine": "pagedllm", "model": args.model, "null_model": True, "null_model_vocab_size": V,
                 "num_requests": len(prompts), "output_len": args.output_len, "startup_s": load_s}
    texts = None
    for phases in (False, True):
        prof = HostTimeProfiler(llm, phases=phases)
        try:
            t0 = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False)
            el = time.perf_counter() - t0
        finally:
            prof.close()
        rep = prof.report()
        got = [o.outputs[0].text for o in outs]
        if texts is not None and got != texts:
            raise RuntimeError("null model: the two passes produced different outputs")
        texts = got
        if not phases:
            res.update(host_ms_per_decode_step=rep["host_ms_per_decode_step"],
                       host_cpu_ms_per_decode_step=rep["host_cpu_ms_per_decode_step"], num_steps=rep["num_steps"],
                       num_decode_steps=rep["num_decode_steps"],
                       mean_decode_batch_size=rep["mean_decode_batch_size"], elapsed_s=el,
                       output_tokens_per_s=sum(len(o.outputs[0].token_ids) for o in outs) / el)
        else:
            res["phases_ms_per_decode_step"] = rep["phases_ms_per_decode_step"]
            res["phased_host_ms_per_decode_step"] = rep["host_ms_per_decode_step"]
    return res


def _transformers_throughput(llm: Any, prompts: list[list[int]], out_lens: list[int],
                             args: argparse.Namespace) -> dict:
    """Same requests through ``transformers`` generate, batched and left-padded, greedy."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    path = llm.llm_engine.core.loaded.model_path
    dtype = llm.llm_engine.core.dtype
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    pad = llm.get_tokenizer().pad_token_id
    pad = 0 if pad is None else pad
    bs = args.hf_batch_size
    n_out = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), bs):
            chunk = prompts[i:i + bs]
            olen = max(out_lens[i:i + bs])
            L = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), L), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.long)
            for j, p in enumerate(chunk):
                ids[j, L - len(p):] = torch.tensor(p)
                mask[j, L - len(p):] = 1
            g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=olen, min_new_tokens=olen,
                               do_sample=False, pad_token_id=pad)
            n_out += (g.shape[1] - L) * len(chunk)
    el = time.perf_counter() - t0
    return {"elapsed_s": el, "output_tokens_per_s": n_out / el, "batch_size": bs}


def run_latency(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    t0 = time.perf_counter()
    llm = LLM(args.model, **_engine_kwargs(args))
    load_s = time.perf_counter() - t0
    prompt = builtin_workload(llm.get_tokenizer(), 1, args.input_len, args.input_len, args.seed)[0]
    eng = llm.llm_engine
    lat, ttft, tpot = [], [], []
    first_token_s = None
    spec0 = None
    warm = max(1, getattr(args, "num_iters_warmup", 1))
    for it in range(args.num_iters + warm):
        if it == warm:
            spec0 = _spec_snapshot(llm)  # after the warm-up
        llm.reset_prefix_cache()
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        t = time.perf_counter()
        eng.add_request(f"lat-{it}", {"prompt_token_ids": prompt}, sp)
        times = []
        done = False
        while not done:
            for o in eng.step():
                times.append(time.perf_counter())
                done = done or o.finished
        if it == 0:
            first_token_s = load_s + (times[0] - t)
        if it < warm:
            continue  # warm-up
        lat.append(times[-1] - t)
        ttft.append(times[0] - t)
        tpot.append((times[-1] - times[0]) / max(1, args.output_len - 1))
    return {
        "engine": "pagedllm", "input_len": args.input_len, "output_len": args.output_len,
        "avg_latency_s": statistics.mean(lat), "median_ttft_ms": 1000 * statistics.median(ttft),
        # One output token has no decode step: TPOT and decode speed are undefined (None).
        "median_tpot_ms": 1000 * statistics.median(tpot) if args.output_len > 1 else None,
        "decode_tokens_per_s": 1.0 / statistics.median(tpot) if args.output_len > 1 else None,
        "startup_s": load_s, "startup_to_first_token_s": first_token_s,
        **_spec_results(llm, spec0),
    }


def run_batch(eng: Any, prompts: list, sp: Any) -> tuple[list[float], int]:
    """Add ``prompts`` (engine inputs: prompt dicts) to the engine ``eng`` at once with the
    sampling params ``sp`` and step it until every request finishes.

    Returns:
        (time to first output of each request in seconds since the submission, in order of
        arrival; prompt tokens served from the prefix cache, summed over the requests).
    """
    t0 = time.perf_counter()
    ids = [eng.next_request_id() for _ in prompts]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, sp)
    first: dict[str, float] = {}
    done = cached = 0
    while done < len(ids):
        for o in eng.step():
            first.setdefault(o.request_id, time.perf_counter() - t0)
            if o.finished:
                done += 1
                cached += o.num_cached_tokens or 0
    return list(first.values()), cached


def _timed_run(eng: Any, prompts: list[list[int]], output_len: int) -> dict:
    """Submit every prompt at once and step the engine; per-request TTFT (s) and total time (s)."""
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    ttft, cached = run_batch(eng, inputs, sp)
    ttft.sort()
    return {"total_s": time.perf_counter() - t0, "ttft_median_s": statistics.median(ttft),
            "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "cached_tokens": cached}


def run_prefix_caching(args: argparse.Namespace) -> dict:
    """32 requests sharing a ~1,000-token system prompt, different ~50-token questions, 64 output
    tokens each; the same engine settings with prefix caching on and off, run one after the other."""
    from pagedllm import LLM

    res: dict = {"num_requests": args.num_prompts, "system_len": args.system_len,
                 "question_len": args.question_len, "output_len": args.output_len}
    for mode in ("on", "off"):
        kw = _engine_kwargs(args)
        kw["enable_prefix_caching"] = mode == "on"
        llm = LLM(args.model, **kw)
        tok = llm.get_tokenizer()
        system = builtin_workload(tok, 1, args.system_len, args.system_len, args.seed)[0]
        qs = builtin_workload(tok, args.num_prompts, args.question_len, args.question_len, args.seed + 1)
        prompts = [system + q for q in qs]
        r = _timed_run(llm.llm_engine, prompts, args.output_len)
        res.update({f"caching_{mode}_{k}": v for k, v in r.items()})
        del llm
    res["ratio_ttft_median_off_over_on"] = res["caching_off_ttft_median_s"] / res["caching_on_ttft_median_s"]
    res["ratio_total_off_over_on"] = res["caching_off_total_s"] / res["caching_on_total_s"]
    return res


def run_embed(args: argparse.Namespace) -> dict:
    """Embedding throughput: inputs/s and tokens/s for mixed-length inputs (LAST pooling by default)."""
    import os

    import torch

    from pagedllm import LLM

    kw = _engine_kwargs(args)
    kw.pop("enable_prefix_caching", None)
    llm = LLM(args.model, runner="pooling", convert="embed",
              pooler_config={"pooling_type": args.pooling_type, "use_activation": True}, **kw)
    prompts = builtin_workload(llm.get_tokenizer(), args.num_prompts, args.input_len_min, args.input_len_max,
                               args.seed)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.embed(inputs[:2], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.embed(inputs, use_tqdm=False)
    el = time.perf_counter() - t0
    n_tok = sum(len(p) for p in prompts)
    res = {"engine": "pagedllm", "num_inputs": len(prompts), "total_tokens": n_tok, "elapsed_s": el,
           "inputs_per_s": len(prompts) / el, "tokens_per_s": n_tok / el,
           "dim": len(outs[0].outputs.embedding)}
    if args.compare_transformers:
        from transformers import AutoModel

        path = llm.llm_engine.core.loaded.model_path
        dtype = llm.llm_engine.core.dtype
        if path.endswith(".gguf"):
            model = AutoModel.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
        else:
            model = AutoModel.from_pretrained(path, dtype=dtype)
        model.eval()
        bs = args.hf_batch_size
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), bs):
                chunk = prompts[i:i + bs]
                L = max(len(p) for p in chunk)
                ids = torch.zeros((len(chunk), L), dtype=torch.long)
                mask = torch.zeros((len(chunk), L), dtype=torch.long)
                for j, p in enumerate(chunk):  # right padding: LAST = position len-1
                    ids[j, :len(p)] = torch.tensor(p)
                    mask[j, :len(p)] = 1
                h = model(input_ids=ids, attention_mask=mask).last_hidden_state
                last = torch.tensor([len(p) - 1 for p in chunk])
                torch.nn.functional.normalize(h[torch.arange(len(chunk)), last].float(), dim=-1)
        hf_el = time.perf_counter() - t0
        res.update({"transformers_elapsed_s": hf_el, "transformers_inputs_per_s": len(prompts) / hf_el,
                    "transformers_tokens_per_s": n_tok / hf_el,
                    "ratio_inputs_per_s_vs_transformers": hf_el / el})
    return res


#: Largest square matmul ``measure_hardware`` times, and the time one call may take before the size
#: stops doubling (a CPU without native bf16 runs a 2048^3 bf16 matmul for minutes).
_MATMUL_MAX_N = 2048
_MATMUL_GROW_S = 0.25


def measure_hardware(num_threads: Optional[int] = None) -> dict:
    """Matmul GFLOP/s (fp32, bf16) and read / copy bandwidth (GB/s) on this machine.

    Each matmul is square, best of 3: n doubles from 256 up to 2048 while one call takes under
    ``_MATMUL_GROW_S`` s, so a dtype the CPU lacks (bf16 without AVX512-BF16 / AMX) is measured
    in seconds at a smaller n (``matmul_<dtype>_n`` records it). Bandwidth: 256 MiB of float32,
    ``sum`` (read) and ``copy_`` (read + write), best of 3.
    """
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    res: dict = {"threads": torch.get_num_threads()}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        n = 256
        while True:
            a = torch.randn(n, n).to(dt)
            b = torch.randn(n, n).to(dt)
            t = time.perf_counter()
            a @ b
            if n >= _MATMUL_MAX_N or time.perf_counter() - t >= _MATMUL_GROW_S:
                break
            n *= 2
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        res[f"matmul_{name}_gflops"] = 2 * n**3 / best / 1e9
        res[f"matmul_{name}_n"] = n
    x = torch.ones(256 * 1024 * 1024 // 4)  # 256 MiB fp32
    y = torch.empty_like(x)
    x.sum()
    y.copy_(x)
    best_r = best_c = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best_r = min(best_r, time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        best_c = min(best_c, time.perf_counter() - t)
    nbytes = x.numel() * 4
    res["read_bandwidth_gbps"] = nbytes / best_r / 1e9
    res["copy_bandwidth_gbps"] = 2 * nbytes / best_c / 1e9
    return res


_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_int8", "amx_bf16")


def machine_report() -> dict:
    """What every ``bench`` report states about where it ran: the CPU model and the ISA flags that
    pick kernel paths (``/proc/cpuinfo``, proc(5)), the CPU count, torch's intra-op threads, the
    thread policy, and the path GGUF int4/int8 layers take (``intdot:<isa>`` for the integer-dot
    kernel with its ISA path, else ``group_gemm``)."""
    import os
    import platform

    import torch

    model, flags = platform.processor() or "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not flags:
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = [x for x in _ISA_FLAGS if x in have]
                    break
    except OSError:
        pass
    rep: dict = {"cpu_model": model, "isa_flags": flags, "cpu_count": os.cpu_count(),
                 "torch_threads": torch.get_num_threads(),
                 "thread_policy": envs.get("PAGEDLLM_THREAD_POLICY")}
    try:
        from pagedllm.quantization.group_quant import intdot_path

        path = intdot_path()
        rep["gguf_kernel"] = f"intdot:{path}" if path else "group_gemm"
    except Exception as e:  # a kernel that does not build is reported, not fatal to a benchmark
        rep["gguf_kernel"] = f"unknown ({e.__class__.__name__}: {e})"
    return rep


def run(args: argparse.Namespace) -> int:
    lo, hi = getattr(args, "input_len_min", None), getattr(args, "input_len_max", None)
    if getattr(args, "input_len", None) is not None and lo is not None:  # throughput's fixed length
        lo = hi = args.input_len_min = args.input_len_max = args.input_len
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"--input-len-min ({lo}) is larger than --input-len-max ({hi})")
    if args.bench_cmd == "throughput":
        res = run_throughput(args)
    elif args.bench_cmd == "latency":
        res = run_latency(args)
    elif args.bench_cmd == "embed":
        res = run_embed(args)
    elif args.bench_cmd == "prefix-caching":
        res = run_prefix_caching(args)
    elif args.bench_cmd == "image":  # pagedllm/multimodal/bench.py
        from pagedllm.multimodal.bench import run_image
        res = run_image(args)
    elif args.bench_cmd == "hardware":
        res = measure_hardware(args.num_threads)
    else:
        raise ValueError(f"unknown bench command {args.bench_cmd!r}")
    res.setdefault("machine", machine_report())
    _emit(res, args)
    return 0
