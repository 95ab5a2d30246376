"""``pagedllm`` command line: serve, bench, complete, chat (vLLM's flag names)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from pagedllm.config import QUANTIZATION_CHOICES


def _add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    from pagedllm.entrypoints import bench

    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, hardware")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    bench.add_throughput_parser(bsub)
    bench.add_latency_parser(bsub)
    bench.add_prefix_parser(bsub)
    bench.add_embed_parser(bsub)
    bench.add_hardware_parser(bsub)
    sp = bsub.add_parser("serve", help="load-test a running server (request rate / max concurrency)")
    from pagedllm.entrypoints.bench_serve import add_bench_serve_args
    add_bench_serve_args(sp)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="pagedllm: paged-KV-cache LLM serving with vLLM's API")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="cmd")
    sp = sub.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API")
    from pagedllm.entrypoints.openai.cli_args import add_serve_args
    add_serve_args(sp)
    cp = sub.add_parser("complete", help="one completion from the command line")
    cp.add_argument("model", nargs="?", default="SmolLM2-135M-Instruct")
    cp.add_argument("--prompt", required=True)
    cp.add_argument("--max-tokens", type=int, default=64)
    cp.add_argument("--temperature", type=float, default=0.0)
    cp.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    cp.add_argument("--dtype", default="auto")
    cp.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_CHOICES))
    cp.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"])
    cp.add_argument("--num-threads", type=int, default=None)
    _add_bench_parsers(sub)
    return parser


def _complete(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sp, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, sp, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from pagedllm import __version__
        print(__version__)
        return 0
    if args.cmd == "serve":
        from pagedllm.entrypoints.openai.api_server import run_server
        return run_server(args) or 0
    if args.cmd == "complete":
        return _complete(args)
    if args.cmd == "bench":
        if args.bench_cmd == "serve":
            from pagedllm.entrypoints.bench_serve import run_bench_serve
            return run_bench_serve(args) or 0
        from pagedllm.entrypoints import bench
        return bench.run(args) or 0
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
