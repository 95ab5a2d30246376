"""``pagedllm serve`` flags (vLLM's names)."""
from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any, Optional

from pagedllm.config import parse_bytes as config_parse_bytes

logger = logging.getLogger("pagedllm.entrypoints.openai")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class _DefaultModel(str):
    """The positional model's default: a str equal to DEFAULT_MODEL that tells "not given"
    apart from an explicit ``pagedllm serve SmolLM2-135M-Instruct`` (see ``resolve_model_arg``)."""


def parse_bytes(value: str) -> int:
    """'2GiB' / '512MiB' / '1.5G' / '1073741824' -> bytes, for argparse (``config.parse_bytes``)."""
    try:
        return config_parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def _json_dict(value: str) -> dict[str, Any]:
    try:
        d = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return d


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``pagedllm serve`` flag to ``parser`` and return it."""
    parser.add_argument(
        "model", nargs="?", default=_DefaultModel(DEFAULT_MODEL),
        help="Model to serve: a GGUF file, a Hugging Face checkpoint directory, or a known name "
             f"(default: {DEFAULT_MODEL}). May also be given as --model (vLLM accepts both).")
    parser.add_argument(
        "--model", dest="model_option", default=None, metavar="MODEL",
        help="The model, as an option (vLLM's EngineArgs flag); the positional argument wins when "
             "both are given.")

    g = parser.add_argument_group("Server")
    g.add_argument("--host", default="127.0.0.1",
                   help="Address to listen on (default: 127.0.0.1; use 0.0.0.0 for all "
                        "interfaces).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) the API reports and accepts in the `model` field "
                        "(default: the model argument). The first one is used in responses.")
    g.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                   help="Require `Authorization: Bearer <key>` on /v1 routes (default: the "
                        "PAGEDLLM_API_KEY environment variable; unset = no auth).")
    g.add_argument("--chat-template", default=None,
                   help="Chat template to use instead of the model's: a path to a Jinja file "
                        "or the template itself.")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: info).")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="Do not log each received request.")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="Do not log throughput / scheduler statistics every 5 seconds.")
    g.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=True,
                   help="Send an X-Request-Id header with every response: the client's own, else the "
                        "id the server gave the request (default: on; vLLM's flag, off there by "
                        "default).")
    g.add_argument("--metrics-prefix", default="pagedllm", choices=["pagedllm", "vllm"],
                   help="Name prefix of the Prometheus metrics on /metrics: 'pagedllm:' (default) or "
                        "'vllm:' (vLLM's names, with vLLM's deprecated aliases such as "
                        "vllm:gpu_cache_usage_perc, so vLLM's Grafana dashboard works unchanged).")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="Max number of logprobs a request may ask for (`logprobs`, "
                        "`top_logprobs`, `prompt_logprobs`; default: 20).")

    g = parser.add_argument_group("Model")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16",
                                                       "half", "float", "bf16", "fp32", "fp16"],
                   help="Weight and activation dtype. auto = bfloat16 on CPUs with native bf16 "
                        "matmul (float16/bfloat16 on CUDA), else float32.")
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="Max tokens per request (prompt + output). Default: the model's context "
                        "length, capped by what the KV cache can hold.")
    g.add_argument("--generation-config", default="auto",
                   help="'auto': the model's generation config supplies default sampling values "
                        "(temperature, top_p, ...); 'vllm': ignore it; or a directory holding a "
                        "generation_config.json.")
    g.add_argument("--seed", type=int, default=0,
                   help="Global seed for requests without their own `seed` (default: 0).")
    g.add_argument("--runner", default="generate", choices=["generate", "pooling"],
                   help="'generate' (text generation) or 'pooling' (embeddings / classification).")
    g.add_argument("--convert", default=None, choices=["embed", "classify"],
                   help="With --runner pooling: adapt the model for 'embed' or 'classify'.")
    g.add_argument("--tokenizer", default=None,
                   help="Tokenizer to use instead of the model's own: a Hugging Face directory, or a "
                        "GGUF file whose tokenizer to take.")
    g.add_argument("--hf-overrides", type=_json_dict, default=None,
                   help='JSON merged into the model\'s Hugging Face config before it is built, e.g. '
                        '\'{"is_matryoshka": true}\' (vLLM\'s flag).')
    g.add_argument("--pooler-config", type=_json_dict, default=None,
                   help='Pooler settings as JSON, e.g. \'{"pooling_type": "LAST", '
                        '"use_activation": false}\' (use_activation: the output activation of every '
                        'pooling task, i.e. the L2 normalisation of embeddings and the softmax of '
                        'classifiers; "normalize", "softmax" and "activation" are deprecated aliases).')
    g.add_argument("--quantization", "-q", default=None, choices=["int8", "int4", "w8a8"],
                   help="Quantization of the linear layers and LM head (CPU): weight-only int8 "
                        "per-channel or int4 group-wise (group 32), or w8a8 (int8 per-channel "
                        "weights and dynamic per-token int8 activations, int8 GEMMs: faster at "
                        "every batch size).")
    g.add_argument("--ignore-patterns", nargs="*", default=[],
                   help="fnmatch patterns of checkpoint files not to load.")

    g = parser.add_argument_group("Structured outputs")
    g.add_argument("--structured-outputs-config", type=_json_dict, default=None,
                   help='Structured-output settings as JSON (vLLM\'s flag), e.g. \'{"backend": "auto"}\': '
                        'backend auto (xgrammar, llguidance for what it cannot compile) | xgrammar | '
                        'guidance; disable_fallback, disable_any_whitespace, '
                        'disable_additional_properties (booleans); grammar_cache_size (compiled '
                        'grammars kept, default 256); compile_threads (default 2).')

    g = parser.add_argument_group("Speculative decoding")
    g.add_argument("--speculative-config", type=_json_dict, default=None,
                   help='Speculative decoding as JSON (vLLM\'s flag), e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\': method ngram | suffix '
                        '| draft_model (with "model", optionally "quantization": "int4" for a '
                        'self-draft); disable_by_batch_size (no drafts in steps with at least that '
                        'many requests; default: measured automatic threshold, 0 = never).')

    g = parser.add_argument_group("Scheduler and KV cache")
    g.add_argument("--max-num-seqs", type=_positive_int, default=128,
                   help="Max requests scheduled in one step (default: 128).")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="Max tokens processed in one step; longer prompts are prefilled in "
                        "chunks (default: 2048).")
    g.add_argument("--block-size", type=_positive_int, default=16,
                   help="Tokens per KV cache block (default: 16).")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache budget in bytes; accepts suffixes like 2GiB, 512MiB, 1.5G "
                        "(default: 2GiB on CPU).")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache storage: auto (the model dtype) or 8-bit floats (fp8 = fp8_e4m3, "
                        "or fp8_e5m2): half the bytes per token of bf16 (CPU only).")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="Reuse the KV cache of shared prompt prefixes (default: on).")
    g.add_argument("--prefix-caching-hash-algo", default="sha256", choices=["sha256", "xxhash"],
                   help="Hash of prefix-cache blocks (default: sha256).")

    g = parser.add_argument_group("Parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="Ranks each layer is split across (attention heads, MLP, vocabulary; default: 1).")
    g.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1,
                   help="Pipeline stages the layers are split across (default: 1).")
    g.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                   help="Independent engine replicas behind this server; requests go to the least "
                        "loaded one (default: 1).")
    g.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="How ranks run: 'uni' (in this process; one rank only), 'mp' (a process per "
                        "rank) or 'ray' (a Ray actor per rank; multi-node). Default: uni for one "
                        "rank, else mp.")

    g = parser.add_argument_group("Device")
    g.add_argument("--allowed-origins", type=json.loads, default=["*"],
                   help='CORS allowed origins as a JSON list (vLLM default: ["*"]).')
    g.add_argument("--allowed-methods", type=json.loads, default=["*"],
                   help="CORS allowed methods as a JSON list.")
    g.add_argument("--allowed-headers", type=json.loads, default=["*"],
                   help="CORS allowed headers as a JSON list.")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    g.add_argument("--attention-backend", default=None, choices=["torch", "triton", "flashinfer"],
                   help="Attention backend (default: torch on CPU, triton on CUDA; also "
                        "PAGEDLLM_ATTENTION_BACKEND).")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA only: fraction of GPU memory for weights, activations and the KV cache "
                        "when --kv-cache-memory is not given (default 0.9).")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="Device to run on (default: auto = cuda if available, else cpu).")
    g.add_argument("--num-threads", type=_positive_int, default=None,
                   help="torch intra-op threads for the engine (default: PAGEDLLM_NUM_THREADS or OMP_NUM_THREADS if set, else all cores; on a host shared with other CPU-busy processes use fewer: an OpenMP team that loses a core slows sharply).")
    g.add_argument("--enforce-eager", action="store_true",
                   help="Never use CUDA graphs.")
    return parser


def make_arg_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    if parser is None:
        parser = argparse.ArgumentParser(prog="pagedllm serve",
                                         description="Serve a model with an OpenAI-compatible API.")
    return add_serve_args(parser)


_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                  "bf16": "bfloat16"}


def resolve_model_arg(args: argparse.Namespace) -> argparse.Namespace:
    """Fold ``--model`` into ``args.model``: the positional model wins when both are given (as
    ``vllm serve``; a warning names both), ``--model`` is used when the positional is absent."""
    opt = getattr(args, "model_option", None)
    pos = getattr(args, "model", None)
    if opt is not None:
        if pos is None or isinstance(pos, _DefaultModel):
            args.model = opt
        elif pos != opt:
            logger.warning("Both a positional model %r and --model %r were given; serving %r.", pos, opt, pos)
        args.model_option = None
    if isinstance(getattr(args, "model", None), str):
        args.model = str(args.model)
    return args


def normalize_args(args: argparse.Namespace) -> argparse.Namespace:
    """Canonical values after parsing: ``--model`` folded into ``model``, dtype aliases."""
    resolve_model_arg(args)
    if getattr(args, "dtype", None) in _DTYPE_ALIASES:
        args.dtype = _DTYPE_ALIASES[args.dtype]
    return args
