"""``pagedllm serve`` flags (vLLM's names)."""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pagedllm.config import QUANTIZATION_CHOICES
from pagedllm.config import parse_bytes as config_parse_bytes
from pagedllm.entrypoints.cli_utils import FlexibleArgumentParser, port_number, positive_human_int, positive_int
from pagedllm import envs

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


_positive_int = positive_int  # (cli_utils)


def _json_arg(kind: type, expected: str) -> Callable[[str], Any]:
    """An argparse ``type`` parsing a JSON ``kind`` (list / dict); a bad value is one line:
    "invalid JSON 'x': ..." or "expected {expected}, got 'x'"."""
    def parse(value: str) -> Any:
        try:
            v = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {e}") from None
        if not isinstance(v, kind):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
        return v
    return parse


_json_list = _json_arg(list, "a JSON list such as '[\"*\"]'")
_json_dict = _json_arg(dict, "a JSON object")


def _max_model_len(value: str) -> Optional[int]:
    """``--max-model-len``: a positive integer, or "auto" / -1 (None: fit to the KV cache)."""
    if value.strip().lower() == "auto" or value.strip() == "-1":
        return None
    return positive_human_int(value)


def _size_or_zero(value: str) -> int:
    """``--kv-prefix-cache-memory``: a size like ``parse_bytes``, or 0."""
    if value.strip() in ("0", "0B", "0b"):
        return 0
    return parse_bytes(value)


