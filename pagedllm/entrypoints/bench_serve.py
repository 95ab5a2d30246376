"""``pagedllm bench serve``: an online serving benchmark client (vLLM's ``vllm bench serve``).

Sends a workload of streamed /v1/completions requests to a running server and reports
request/token throughput and TTFT / TPOT / ITL statistics in ms, printed like vLLM's.
``--json-schema`` puts a JSON schema (structured outputs) on a share of the requests
(``--structured-output-ratio``) and counts how many outputs parse and validate.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional

_WORDS = ("time person year way day thing man world life hand part child eye woman place work "
          "week case point government company number group problem fact river mountain garden "
          "music story city light water history science market language family house road "
          "window morning evening summer winter library teacher student doctor engine system "
          "question answer paper letter computer network picture island forest ocean bridge").split()

_TOPICS = ["the history of the printing press", "how rivers shape valleys", "why the sky is blue",
           "the life cycle of a star", "how bread is made", "the rules of chess",
           "how vaccines train the immune system", "the water cycle", "how bridges carry loads",
           "the migration of birds", "how a compiler works", "the causes of the seasons"]


def synthetic_prompts(num: int, input_len: int, seed: int) -> list[str]:
    """Deterministic English prompts of roughly ``input_len`` words."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        topic = _TOPICS[i % len(_TOPICS)]
        words = [f"Write a short explanation of {topic}."]
        filler = []
        while len(" ".join(words + filler).split()) < input_len:
            a, b, c = rng.choice(_WORDS), rng.choice(_WORDS), rng.choice(_WORDS)
            filler.append(f"Mention the {a} and the {b} near the {c}.")
        out.append(" ".join(words + filler))
    return out


def random_prompts(num: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(max(1, input_len))) for _ in range(num)]


# ``--json-schema builtin``: 20 properties (the size the compile-time target is stated for).
# NOTE: no string maxLength: xgrammar compiles each bounded string for ~1 s (measured), which is
# a grammar-library cost, not a serving one.
BUILTIN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        **{f"name_{i}": {"type": "string"} for i in range(5)},
        **{f"count_{i}": {"type": "integer", "minimum": 0} for i in range(5)},
        **{f"flag_{i}": {"type": "boolean"} for i in range(5)},
        **{f"kind_{i}": {"enum": ["alpha", "beta", "gamma", "delta"]} for i in range(4)},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
}
BUILTIN_SCHEMA["required"] = list(BUILTIN_SCHEMA["properties"])


def load_json_schema(value: Optional[str]) -> Optional[dict[str, Any]]:
    """``--json-schema``: None, ``builtin``, a path to a JSON file, or inline JSON."""
    if value is None:
        return None
    if value == "builtin":
        return BUILTIN_SCHEMA
    import os
    text = open(value, encoding="utf-8").read() if os.path.isfile(value) else value
    schema = json.loads(text)
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema: expected a JSON object, got {type(schema).__name__}")
    return schema


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    finish_reason: Optional[str] = None
    constrained: bool = False


async def _one_request(client, url: str, payload: dict, headers: dict,
                       abort_after_first: bool = False) -> RequestResult:
    """One streamed request (completions or chat); ``abort_after_first`` closes the connection
    after the first content chunk (a client that goes away mid-stream)."""
    if not payload.get("stream", True):
        return await _one_plain_request(client, url, payload, headers)
    res = RequestResult()
    st = time.perf_counter()
    most_recent = st
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                res.error = f"HTTP {resp.status_code}: {body[:500]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    res.error = json.dumps(obj["error"])
                    return res
                now = time.perf_counter()
                if obj.get("choices"):
                    c0 = obj["choices"][0]
                    text = c0.get("text") or (c0.get("delta") or {}).get("content") or ""
                    res.finish_reason = c0.get("finish_reason") or res.finish_reason
                    if chunks == 0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - most_recent)
                    most_recent = now
                    chunks += 1
                    res.generated_text += text
                    if abort_after_first:
                        break
                usage = obj.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_len = int(usage.get("prompt_tokens") or 0)
        res.latency = most_recent - st
        if not res.output_tokens:
            res.output_tokens = chunks
        res.success = chunks > 0
        if not res.success:
            res.error = "no tokens received"
    except Exception as e:  # network errors etc.
        res.error = f"{e.__class__.__name__}: {e}"
    return res


