"""``pagedllm serve`` flags (vLLM's names)."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional

from pagedllm.config import QUANTIZATION_CHOICES
from pagedllm.config import parse_bytes as config_parse_bytes

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

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
        "model", nargs="?", default=DEFAULT_MODEL,
        help="Model to serve: a GGUF file, a Hugging Face checkpoint directory, or a known name "
             f"(default: {DEFAULT_MODEL}).")

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
    g.add_argument("--pooler-config", type=_json_dict, default=None,
                   help='Pooler settings as JSON, e.g. \'{"pooling_type": "MEAN", '
                        '"normalize": true}\'.')
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_CHOICES),
                   help="Default: a quantized checkpoint (GGUF blocks, GPTQ, AWQ, compressed-tensors, "
                        "FP8) runs in its own format. int8/int4/w8a8 re-quantize float weights after "
                        "loading (CPU): weight-only int8 per-channel or int4 group-wise (group 32), or "
                        "w8a8 (int8 per-channel weights and dynamic per-token int8 activations). "
                        "'none' dequantizes a quantized checkpoint at load.")
    g.add_argument("--ignore-patterns", nargs="*", default=[],
                   help="fnmatch patterns of checkpoint files not to load.")

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


def normalize_args(args: argparse.Namespace) -> argparse.Namespace:
    """Canonical values (dtype aliases) after parsing."""
    if getattr(args, "dtype", None) in _DTYPE_ALIASES:
        args.dtype = _DTYPE_ALIASES[args.dtype]
    return args