def positive_float(value: str) -> float:
    """argparse type: a float > 0 (``ArgumentTypeError`` naming the value otherwise)."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return v


@dataclass
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: Optional[str] = None


def engine_flag(field: str, help: str, *aliases: str, **kwargs: Any) -> tuple[str, str, tuple[str, ...], dict]:
    """One ``EngineArgs`` field's flag for ``add_engine_args``: ``--field-name`` (plus ``aliases``
    such as ``-tp``), ``help`` (may say ``%(default)s``), other ``add_argument`` keywords."""
    return field, help, aliases, kwargs


def add_engine_args(group: Any, *flags: tuple[str, str, tuple[str, ...], dict]) -> None:
    """Add flags generated from ``EngineArgs`` dataclass fields (vLLM's ``EngineArgs.add_cli_args``
    shape): the flag's name is the field's with dashes, its destination the field, and its
    default the field's default, so the default is stated once, in ``pagedllm.config``.

    Raises:
        KeyError: a field ``EngineArgs`` does not have (a programming error).
    """
    import dataclasses

    from pagedllm.config import EngineArgs

    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    for field, help, aliases, kwargs in flags:
        group.add_argument("--" + field.replace("_", "-"), *aliases, default=defaults[field], help=help, **kwargs)


def parse_lora_module(value: str) -> LoRAModulePath:
    """``name=path`` or a JSON object ``{"name": ..., "path": ..., "base_model_name": ...}``
    (vLLM's ``--lora-modules`` forms), for argparse.

    Raises:
        argparse.ArgumentTypeError: neither form, or an empty name / path.
    """
    value = value.strip()
    if value.startswith("{"):
        try:
            d = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {value!r}: {e}") from None
        if not isinstance(d, dict) or not d.get("name") or not d.get("path"):
            raise argparse.ArgumentTypeError(f"--lora-modules: a JSON entry needs \"name\" and \"path\", got {value!r}")
        return LoRAModulePath(str(d["name"]), str(d["path"]), d.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path or a JSON object, got {value!r}")
    return LoRAModulePath(name, path)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``pagedllm serve`` flag to ``parser`` and return it."""
    parser.add_argument(
        "model", nargs="?", default=_DefaultModel(DEFAULT_MODEL),
        help="Model to serve: a Hugging Face Hub id (org/name, org/name:QUANT for a GGUF repo, "
             "org/name/file.gguf), a GGUF file, a Hugging Face checkpoint directory, or a known name "
             f"(default: {DEFAULT_MODEL}). May also be given as --model (vLLM accepts both).")
    parser.add_argument(
        "--model", dest="model_option", default=None, metavar="MODEL",
        help="The model, as an option (vLLM's EngineArgs flag); the positional argument wins when "
             "both are given.")

    g = parser.add_argument_group("Server")
    g.add_argument("--host", default="127.0.0.1",
                   help="Address to listen on (default: 127.0.0.1; use 0.0.0.0 for all "
                        "interfaces).")
    g.add_argument("--port", type=port_number, default=8000,
                   help="Port to listen on (default: 8000). It is bound before the model loads, so a "
                        "port in use fails at once.")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) the API reports and accepts in the `model` field "
                        "(default: the model argument). The first one is used in responses.")
    g.add_argument("--api-key", default=envs.get("PAGEDLLM_API_KEY"),
                   help="Require `Authorization: Bearer <key>` on /v1 routes (default: the "
                        "PAGEDLLM_API_KEY environment variable; unset = no auth).")
    g.add_argument("--chat-template", default=None,
                   help="Chat template to use instead of the model's: a path to a Jinja file "
                        "or the template itself.")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: info).")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="Log each received request (its prompt, sampling parameters and prompt length; "
                        "off by default, as vLLM >= 0.10.2).")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="With --enable-log-requests, also log each finished choice's text, token ids "
                        "and finish reason.")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="Most prompt characters / token ids (and output characters) printed per logged "
                        "request (default: all).")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="Deprecated (requests are not logged unless --enable-log-requests is given); "
                        "accepted and ignored, with a warning.")
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

    g = parser.add_argument_group("CORS", "Cross-origin resource sharing headers for browser clients.")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='Allowed origins as a JSON list (default: ["*"], as vLLM).')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"],
                   help='Allowed methods as a JSON list (default: ["*"]).')
    g.add_argument("--allowed-headers", type=_json_list, default=["*"],
                   help='Allowed headers as a JSON list (default: ["*"]).')
    g.add_argument("--allow-credentials", action="store_true",
                   help="Allow credentials (cookies, Authorization) in cross-origin requests (default: off).")

    g = parser.add_argument_group("Tool calling and reasoning")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Let the model decide when to call tools (`tool_choice: "auto"`, the '
                        "default when a request has tools); needs --tool-call-parser.")
    g.add_argument("--tool-call-parser", default=None,
                   help="How to find tool calls in the model's text: hermes, llama3_json, "
                        "mistral, pythonic, qwen3_coder (= qwen3_xml), deepseek_v3, ... (or a "
                        "name registered by --tool-parser-plugin).")
    g.add_argument("--tool-parser-plugin", default=None,
                   help="A Python file that registers more tool parsers "
                        "(ToolParserManager.register_module).")
    g.add_argument("--reasoning-parser", default=None,
                   help="Split the model's reasoning (`reasoning_content` / `reasoning`) from "
                        "its answer: deepseek_r1, qwen3, think.")

    g.add_argument("--responses-store-size", type=int, default=1024,
                   help="Max responses kept in memory for the Responses API (`store`, "
                        "`previous_response_id`, GET /v1/responses/{id}, background); the least "
                        "recently used finished one is evicted; 0 turns storing off "
                        "(default: 1024).")

    g = parser.add_argument_group("Model")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16",
                                                       "half", "float", "bf16", "fp32", "fp16"],
                   help="Weight and activation dtype. auto = bfloat16 on CPUs with native bf16 "
                        "matmul (float16/bfloat16 on CUDA), else float32.")
    g.add_argument("--max-model-len", type=_max_model_len, default=None,
                   help="Max tokens per request (prompt + output); takes suffixes as vLLM: 32k = 32,000, "
                        "32K = 32,768, 1m = 1,000,000, 1M = 1,048,576; or 'auto' (also -1; the default): "
                        "the model's context length, capped by what the KV cache can hold.")
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
                   help="Tokenizer to use instead of the model's own: a Hugging Face Hub id or directory, "
                        "or a GGUF file whose tokenizer to take.")
    g.add_argument("--hf-overrides", type=_json_dict, default=None,
                   help='JSON merged into the model\'s Hugging Face config before it is built, e.g. '
                        '\'{"is_matryoshka": true}\' (vLLM\'s flag).')
    g.add_argument("--pooler-config", type=_json_dict, default=None,
                   help='Pooler settings as JSON, e.g. \'{"pooling_type": "LAST", '
                        '"use_activation": false}\' (use_activation: the output activation of every '
                        'pooling task, i.e. the L2 normalisation of embeddings and the softmax of '
                        'classifiers; "normalize", "softmax" and "activation" are deprecated aliases).')
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                   help="Default: a quantized checkpoint (GGUF blocks, GPTQ, AWQ, compressed-tensors, "
                        "FP8) runs in its own format. int8/int4/w8a8 re-quantize float weights after "
                        "loading (CPU): weight-only int8 per-channel or int4 group-wise (group 32), or "
                        "w8a8 (int8 per-channel weights and dynamic per-token int8 activations). "
                        "'none' dequantizes a quantized checkpoint at load.")
    g.add_argument("--ignore-patterns", nargs="*", default=[],
                   help="fnmatch patterns of checkpoint files not to load.")
    g.add_argument("--revision", default=None,
                   help="Hub revision of the model (branch, tag or commit; default: main).")
    g.add_argument("--tokenizer-revision", default=None, help="Hub revision of --tokenizer.")
    g.add_argument("--download-dir", default=None,
                   help="Hugging Face cache directory for downloads (default: HF_HUB_CACHE or HF_HOME/hub). "
                        "HF_HUB_OFFLINE=1 uses only what is cached there; HF_TOKEN authenticates.")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "pt", "gguf", "dummy"],
                   help="Weight format: auto (safetensors, else .bin/.pt, else GGUF), or one of them; "
                        "dummy = random weights (profiling).")
    g.add_argument("--hf-config-path", default=None,
                   help="HF config (directory or Hub id) to use instead of the model's own, e.g. for a GGUF file.")
    g.add_argument("--mmproj", default=None,
                   help="llama.cpp's mmproj GGUF (vision tower + projector) for a GGUF text model, e.g. Gemma 3 "
                        "(default: an mmproj*.gguf beside the model file when it fits; 'none': text only).")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="Accepted for vLLM compatibility; a checkpoint's own Python code is never executed.")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="vLLM's expert-parallel flag; accepted, but every rank still holds all MoE experts "
                        "(tensor parallelism splits attention and dense MLPs only).")
    g.add_argument("--enable-prompt-embeds", action="store_true", default=None,
                   help="Accept `prompt_embeds` on /v1/completions: base64 of a torch.save'd float tensor "
                        "(seq_len, hidden_size) fed to the model in place of the token embeddings (vLLM's "
                        "flag; default: off, such a request is a 400).")
    g.add_argument("--limit-mm-per-prompt", type=_json_dict, default=None,
                   help='Most images per prompt as JSON (vLLM\'s flag), e.g. \'{"image": 2}\' (default 1).')
    g.add_argument("--mm-processor-kwargs", type=_json_dict, default=None,
                   help="HF processor kwargs as JSON applied to every image request (vLLM's flag).")
    g.add_argument("--allowed-local-media-path", default=None,
                   help="Directory that file:// image URLs may read from (default: file:// refused).")
    g.add_argument("--allowed-media-domains", nargs="+", default=None,
                   help="Hosts http(s) image URLs may be fetched from (default: remote images refused).")
    g.add_argument("--model-impl", default="auto", choices=["auto", "pagedllm", "transformers"],
                   help="auto: pagedllm's native implementation when the architecture has one, else the "
                        "transformers fallback (slower); pagedllm: native only; transformers: always the fallback.")

    g = parser.add_argument_group("Structured outputs")
    add_engine_args(g, engine_flag(
        "structured_outputs_config", 'Structured-output settings as JSON (vLLM\'s flag), e.g. \'{"backend": "auto"}\': '
        'backend auto (xgrammar, llguidance for what it cannot compile) | xgrammar | '
        'guidance; disable_fallback, disable_any_whitespace, '
        'disable_additional_properties (booleans); max_whitespace_cnt (most '
        'whitespace characters in a row in JSON, default 16, null = unbounded); '
        'grammar_cache_size (compiled '
        'grammars kept, default 256); compile_threads (default 2); jump_forward '
        '(lossless jump-forward decoding of the text a grammar forces, default true) '
        'and jump_forward_max_tokens (its most draft tokens per step, default 16).',
        type=_json_dict))

    g = parser.add_argument_group("Speculative decoding")
    add_engine_args(g, engine_flag(
        "speculative_config", 'Speculative decoding as JSON (vLLM\'s flag), e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\': method ngram | suffix '
        '| draft_model (with "model", optionally "quantization": "int4" for a '
        'self-draft); disable_by_batch_size (no drafts in steps with at least that '
        'many requests; default: measured automatic threshold, 0 = never).',
        type=_json_dict))

    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="Serve LoRA adapters (PEFT format) on the base model; a request's `model` field "
                        "selects one by name.")
    g.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                   metavar="NAME=PATH",
                   help="Adapters to serve from the start: name=path, or JSON "
                        '{"name": ..., "path": ..., "base_model_name": ...} (needs --enable-lora).')
    g.add_argument("--max-loras", type=_positive_int, default=None,
                   help="Adapters one step may run (the slot table; default: 1).")
    g.add_argument("--max-lora-rank", type=_positive_int, default=None,
                   help="Largest adapter rank accepted (default: 16).")
    g.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                   help="Adapters kept loaded in CPU memory, least recently used evicted (default: "
                        "--max-loras).")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="Add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                        "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=true or vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true). Risky in production: anyone who "
                        "can reach the server can load files from its disk.")

    g = parser.add_argument_group("Scheduler and KV cache")
    add_engine_args(
        g,
        engine_flag("max_num_seqs", "Max requests scheduled in one step (default: %(default)s).", type=_positive_int),
        engine_flag("max_num_batched_tokens", "Max tokens processed in one step; longer prompts are prefilled in "
                    "chunks (default: %(default)s).", type=positive_human_int),
        engine_flag("block_size", "Tokens per KV cache block (default: %(default)s).", type=_positive_int))
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache budget in bytes; accepts suffixes like 2GiB, 512MiB, 1.5G. "
                        "Default on CPU: half of the free memory (MemAvailable) after the weights "
                        "load, at most what --max-num-seqs sequences of --max-model-len tokens fill. "
                        "Its pages are committed as blocks are first written, so this is a bound "
                        "(pagedllm:kv_cache_committed_bytes is what is in use).")
    g.add_argument("--kv-prefix-cache-memory", type=_size_or_zero, default=None,
                   help="Free KV blocks holding cached prefixes kept resident (default 64MiB; 0 = "
                        "none): past this, least recently used prefixes are reused before fresh "
                        "blocks are committed, and an idle server gives the rest back to the OS.")
    add_engine_args(
        g,
        engine_flag("kv_cache_dtype", "KV cache storage: auto (the model dtype; bfloat16 on CPUs without native "
                    "bf16, where --dtype auto runs the model in float32), bfloat16, or 8-bit floats "
                    "(fp8 = fp8_e4m3, or fp8_e5m2): half the bytes per token of bf16 (CPU only).",
                    choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]),
        engine_flag("enable_prefix_caching", "Reuse the KV cache of shared prompt prefixes (default: on).",
                    action=argparse.BooleanOptionalAction),
        engine_flag("prefix_caching_hash_algo", "Hash of prefix-cache blocks (default: %(default)s).",
                    choices=["sha256", "xxhash"]))

    add_engine_args(g, engine_flag(
        "scheduling_policy", "fcfs: requests run in arrival order; priority: by each request's `priority` "
        "(lower first, ties by arrival), and preemption takes the lowest-priority running "
        "request (vLLM's flag). With fcfs a nonzero `priority` is refused (400).", choices=["fcfs", "priority"]))
    add_engine_args(g, engine_flag(
        "kv_events_config", 'Publish the prefix cache\'s KV block events over ZeroMQ (vLLM\'s flag and '
        'KVEventsConfig JSON), e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "topic": "kv-events"}\': publisher zmq | null, endpoint, '
        'replay_endpoint, buffer_steps (batches kept for replay), hwm, max_queue_size '
        '(batches queued; beyond it a batch is dropped and counted on /metrics), topic. '
        'Needs pyzmq and msgspec.',
        type=_json_dict))

    g = parser.add_argument_group("KV cache tiers")
    g.add_argument("--kv-transfer-config", type=_json_dict, default=None,
                   help='KV connector, as vLLM: \'{"kv_connector": "OffloadingConnector", "kv_role": '
                        '"kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": ..., '
                        '"kv_cache_dir": ..., "disk_bytes_to_use": ...}}\' (docs/kv_connector.md).')
    g.add_argument("--kv-offloading-size", type=positive_float, default=None,
                   help="GiB of host memory for KV blocks evicted from the prefix cache "
                        "(OffloadingConnector's host tier, LRU; vLLM's flag).")
    g.add_argument("--kv-offloading-backend", default=None, choices=["native"],
                   help="Offloading implementation (vLLM's flag; 'native' only).")
    g.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="Disk tier of OffloadingConnector: KV blocks are kept as checksummed files "
                        "here, survive restarts and may be shared by servers of the same model.")
    g.add_argument("--kv-cache-dir-size", type=positive_float, default=None,
                   help="GiB bound of the --kv-cache-dir tier (default 16; least recently used "
                        "files are deleted past it).")

    g = parser.add_argument_group("Observability")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="Export one OpenTelemetry span per request to this OTLP collector (vLLM's flag; "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL grpc (default, e.g. localhost:4317) or "
                        "http/protobuf (e.g. http://localhost:4318/v1/traces)); an incoming traceparent "
                        "header becomes the span's parent. Needs opentelemetry-sdk and the OTLP exporter.")

    g = parser.add_argument_group("Parallelism")
    add_engine_args(
        g,
        engine_flag("tensor_parallel_size", "Ranks each layer is split across (attention heads, MLP, vocabulary; "
                    "default: %(default)s).", "-tp", type=_positive_int),
        engine_flag("pipeline_parallel_size", "Pipeline stages the layers are split across (default: %(default)s).",
                    "-pp", type=_positive_int),
        engine_flag("data_parallel_size", "Independent engine replicas behind this server (each its own process "
                    "behind the router on this port; see --data-parallel-router; default: %(default)s).", "-dp", type=_positive_int),
        engine_flag("distributed_executor_backend", "How ranks run: 'uni' (in this process; one rank only), 'mp' "
                    "(a process per rank) or 'ray' (a Ray actor per rank; multi-node). Default: uni for one "
                    "rank, else mp.", choices=["uni", "mp", "ray"]))
    g.add_argument("--data-parallel-router", default="prefix",
                   choices=["prefix", "least-load", "round-robin", "sticky", "off"],
                   help="With --data-parallel-size > 1: run each replica as its own process behind the "
                        "router on this port, routing by this policy (prefix: the replica holding the "
                        "longest prefix of the prompt, from its KV cache events; docs/scaling.md); 'off': "
                        "the replicas in this process, least loaded first (default: prefix).")
    g.add_argument("--data-parallel-backend", "-dpb", default="mp", choices=["mp", "ray"],
                   help="With --data-parallel-size > 1 (vLLM's flag): 'mp' runs every replica's ranks on this "
                        "machine; 'ray' runs each replica's ranks as Ray actors on the cluster that RAY_ADDRESS "
                        "names (as --distributed-executor-backend ray does for one engine), so the replicas "
                        "spread over its nodes; each rank asks Ray for --num-threads CPUs (default: %(default)s).")

    g = parser.add_argument_group("Device")
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
    g.add_argument("--enable-sleep-mode", action="store_true", default=None,
                   help="Serve POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (vLLM's sleep "
                        "mode: level 1 drops the KV cache and moves the weights to a temporary file, "
                        "level 2 drops both and reloads the checkpoint on wake; resident memory goes "
                        "back to the OS). Off by default.")
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="Outputs (greedy tokens, logits, logprobs) independent of batch composition, "
                        "chunked-prefill splits, prefix-cache hits and preemption, at a throughput cost "
                        "(CPU, float32/bfloat16, unquantized; also PAGEDLLM_BATCH_INVARIANT=1 or "
                        "VLLM_BATCH_INVARIANT=1).")
    return parser


