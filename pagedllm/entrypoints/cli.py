"""``pagedllm`` command line: serve, chat, complete, run, run-batch, bench, router (vLLM's names and flags).

A user mistake is one line on stderr, ``pagedllm <cmd>: error: ...``, and exit status 2
(``cli_utils.FlexibleArgumentParser``); ``pagedllm serve --help=<group or keyword>`` shows part
of the help (``--help=listgroup`` lists the groups).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any, Callable, Optional

from pagedllm.config import QUANTIZATION_CHOICES
from pagedllm.entrypoints.cli_utils import FlexibleArgumentParser, fail, show_filtered_help

logger = logging.getLogger("pagedllm")


def _add_subcommand(sub: argparse._SubParsersAction, subparsers: dict, name: str, help: str, description: str,
                    *add_args: Callable[[argparse.ArgumentParser], Any]) -> argparse.ArgumentParser:
    """``pagedllm NAME``: a subparser, recorded in ``subparsers`` under ``name``, with the flags each
    of ``add_args`` adds (in order)."""
    p = sub.add_parser(name, help=help, description=description)
    subparsers[name] = p
    for add in add_args:
        add(p)
    return p


def _add_bench_parsers(sub: argparse._SubParsersAction, subparsers: dict) -> None:
    from pagedllm.entrypoints import bench

    p = _add_subcommand(sub, subparsers, "bench",
                        "benchmarks: throughput, latency, prefix-caching, embed, hardware, serve",
                        "Benchmarks (vLLM's `vllm bench` names).")
    bsub = p.add_subparsers(dest="bench_cmd", required=True, metavar="{throughput,latency,prefix-caching,image,"
                                                                       "embed,hardware,serve}")
    for add in (bench.add_throughput_parser, bench.add_latency_parser, bench.add_prefix_parser,
                bench.add_embed_parser, bench.add_hardware_parser):
        add(bsub)
    from pagedllm.multimodal.bench import add_image_parser
    add_image_parser(bsub)
    sp = bsub.add_parser("serve", help="load-test a running server (request rate / max concurrency)",
                         description="Load-test a running server (vLLM's `vllm bench serve`).")
    from pagedllm.entrypoints.bench_serve import add_bench_serve_args
    add_bench_serve_args(sp)
    for name, action in bsub.choices.items():
        subparsers[f"bench {name}"] = action


def _add_complete_parser(sub: argparse._SubParsersAction, subparsers: dict) -> None:
    from pagedllm.entrypoints.chat_client import add_client_args

    cp = _add_subcommand(
        sub, subparsers, "complete", "text completions from a running server (or in-process with --offline)",
        "Send prompts to a running server's /v1/completions and stream the completions "
        "(vLLM's `vllm complete`): -q PROMPT for one, else one prompt per stdin line until "
        "EOF or 'exit'. --offline loads the model in this process instead (no server).",
        lambda p: add_client_args(p, chat=False))
    g = cp.add_argument_group("Offline (--offline: no server, the model loads in this process)")
    g.add_argument("--offline", action="store_true",
                   help="Load the model here with LLM() instead of talking to a server (default: off).")
    g.add_argument("offline_model", nargs="?", default=None, metavar="MODEL",
                   help="With --offline: the model (as `pagedllm serve`; --model works too; "
                        "default: SmolLM2-135M-Instruct).")
    g.add_argument("--chat", action="store_true",
                   help="With --offline: wrap each prompt as a user chat message (default: off).")
    g.add_argument("--dtype", default="auto", help="With --offline: weight/activation dtype (default: auto).")
    g.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="With --offline: as `pagedllm serve --quantization` (default: the checkpoint's own).")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="With --offline: KV cache storage (default: auto).")
    g.add_argument("--num-threads", type=int, default=None,
                   help="With --offline: torch threads (default: all cores).")


def _add_simulate_parsers(sub: argparse._SubParsersAction, subparsers: dict) -> None:
    from pagedllm.sim import cli as sim_cli

    _add_subcommand(sub, subparsers, "simulate",
                    "simulate a fleet of replicas (the real scheduler, a fitted step time)",
                    "Simulate N replicas behind a router policy: the real scheduler and block "
                    "pool per replica, in simulated time, with a step-time model fitted by "
                    "`pagedllm simulate fit`; `pagedllm simulate replay` measures a trace on a "
                    "running server (docs/scaling.md).", sim_cli.add_simulate_args)
    # NOTE: `simulate fit` / `simulate replay` are dispatched in main() (`simulate` itself takes flags).
    for name, add, desc in (
            ("fit", sim_cli.add_fit_args, "Time the real engine's steps over a grid of batch shapes and fit the "
                                          "simulator's step-time model (JSON)."),
            ("replay", sim_cli.add_replay_args, "Send a trace to a running server at its arrival times and "
                                                "measure throughput, TTFT, ITL, E2E.")):
        sp = FlexibleArgumentParser(prog=f"pagedllm simulate {name}", description=desc)
        add(sp)
        subparsers[f"simulate {name}"] = sp


# ``pagedllm NAME``, in the help's order: (one-line help, description, the flag adders as
# "module:function", imported when the parser is built), or a function adding a subcommand that
# has subcommands or flags of its own.
_SUBCOMMANDS: dict[str, Any] = {
    "serve": ("serve a model behind an OpenAI-compatible HTTP API",
              "Serve a model behind an OpenAI-compatible HTTP API (vLLM's `vllm serve` "
              "flags). --help=listgroup lists the flag groups, --help=<group> shows "
              "one, --help=<keyword> the flags whose name contains it.",
              ("pagedllm.entrypoints.openai.cli_args:add_serve_args",)),
    "chat": ("chat with a running server (interactive, or -q MESSAGE)",
             "Chat with a running server's /v1/chat/completions, streaming the answers "
             "(vLLM's `vllm chat`): -q MESSAGE for one turn, else one message per stdin "
             "line until EOF or 'exit', keeping the conversation.",
             ("pagedllm.entrypoints.chat_client:add_chat_args",)),
    "complete": _add_complete_parser,
    "run": ("start a local server for MODEL and chat with it (as `ollama run`)",
            "Start `pagedllm serve MODEL` on a free local port (every flag that is "
            "not listed here goes to serve), chat with it as `pagedllm chat` does, "
            "and stop it when the chat ends.",
            ("pagedllm.entrypoints.run_local:add_run_args",)),
    "run-batch": ("run an OpenAI batch file (.jsonl) through the model, no server",
                  "Run the requests of an OpenAI batch file (one {custom_id, method, url, body} "
                  "a line; /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/score) "
                  "through the server's handlers in this process, writing one result a line "
                  "(vLLM's `vllm run-batch`); an existing output file is resumed. The engine "
                  "flags are `pagedllm serve`'s.",
                  ("pagedllm.entrypoints.openai.run_batch:add_run_batch_args",
                   "pagedllm.entrypoints.openai.cli_args:add_serve_args")),
    "bench": _add_bench_parsers,
    "simulate": _add_simulate_parsers,
    "router": ("route requests over many running servers (prefix-cache aware)",
               "One OpenAI / Anthropic / Ollama-compatible endpoint over running "
               "`pagedllm serve` replicas: forwards requests and streams unchanged, "
               "routes by the prefix the replicas' KV events say they hold "
               "(--policy prefix), or by load, round-robin or session.",
               ("pagedllm.router.server:add_router_args",)),
    "disagg-proxy": ("route each request to a prefill instance, then a decode instance",
                     "Disaggregated prefill/decode (docs/kv_connector.md): each request is "
                     "prefilled by a P2pConnector kv_producer (max_tokens 1), then decoded by a "
                     "kv_consumer that loads the prompt's KV from it.",
                     ("pagedllm.entrypoints.disagg_proxy:add_disagg_proxy_args",)),
}


def _import_function(path: str) -> Callable[..., Any]:
    """``"package.module:name"`` -> that module's ``name``."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedllm`` parser; ``parser.subcommand_parsers`` maps "serve", "chat", "complete",
    "bench", "bench throughput", ... to their parsers."""
    parser = FlexibleArgumentParser(
        prog="pagedllm", description="pagedllm: paged-KV-cache LLM serving with vLLM's API")
    parser.add_argument("--version", action="store_true", help="Print the version and exit.")
    subparsers: dict[str, argparse.ArgumentParser] = {}
    sub = parser.add_subparsers(dest="cmd", metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    for name, entry in _SUBCOMMANDS.items():
        if callable(entry):
            entry(sub, subparsers)
        else:
            help_, description, adders = entry
            _add_subcommand(sub, subparsers, name, help_, description, *map(_import_function, adders))
    parser.subcommand_parsers = subparsers  # type: ignore[attr-defined]
    return parser


def _complete_offline(args: argparse.Namespace) -> int:
    """The old in-process ``pagedllm complete`` (``--offline``): LLM() + generate/chat."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.chat_client import _messages_from_stdin

    model = args.offline_model or args.model or "SmolLM2-135M-Instruct"
    llm = LLM(model, dtype=args.dtype, num_threads=args.num_threads, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    sp = SamplingParams(max_tokens=args.max_tokens if args.max_tokens is not None else 64,
                        temperature=args.temperature if args.temperature is not None else 0.0)
    prompts = [args.quick] if args.quick is not None else _messages_from_stdin("Please enter a prompt to complete:")
    for prompt in prompts:
        if args.chat:
            out = llm.chat([{"role": "user", "content": prompt}], sp, use_tqdm=False)
        else:
            out = llm.generate(prompt, sp, use_tqdm=False)
        print(out[0].outputs[0].text, flush=True)
    return 0


def _subcommand_of(parser: argparse.ArgumentParser, tokens: list[str]) -> argparse.ArgumentParser:
    """The (deepest) subcommand parser named by the leading words of ``tokens``."""
    subs = parser.subcommand_parsers  # type: ignore[attr-defined]
    words = [t for t in tokens if not t.startswith("-")]
    for n in (2, 1):
        name = " ".join(words[:n])
        if len(words) >= n and name in subs:
            return subs[name]
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``pagedllm`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    for i, tok in enumerate(argv):
        if tok == "--":
            break
        if tok.startswith("--help="):
            return show_filtered_help(_subcommand_of(parser, argv[:i]), tok.split("=", 1)[1])
    if argv and argv[0] == "run":
        from pagedllm.entrypoints.run_local import run_local, split_model
        model, rest = split_model(argv[1:])
        run_args, serve_args = parser.subcommand_parsers["run"].parse_known_args(rest)
        run_args.run_model = model
        # the server's flags are checked here, before anything starts: a mistake is one line, exit 2
        _, unknown = parser.subcommand_parsers["serve"].parse_known_args([model or "m", *serve_args])
        if unknown:
            return fail("pagedllm run", f"unrecognized arguments: {' '.join(unknown)} (see 'pagedllm run --help' "
                        "and 'pagedllm serve --help')")
        return run_local(run_args, serve_args)
    if len(argv) > 1 and argv[0] == "simulate" and argv[1] in ("fit", "replay"):
        return _simulate_sub(parser.subcommand_parsers[f"simulate {argv[1]}"], argv[1], argv[2:])
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand's parser: "pagedllm serve: error: unrecognized arguments"
        cmd = " ".join(x for x in (args.cmd, getattr(args, "bench_cmd", None)) if x)
        parser.subcommand_parsers.get(cmd, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.version:
        from pagedllm import __version__
        print(__version__)
        return 0
    if args.cmd == "serve":
        from pagedllm.entrypoints.openai.preflight import prepare_serve

        try:  # NOTE: before the server module (torch, the engine) is imported: mistakes show at once
            sock = prepare_serve(args)
        except ValueError as e:
            return fail("pagedllm serve", str(e))
        from pagedllm.entrypoints.openai.api_server import run_server
        return run_server(args, sock) or 0
    if args.cmd == "router":
        from pagedllm.router.server import build_router, run_router
        try:  # flags, URLs, replicas and tokenizer checked before serving: one line, exit 2
            ra = build_router(args)
        except ValueError as e:
            return fail("pagedllm router", str(e))
        return run_router(args, ra)
    if args.cmd == "disagg-proxy":
        from pagedllm.entrypoints.disagg_proxy import build_disagg_proxy, run_disagg_proxy
        try:
            build_disagg_proxy(args)
        except ValueError as e:
            return fail("pagedllm disagg-proxy", str(e))
        return run_disagg_proxy(args)
    if args.cmd == "run-batch":
        from pagedllm.entrypoints.openai.run_batch import run_batch_main
        return run_batch_main(args)
    if args.cmd in ("chat", "complete"):
        if args.cmd == "complete" and args.offline:
            return _run_user_errors_one_line("pagedllm complete", _complete_offline, args)
        if getattr(args, "offline_model", None):
            parser.subcommand_parsers["complete"].error(
                f"unrecognized arguments: {args.offline_model} (a model is --model NAME; a positional "
                "model needs --offline)")
        from pagedllm.entrypoints.chat_client import run_client
        return run_client(args, chat=args.cmd == "chat")
    if args.cmd == "bench":
        if args.bench_cmd == "serve":
            import httpx

            from pagedllm.entrypoints.bench_serve import run_bench_serve
            try:
                return run_bench_serve(args) or 0
            except (httpx.HTTPError, OSError) as e:  # no server there, or it refused /v1/models
                base = args.base_url or f"http://{args.host}:{args.port}"
                return fail("pagedllm bench serve", f"cannot reach the server at {base} ({e}); start one with "
                            "'pagedllm serve' or pass --base-url / --host / --port", status=1)
        from pagedllm.entrypoints import bench
        return _run_user_errors_one_line(f"pagedllm bench {args.bench_cmd}", bench.run, args)
    if args.cmd == "simulate":
        from pagedllm.sim.cli import run_simulate
        return _run_user_errors_one_line("pagedllm simulate", run_simulate, args)
    parser.print_help()  # no subcommand: the help, exit 0 (as `vllm` and `ollama` with no arguments)
    return 0


def _simulate_sub(p: argparse.ArgumentParser, name: str, argv: list[str]) -> int:
    """``pagedllm simulate fit|replay``."""
    from pagedllm.sim import cli as sim_cli

    args = p.parse_args(argv)
    if name == "fit":
        return _run_user_errors_one_line("pagedllm simulate fit", sim_cli.run_fit, args)
    import httpx
    try:
        return _run_user_errors_one_line("pagedllm simulate replay", sim_cli.run_replay, args)
    except (httpx.HTTPError, OSError) as e:
        return fail("pagedllm simulate replay", f"cannot reach the server at {args.base_url} ({e})", status=1)


def _run_user_errors_one_line(prog: str, fn, args: argparse.Namespace) -> int:
    """``fn(args)``; a ValueError (a wrong model, a bad option value: what the engine rejects
    before it runs) is one line ``<prog>: error: ...`` and status 2 (its traceback at DEBUG)."""
    try:
        return fn(args) or 0
    except ValueError as e:
        logger.debug("%s failed", prog, exc_info=True)
        return fail(prog, str(e))


if __name__ == "__main__":
    sys.exit(main())