async def _one_plain_request(client, url: str, payload: dict, headers: dict) -> RequestResult:
    """One non-streamed request: TTFT is the whole latency (the answer arrives at once)."""
    res = RequestResult()
    st = time.perf_counter()
    try:
        resp = await client.post(url, json=payload, headers=headers)
        res.latency = res.ttft = time.perf_counter() - st
        if resp.status_code != 200:
            res.error = f"HTTP {resp.status_code}: {resp.text[:500]!r}"
            return res
        body = resp.json()
        usage = body.get("usage") or {}
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.prompt_len = int(usage.get("prompt_tokens") or 0)
        c0 = (body.get("choices") or [{}])[0]
        res.generated_text = c0.get("text") or (c0.get("message") or {}).get("content") or ""
        res.success = True
    except Exception as e:  # network errors etc.
        res.error = f"{e.__class__.__name__}: {e}"
    return res


# The mixed soak workload: what a long-running server sees (issue 25).
MIXED_KINDS = ("chat", "completion", "long_prompt", "logprobs", "seeded", "chat_plain",
               "aborted_stream", "completion_plain")


def mixed_requests(num: int, seed: int, max_tokens: int,
                   long_prompt_chars: int = 5000) -> list[tuple[str, dict, bool]]:
    """``num`` requests cycling through ``MIXED_KINDS``: short streamed chats and completions, a
    prompt of ``long_prompt_chars`` characters (default 5,000: ~1,000 SmolLM2 tokens), top-5 logprobs,
    seeded sampling (temperature 0.8), non-streamed chats/completions, and streams the client abandons
    after the first chunk.

    Returns:
        ``[(endpoint, payload without "model", abort_after_first), ...]``, deterministic in
        ``seed``.
    """
    rng = random.Random(seed)
    out = []
    for i in range(num):
        kind = MIXED_KINDS[i % len(MIXED_KINDS)]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
        n_tok = max(1, rng.randint(max_tokens // 2, max_tokens))
        chat = {"messages": [{"role": "user", "content": f"Say something about the {words}."}],
                "max_tokens": n_tok, "temperature": 0.0, "stream": True}
        comp = {"prompt": f"A few words about the {words}:", "max_tokens": n_tok, "temperature": 0.0,
                "stream": True}
        if kind == "chat":
            out.append(("/v1/chat/completions", chat, False))
        elif kind == "chat_plain":
            out.append(("/v1/chat/completions", dict(chat, stream=False, logprobs=True, top_logprobs=3), False))
        elif kind == "completion":
            out.append(("/v1/completions", comp, False))
        elif kind == "completion_plain":
            out.append(("/v1/completions", dict(comp, stream=False, n=2), False))
        elif kind == "long_prompt":
            text = " ".join(rng.choice(_WORDS) for _ in range(max(1, -(-900 * long_prompt_chars // 5000))))[:long_prompt_chars]
            out.append(("/v1/completions", dict(comp, prompt=text + "\nSummary:"), False))
        elif kind == "logprobs":
            out.append(("/v1/completions", dict(comp, logprobs=5, echo=False), False))
        elif kind == "seeded":
            out.append(("/v1/completions", dict(comp, temperature=0.8, top_p=0.9, seed=rng.randint(0, 2**31)),
                        False))
        else:  # aborted_stream
            out.append(("/v1/completions", dict(comp, max_tokens=max(n_tok, 16)), True))
    return out


async def _resident_memory(client, base: str, headers: dict) -> tuple[Optional[int], Optional[int]]:
    """The server's ``process_resident_memory_bytes`` and committed KV cache bytes (the gauge
    ``*:kv_cache_committed_bytes``, any prefix) from /metrics; None for a figure it lacks."""
    rss = kv = None
    try:
        r = await client.get(base + "/metrics", headers=headers)
        for line in r.text.splitlines():
            if line.startswith("process_resident_memory_bytes "):
                rss = int(float(line.split()[1]))
            elif line.startswith(("pagedllm:kv_cache_committed_bytes", "vllm:kv_cache_committed_bytes")):
                kv = int(float(line.split()[-1]))
    except Exception:  # a server without /metrics: no memory figures
        pass
    return rss, kv


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    f, c = math.floor(k), math.ceil(k)
    return s[f] if f == c else s[f] + (s[c] - s[f]) * (k - f)


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs):
    if not xs:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2es = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        ms = [x * 1000 for x in xs]
        m[f"mean_{name}_ms"] = _mean(ms)
        m[f"median_{name}_ms"] = _pct(ms, 50)
        m[f"std_{name}_ms"] = _std(ms)
        m[f"p99_{name}_ms"] = _pct(ms, 99)
    m["input_lens"] = [r.prompt_len for r in results]
    m["output_lens"] = [r.output_tokens for r in results]
    m["ttfts"] = [r.ttft for r in results]
    m["itls"] = [r.itl for r in results]
    m["errors"] = [r.error for r in results]
    constrained = [r for r in ok if r.constrained]
    if constrained:
        m["structured_outputs"] = len(constrained)
        m["structured_outputs_stopped"] = sum(r.finish_reason == "stop" for r in constrained)
    return m


def count_valid_json(results: list[RequestResult], schema: dict[str, Any]) -> int:
    """Constrained outputs that finished ("stop") and validate against ``schema``."""
    import jsonschema

    n = 0
    for r in results:
        if r.success and r.constrained and r.finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(r.generated_text), schema)
            except (ValueError, jsonschema.ValidationError):
                continue
            n += 1
    return n


def format_results(m: dict[str, Any], max_concurrency: Optional[int], request_rate: float) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    row = lambda k, v: lines.append("{:<40} {:<10}".format(k, v))  # noqa: E731
    rowf = lambda k, v: lines.append("{:<40} {:<10.2f}".format(k, v))  # noqa: E731
    row("Successful requests:", m["completed"])
    if m["failed"]:
        row("Failed requests:", m["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        rowf("Request rate configured (RPS):", request_rate)
    rowf("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    rowf("Request throughput (req/s):", m["request_throughput"])
    rowf("Output token throughput (tok/s):", m["output_throughput"])
    rowf("Total Token throughput (tok/s):", m["total_token_throughput"])
    if "structured_outputs" in m:
        row("Structured-output requests:", m["structured_outputs"])
        row("  finished by the grammar (stop):", m["structured_outputs_stopped"])
        if "structured_outputs_valid" in m:
            row("  of those valid (jsonschema):", m["structured_outputs_valid"])
    for key, title, header in (("ttft", "TTFT", "Time to First Token"),
                               ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                               ("itl", "ITL", "Inter-token Latency")):
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        rowf(f"Mean {title} (ms):", m[f"mean_{key}_ms"])
        rowf(f"Median {title} (ms):", m[f"median_{key}_ms"])
        rowf(f"P99 {title} (ms):", m[f"p99_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default=None,
                        help="Server base URL, e.g. http://127.0.0.1:8000 (overrides --host/--port).")
    parser.add_argument("--host", default="127.0.0.1", help="Server host (default: 127.0.0.1).")
    parser.add_argument("--port", type=int, default=8000, help="Server port (default: 8000).")
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="API path (default: /v1/completions). A path ending in chat/completions sends each "
                             "prompt as one user message.")
    parser.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"],
                        help="vLLM's request format names: 'openai' / 'vllm' send completions, 'openai-chat' "
                             "chat messages (to /v1/chat/completions unless --endpoint names another path).")
    parser.add_argument("--model", default=None,
                        help="Model name to send (default: the first one /v1/models lists).")
    parser.add_argument("--api-key", default=None, help="Bearer token, if the server needs one.")
    parser.add_argument("--dataset-name", default="synthetic", choices=["synthetic", "random", "mixed"],
                        help="'synthetic': deterministic English prompts; 'random': random words; "
                             "'mixed': a soak mix of chats and completions, streamed and not, "
                             "~5,000-character prompts, logprobs, seeded sampling and streams the "
                             "client abandons (the endpoint flag is ignored).")
    from pagedllm.entrypoints.openai.cli_args import _positive_int

    parser.add_argument("--mixed-long-prompt-chars", type=_positive_int, default=5000,
                        help="Characters of the 'mixed' dataset's long prompt, one request in 8 (default: %(default)s).")
    parser.add_argument("--memory-samples", type=int, default=0,
                        help="Read the server's resident memory (/metrics "
                             "process_resident_memory_bytes) once after --warmup-requests and then "
                             "this many times more, evenly through the rest of the run; reports "
                             "the growth after warm-up.")
    parser.add_argument("--warmup-requests", type=int, default=0,
                        help="Requests sent (and finished) before the first memory sample.")
    parser.add_argument("--num-prompts", type=int, default=100,
                        help="Number of requests to send (default: 100).")
    parser.add_argument("--input-len", "--random-input-len", dest="input_len", type=int,
                        default=64, help="Approximate prompt length in words (default: 64).")
    parser.add_argument("--max-tokens", "--output-len", "--random-output-len", dest="max_tokens",
                        type=int, default=64, help="max_tokens per request (default: 64).")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="Send ignore_eos so every request generates max_tokens tokens.")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="Sampling temperature (default: 0, greedy).")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Requests per second (Poisson arrivals); inf = all at once "
                             "(default).")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of inter-arrival times (1 = Poisson).")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="Max requests in flight (default: unlimited).")
    parser.add_argument("--seed", type=int, default=0, help="Workload seed (default: 0).")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="Per-request timeout in seconds (default: 600).")
    parser.add_argument("--json-output", action="store_true",
                        help="Print the result as JSON instead of the table.")
    parser.add_argument("--result-file", default=None,
                        help="Also write the full result (incl. per-request data) as JSON here.")
    parser.add_argument("--json-schema", default=None,
                        help="Constrain requests to this JSON schema (structured outputs): 'builtin' "
                             "(20 properties), a path to a JSON file, or inline JSON.")
    parser.add_argument("--structured-output-ratio", type=float, default=1.0,
                        help="With --json-schema: the share of requests that carry it (default: 1).")
    parser.add_argument("--disable-tqdm", action="store_true", help="(accepted for vLLM compat)")
    return parser


async def _resolve_model(client, base: str, headers: dict) -> str:
    r = await client.get(base + "/v1/models", headers=headers)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.dataset_name == "mixed":
        work = mixed_requests(args.num_prompts, args.seed, args.max_tokens,
                              getattr(args, "mixed_long_prompt_chars", 5000))
    else:
        make = synthetic_prompts if args.dataset_name == "synthetic" else random_prompts
        endpoint = args.endpoint
        chat = getattr(args, "backend", None) == "openai-chat" or endpoint.rstrip("/").endswith("chat/completions")
        if chat and getattr(args, "backend", None) == "openai-chat" and endpoint == "/v1/completions":
            endpoint = "/v1/chat/completions"
        # /v1/chat/completions takes each prompt as one user message (vLLM's openai-chat backend)
        work = [(endpoint, {**({"messages": [{"role": "user", "content": p}]} if chat else {"prompt": p}),
                            "max_tokens": args.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}, False)
                for p in make(args.num_prompts, args.input_len, args.seed)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    transport = getattr(args, "transport", None)  # tests: an httpx.ASGITransport
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits,
                                 transport=transport) as client:
        model = args.model or await _resolve_model(client, base, headers)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed)

        schema = load_json_schema(getattr(args, "json_schema", None))
        ratio = getattr(args, "structured_output_ratio", 1.0)
        # Which requests carry the schema: evenly spread, ratio of them.
        constrained = [schema is not None and int((i + 1) * ratio) > int(i * ratio)
                       for i in range(len(work))]

        async def run(item: tuple[str, dict, bool], constrain: bool) -> RequestResult:
            endpoint, body, abort_first = item
            payload = dict(body, model=model)
            if payload.get("stream"):
                payload["stream_options"] = {"include_usage": True}
            if args.ignore_eos:
                payload["ignore_eos"] = True
            if constrain:
                payload["structured_outputs"] = {"json": schema}
            if sem is None:
                res = await _one_request(client, base + endpoint, payload, headers, abort_first)
            else:
                async with sem:
                    res = await _one_request(client, base + endpoint, payload, headers, abort_first)
            res.constrained = constrain
            return res

        async def send(lo: int, hi: int) -> list[RequestResult]:
            tasks = []
            for i in range(lo, hi):
                tasks.append(asyncio.ensure_future(run(work[i], constrained[i])))
                if args.request_rate != float("inf") and args.request_rate > 0:
                    theta = 1.0 / (args.request_rate * args.burstiness)
                    await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
            return list(await asyncio.gather(*tasks))

        # NOTE: with memory samples the run goes in consecutive slices, each finished before its
        # sample, so a reading is never taken with requests half-done.
        warm = min(max(0, getattr(args, "warmup_requests", 0)), len(work))
        n_samples = max(0, getattr(args, "memory_samples", 0))
        cuts = [warm] if warm else []
        if n_samples:
            rest = len(work) - warm
            cuts = sorted(set(cuts + [warm + rest * (k + 1) // n_samples for k in range(n_samples)]))
        start = time.perf_counter()
        results: list[RequestResult] = []
        memory: list[tuple[int, Optional[int], Optional[int]]] = []
        prev = 0
        for cut in cuts + ([len(work)] if not cuts or cuts[-1] != len(work) else []):
            results += await send(prev, cut)
            prev = cut
            if n_samples and cut >= warm:
                memory.append((cut, *await _resident_memory(client, base, headers)))
        duration = time.perf_counter() - start
    m = compute_metrics(list(results), duration)
    if memory:
        m["memory_samples"] = [{"requests_done": k, "resident_memory_bytes": v,
                                **({"kv_cache_committed_bytes": kv} if kv is not None else {})}
                               for k, v, kv in memory]
        first, last = memory[0][1], memory[-1][1]
        if first and last:
            m["resident_memory_after_warmup_bytes"] = first
            m["resident_memory_end_bytes"] = last
            m["resident_memory_growth_ratio"] = last / first - 1.0
    if schema is not None and m.get("structured_outputs"):
        try:
            m["structured_outputs_valid"] = count_valid_json(list(results), schema)
        except ImportError:  # jsonschema is a dev dependency
            pass
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    m.update(model_id=model, num_prompts=args.num_prompts, request_rate=rate,
             max_concurrency=args.max_concurrency, burstiness=args.burstiness,
             max_tokens=args.max_tokens, input_len=args.input_len)
    return m


def run_bench_serve(args: argparse.Namespace) -> int:
    m = asyncio.run(benchmark(args))
    summary = {k: v for k, v in m.items() if k not in ("input_lens", "output_lens", "ttfts",
                                                        "itls", "errors", "memory_samples")}
    if args.json_output:
        print(json.dumps(summary, indent=2, allow_nan=False, default=str))
    else:
        print(format_results(m, args.max_concurrency, float(args.request_rate)))
        if "resident_memory_end_bytes" in m:
            print(f"Server resident memory after warm-up: {m['resident_memory_after_warmup_bytes'] / 2**20:.1f} MiB, "
                  f"at the end: {m['resident_memory_end_bytes'] / 2**20:.1f} MiB "
                  f"({m['resident_memory_growth_ratio'] * 100:+.2f}%)")
        errs = [e for e in m["errors"] if e]
        if errs:
            print(f"First error: {errs[0]}")
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(m, f, indent=2, default=str)
    return 0 if m["completed"] > 0 else 1