def make_arg_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    """``parser`` (default: a new ``pagedllm serve`` FlexibleArgumentParser) with every serve flag."""
    if parser is None:
        parser = FlexibleArgumentParser(prog="pagedllm serve",
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
    """Canonical values after parsing: ``--model`` folded into ``model``, dtype aliases; warnings
    for ``--disable-log-requests`` (deprecated no-op) and ``--enable-log-outputs`` alone.

    Raises:
        ValueError: ``--lora-modules`` without ``--enable-lora``, a bad ``--kv-events-config``, or
            ``--otlp-traces-endpoint`` without the OpenTelemetry SDK.
    """
    resolve_model_arg(args)
    if getattr(args, "dtype", None) in _DTYPE_ALIASES:
        args.dtype = _DTYPE_ALIASES[args.dtype]
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    if getattr(args, "disable_log_requests", False):
        logger.warning("--disable-log-requests is deprecated and has no effect: requests are logged only "
                       "with --enable-log-requests (off by default)")
    if getattr(args, "enable_log_outputs", False) and not getattr(args, "enable_log_requests", False):
        logger.warning("--enable-log-outputs has no effect without --enable-log-requests")
    if getattr(args, "kv_events_config", None) is not None:
        from pagedllm.kv_events import KVEventsConfig
        try:
            KVEventsConfig.from_any(args.kv_events_config)
        except ValueError as e:
            raise ValueError(f"--kv-events-config: {e}") from None
    if getattr(args, "otlp_traces_endpoint", None):
        from pagedllm.tracing import is_otel_available
        if not is_otel_available():
            raise ValueError("--otlp-traces-endpoint: OpenTelemetry is not installed (pip install "
                             "opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc, or "
                             "pip install 'pagedllm[tracing]')")
    return args


def resolve_parsers(args: Any) -> tuple[bool, Optional[type], Optional[type]]:
    """(enable_auto_tools, tool parser class, reasoning parser class) from the tool-calling
    and reasoning flags (``--tool-parser-plugin`` imported first).

    Raises:
        ValueError: --enable-auto-tool-choice without --tool-call-parser, an unknown parser
            name (the message lists the known ones), or a plugin that fails to import.
    """
    get = (lambda name: getattr(args, name, None) if args is not None else None)
    plugin, tool_name, reasoning_name = (get("tool_parser_plugin"), get("tool_call_parser"),
                                         get("reasoning_parser"))
    enable = bool(get("enable_auto_tool_choice"))
    tool_cls = reasoning_cls = None
    if plugin or tool_name or enable:
        from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
        if plugin:
            ToolParserManager.import_tool_parser(plugin)
        if enable and not tool_name:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                             f"{', '.join(ToolParserManager.list_registered())}).")
        if tool_name:
            try:
                tool_cls = ToolParserManager.get_tool_parser(tool_name)
            except KeyError as e:
                raise ValueError(f"--tool-call-parser: {e.args[0]}") from None
    if reasoning_name:
        from pagedllm.reasoning import ReasoningParserManager
        try:
            reasoning_cls = ReasoningParserManager.get_reasoning_parser(reasoning_name)
        except KeyError as e:
            raise ValueError(f"--reasoning-parser: {e.args[0]}") from None
    return enable, tool_cls, reasoning_cls
