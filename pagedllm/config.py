"""Engine configuration, with vLLM's argument names and defaults where they apply."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
import dataclasses
from dataclasses import dataclass, field
import re
from typing import Any, Optional, overload

# KV cache budget on CPU when --kv-cache-memory is not given (vLLM's CPU backend uses
# VLLM_CPU_KVCACHE_SPACE, GiB): KV_AUTO_MEMORY_FRACTION of MemAvailable (/proc/meminfo) after the
# weights are loaded, split between the ranks and replicas on the machine, and never more than
# max_num_seqs x max_model_len tokens can fill. The cache's pages are committed on first write
# (pagedllm.worker.kv_memory), so the budget is a bound, not what start-up takes.
# DEFAULT_CPU_KV_CACHE_BYTES is the fallback where /proc/meminfo is unavailable.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
KV_AUTO_MEMORY_FRACTION = 0.5
# Free KV blocks holding cached prefixes kept resident, ahead of never-used blocks and across the
# idle release (--kv-prefix-cache-memory).
DEFAULT_KV_PREFIX_CACHE_BYTES = 64 * 1024**2

class _QuantizationChoices(Sequence[str]):
    """The ``--quantization`` values, read from the quantization method registry each time they
    are asked for (``pagedllm.quantization.base.register_quantization_config``), plus "none".

    Built in: re-quantize float weights at load (int8, int4, w8a8) or a checkpoint format (gguf,
    gptq, awq, compressed-tensors, fp8: the default is the checkpoint's own); "none" dequantizes a
    quantized checkpoint at load. A method registered later (a plugin, a test) is a choice as soon
    as it is registered: pass this object itself as argparse ``choices``. The registry is imported
    on first use, so importing ``pagedllm.config`` stays light.
    """

    #: what importing ``pagedllm.quantization`` registers (tests/quantization/test_custom_method.py checks
    #: it against the registry): the choices while the registry is not imported yet, so a command that
    #: only parses flags (``pagedllm chat``, a flag error) does not import torch (~2 s) for them; no
    #: other method can be registered before the registry module is imported
    BUILT_IN = ("awq", "compressed-tensors", "fp8", "gguf", "gptq", "int4", "int8", "w8a8")

    def _names(self) -> tuple[str, ...]:
        import sys

        if "pagedllm.quantization.base" not in sys.modules:
            return (*self.BUILT_IN, "none")
        from pagedllm.quantization.base import registered_methods

        return (*registered_methods(), "none")

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return repr(self._names())


#: ``--quantization`` values (a live view of the registry, see ``_QuantizationChoices``).
QUANTIZATION_CHOICES: Sequence[str] = _QuantizationChoices()

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}


def parse_bytes(value: str | int) -> int:
    """'2GiB' / '512MiB' / '1.5G' / '1073741824' -> bytes (decimal units for K/M/G, binary
    for Ki/Mi/Gi).

    Raises:
        ValueError: not a size, an unknown unit, or not positive.
    """
    s = str(value).strip().replace("_", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)", s)
    if not m:
        raise ValueError(f"invalid size {value!r} (expected e.g. 2GiB, 512MiB, 1073741824)")
    num, unit = m.groups()
    mult = _SIZE_UNITS.get(unit.lower())
    if mult is None:
        raise ValueError(f"invalid size unit {unit!r} in {value!r}")
    n = int(float(num) * mult)
    if n <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return n


def parse_json_arg(value: Any, name: str, what: str = "a JSON object") -> Any:
    """A JSON-valued argument (a ``--*-config`` flag, an ``LLM(...)`` keyword): a string is parsed
    as JSON, anything else is returned as given; the result must be a dict.

    Args:
        value: a dict, or a JSON object string.
        name: the argument's name for the messages (``speculative_config``).
        what: how the messages name the expected value.

    Raises:
        ValueError: ``"{name}: invalid JSON: ..."``, or ``"{name}: expected {what}, got list"``.
    """
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: invalid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected {what}, got {type(value).__name__}")
    return value


def dataclass_from_json(cls: type, value: Any, name: str) -> Any:
    """``cls(**fields)`` from a dict or a JSON object string (``parse_json_arg``), refusing a
    key that is not a field of the dataclass ``cls``.

    Raises:
        ValueError: invalid JSON, not an object, ``"{name}: unknown field 'x' (known: [...])"``,
            or whatever ``cls`` raises for a bad value.
    """
    value = parse_json_arg(value, name)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{name}: unknown field {unknown[0]!r} (known: {sorted(names)})")
    return cls(**value)


def apply_hf_overrides(hf_config: Any, overrides: Any) -> Any:
    """Merge ``overrides`` into ``hf_config`` in place (vLLM ``--hf-overrides`` /
    ``LLM(hf_overrides=...)``) and return the config.

    Args:
        hf_config: a transformers config or pagedllm's GGUF ``TextConfig`` (attributes).
        overrides: None; a dict, or a JSON object string, of attribute -> value (a dict value
            merges key by key into an attribute that is itself a dict or a sub-config); or a
            callable ``config -> config``.

    Raises:
        ValueError: invalid JSON, or not a dict / callable.
    """
    if overrides is None:
        return hf_config
    if callable(overrides):
        return overrides(hf_config)
    overrides = parse_json_arg(overrides, "hf_overrides", "a dict")

    def merge(target: Any, updates: dict[str, Any]) -> None:
        for key, value in updates.items():
            cur = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
            if isinstance(value, dict) and cur is not None and (isinstance(cur, dict) or hasattr(cur, "__dict__")):
                merge(cur, value)
            elif isinstance(target, dict):
                target[key] = value
            else:
                setattr(target, key, value)

    merge(hf_config, overrides)
    return hf_config


@dataclass
class EngineArgs:
    """Every engine setting (offline ``LLM(...)`` keywords and ``pagedllm serve`` flags).

    Attributes:
        model: path to a GGUF file or HF directory, or a known name (``SmolLM2-135M-Instruct``).
        tokenizer: optional tokenizer path (defaults to the model's).
        dtype: "auto" (bfloat16 on CPUs with native bf16 matmul, else float32), "float32",
            "bfloat16", "float16".
        max_model_len: max prompt + output tokens per request; None or "auto" (or -1) = the
            model's context length capped by what the KV cache holds.
        max_num_seqs: max requests per step.
        max_num_batched_tokens: token budget per step (chunked prefill splits longer prompts).
        block_size: tokens per KV cache block.
        kv_cache_memory: KV cache budget in bytes, or a size string such as "512MiB" / "2GiB"
            (None: on CPU KV_AUTO_MEMORY_FRACTION of MemAvailable, at most what max_num_seqs x
            max_model_len tokens fill; on CUDA what gpu_memory_utilization leaves). On CPU the
            cache's pages are committed as blocks are first written, so this is a bound.
        kv_prefix_cache_memory: bytes of free KV blocks holding cached prefixes kept resident
            (None = DEFAULT_KV_PREFIX_CACHE_BYTES, 64 MiB; 0 = none): past this, the least
            recently used cached block is reused before a never-used block is committed, and an
            idle server gives the pages of the rest back (``PAGEDLLM_IDLE_RELEASE_S``).
        kv_cache_dtype: "auto" (the model dtype; bfloat16 on CPU where dtype "auto" runs the model
            in float32 because the CPU lacks native bf16), "bfloat16", "fp8" / "fp8_e4m3" (float8_e4m3fn) or
            "fp8_e5m2": 8-bit K/V, half the bytes of bf16, so the same budget holds twice the
            tokens and decode attention reads half the memory (CPU only; see
            ``pagedllm.platforms.resolve_kv_cache_dtype``).
        seed: global seed for unseeded random sampling.
        enable_prefix_caching: automatic prefix caching (on by default, as in vLLM v1).
        prefix_caching_hash_algo: "sha256" or "xxhash".
        num_threads: torch intra-op threads for the engine (None = measured default).
        served_model_name: name(s) reported by the API (default: the model argument).
        max_logprobs: cap on ``logprobs`` / ``prompt_logprobs`` per request.
        generation_config: "auto" (model's generation config supplies default sampling
            values), "vllm" (ignore it), or a directory holding generation_config.json.
        chat_template: a Jinja template string or path to a file holding one.
        device: "auto", "cpu" or "cuda".
        runner: "generate" or "pooling"; convert: "embed" / "classify" (pooling runner).
        pooler_config: dict or PoolerConfig for the pooling runner.
        ignore_patterns: fnmatch patterns of checkpoint files not to load.
        disable_log_stats: no periodic stats log line.
        enforce_eager: no CUDA graphs.
        gpu_memory_utilization: fraction of GPU memory for weights + activations + KV cache
            (CUDA only; used when kv_cache_memory is not given).
        attention_backend: "torch" | "triton" | "flashinfer" | None (CPU: torch, CUDA: triton;
            also PAGEDLLM_ATTENTION_BACKEND).
        hf_overrides: a dict (or JSON object string) merged into the model's HF config after
            loading, before the model is built (vLLM ``--hf-overrides``; e.g.
            ``{"is_matryoshka": true}``), or a callable taking and returning the config.
        quantization: None (default): a quantized checkpoint runs in its own format (GGUF
            blocks, GPTQ, AWQ, compressed-tensors, FP8; README "Quantization"), a float one in
            ``dtype``; "int8" (weight-only, per-channel symmetric), "int4" (weight-only, group-wise,
            group 32) or "w8a8" (int8 per-channel weights and dynamic per-token int8 activations)
            re-quantize float weights after loading (CPU only); "none" dequantizes a quantized
            checkpoint at load; a format name must match the checkpoint's (``QUANTIZATION_CHOICES``).
        revision: Hugging Face Hub revision (branch, tag or commit) of a Hub model id.
        tokenizer_revision: Hub revision of ``tokenizer`` when it is a Hub id.
        download_dir: HF cache directory for Hub downloads (default: HF_HUB_CACHE / HF_HOME).
        load_format: "auto" (safetensors, else PyTorch .bin/.pt, else GGUF), "safetensors", "pt",
            "gguf" or "dummy" (random weights; for profiling).
        hf_config_path: HF config directory or Hub id used instead of the model's own config.
        mmproj: llama.cpp's mmproj GGUF (vision tower + projector) for a GGUF text model (llama.cpp's
            ``--mmproj``; ``loader.gguf_mmproj``); None = an ``mmproj*.gguf`` beside the model file when
            it fits; "none" = text only.
        trust_remote_code: accepted for vLLM compatibility; a checkpoint's own Python code is never
            executed (a config that needs it is refused with an explanation).
        model_impl: "auto" (pagedllm's native model when the architecture has one, else the
            transformers fallback), "pagedllm" (native only) or "transformers" (always the fallback).
        enable_expert_parallel: vLLM's flag to shard MoE experts across the ranks. Accepted; today
            every rank holds all experts (correct under tensor parallelism: the experts' output
            needs no reduction, only memory is not split). ``FusedMoE.shard_experts`` /
            ``shard_intermediate`` are the splits a sharding pass would call.
        structured_outputs_config: dict of structured-output settings (vLLM's
            ``--structured-outputs-config``): ``backend`` ("auto" | "xgrammar" | "guidance"),
            ``disable_fallback``, ``disable_any_whitespace``, ``max_whitespace_cnt`` (most
            whitespace characters in a row in JSON, default 16, None = unbounded),
            ``disable_additional_properties``, ``grammar_cache_size`` (compiled grammars kept,
            default 256), ``compile_threads`` (default 2), ``jump_forward`` (lossless
            jump-forward decoding, default True), ``jump_forward_max_tokens`` (default 16); see
            ``pagedllm.structured_output.config``.
        tensor_parallel_size: ranks each layer is split across (attention heads, MLP, vocab).
        pipeline_parallel_size: stages the layers are split across (contiguous ranges).
        data_parallel_size: independent engine replicas behind one server (each with
            ``tensor_parallel_size x pipeline_parallel_size`` ranks).
        data_parallel_rank: this replica's index (set by the data-parallel front end).
        distributed_executor_backend: "uni" (one process, no IPC), "mp" (one spawned process
            per rank, ``torch.distributed`` gloo on CPU / NCCL on CUDA) or "ray" (one Ray actor
            per rank, placement groups; multi-node). None = "uni" for one rank, else "mp".
        batch_invariant: greedy outputs (and every logit and logprob) independent of what else
            the engine runs: batch composition, chunked-prefill split points, prefix-cache hits,
            preemption (vLLM's ``VLLM_BATCH_INVARIANT``; CPU, float32/bfloat16, unquantized,
            one rank). Costs throughput (docs/performance.md); off by default, also turned on by
            the environment variable ``PAGEDLLM_BATCH_INVARIANT=1`` or ``VLLM_BATCH_INVARIANT=1``
            (see ``pagedllm.worker.batch_invariant``).
        speculative_config: speculative decoding, vLLM's ``speculative_config`` (a dict, a JSON
            string or a ``pagedllm.spec_decode.config.SpeculativeConfig``): ``{"method": "ngram",
            "num_speculative_tokens": 4, ...}``; None = off.
        kv_transfer_config: a KV connector (vLLM's ``--kv-transfer-config``): a dict or JSON object
            string ``{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {...}}`` or a ``KVTransferConfig``; None = none
            (README "KV cache tiers", docs/kv_connector.md).
        kv_offloading_size: GiB of host memory for offloaded KV blocks (vLLM's
            ``--kv-offloading-size``): turns on ``OffloadingConnector``.
        kv_offloading_backend: "native" (vLLM's ``--kv-offloading-backend``; the only one here).
        kv_cache_dir: directory of the offloading connector's disk tier (survives restarts; may be
            shared by processes serving the same model); turns on ``OffloadingConnector``.
        kv_cache_dir_size: GiB bound of the disk tier (default 16).
        enable_lora: serve LoRA adapters per request (``LoRARequest``; ``pagedllm.lora``).
        max_loras: adapters one step may run (the device slot table; vLLM's default 1).
        max_lora_rank: largest adapter rank accepted (vLLM's default 16).
        max_cpu_loras: adapters kept loaded in CPU memory (least recently used evicted and read
            from disk again when needed); None = ``max_loras``; must be >= ``max_loras``.
        enable_prompt_embeds: accept prompts given as embeddings (``{"prompt_embeds": tensor}``
            offline, ``prompt_embeds`` on ``/v1/completions``; vLLM's flag); off by default.
            Generation only, one in-process worker.
        limit_mm_per_prompt: most items per modality in one prompt (vLLM's ``--limit-mm-per-prompt``,
            e.g. ``{"image": 2}``); None = 1 image. Only for image-text models (Gemma 3).
        mm_processor_kwargs: kwargs for the HF processor on every request (vLLM's flag); a request's
            own ``mm_processor_kwargs`` override them.
        allowed_local_media_path: a directory ``file://`` image URLs may read from ("" = none).
        allowed_media_domains: hosts ``http(s)`` image URLs may be fetched from (None = remote
            media refused).
        encoder_cache_size: bound of the encoder cache, in tokens of image embeddings (None = 8192).
        scheduling_policy: "fcfs" (first come, first served) or "priority" (vLLM's
            ``--scheduling-policy``): waiting requests run in order of their ``priority`` (lower
            first, ties by arrival) and preemption takes the lowest-priority running request;
            with "fcfs" a request's priority must be 0 (``pagedllm.core.scheduler``).
        otlp_traces_endpoint: OpenTelemetry collector address (vLLM's
            ``--otlp-traces-endpoint``): one span per request is exported to it over OTLP
            (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` "http/protobuf", the default, or "grpc"); needs
            ``opentelemetry-sdk`` and an OTLP exporter package (``pagedllm.tracing``). None = off.
        kv_events_config: KV cache events (vLLM's ``--kv-events-config``, its ``KVEventsConfig``
            fields: a dict, a JSON object string or a ``pagedllm.kv_events.KVEventsConfig``):
            BlockStored / BlockRemoved / AllBlocksCleared of the prefix cache published over ZMQ
            (``pagedllm.kv_events``). None = off.
        enable_sleep_mode: allow ``sleep(level)`` / ``wake_up(tags)`` (vLLM's sleep mode; on CPU
            it gives resident memory back: ``pagedllm.worker.sleep``); off by default.
    """

    model: str = "SmolLM2-135M-Instruct"
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int | str] = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: Optional[int | str] = None
    kv_cache_dtype: str = "auto"
    kv_prefix_cache_memory: Optional[int | str] = None
    seed: int = 0
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_threads: Optional[int] = None
    served_model_name: Optional[list[str] | str] = None
    max_logprobs: int = 20
    generation_config: str = "auto"
    chat_template: Optional[str] = None
    device: str = "auto"
    runner: str = "generate"
    convert: Optional[str] = None
    pooler_config: Optional[Any] = None
    ignore_patterns: list[str] = field(default_factory=list)
    disable_log_stats: bool = False
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    attention_backend: Optional[str] = None
    quantization: Optional[str] = None
    revision: Optional[str] = None
    tokenizer_revision: Optional[str] = None
    download_dir: Optional[str] = None
    load_format: str = "auto"
    hf_config_path: Optional[str] = None
    mmproj: Optional[str] = None
    trust_remote_code: bool = False
    model_impl: str = "auto"
    enable_expert_parallel: bool = False
    structured_outputs_config: Optional[dict[str, Any]] = None
    hf_overrides: Optional[Any] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    distributed_executor_backend: Optional[str] = None
    batch_invariant: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    enable_prompt_embeds: bool = False
    limit_mm_per_prompt: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    allowed_local_media_path: str = ""
    allowed_media_domains: Optional[list[str]] = None
    encoder_cache_size: Optional[int] = None
    scheduling_policy: str = "fcfs"
    otlp_traces_endpoint: Optional[str] = None
    kv_events_config: Optional[Any] = None
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        # NOTE: "auto" (vLLM's spelling, also -1) = the model's context length capped by what the
        # KV cache holds, which is what None means.
        mml = self.max_model_len
        if isinstance(mml, str):
            s = mml.strip().lower()
            if s == "auto":
                mml = None
            else:
                try:
                    mml = int(s)
                except ValueError:
                    raise ValueError(f"max_model_len: expected a positive integer or 'auto', got {self.max_model_len!r}") from None
        if mml == -1:
            mml = None
        self.max_model_len = mml
        # NOTE: the checks the CLI makes on these flags, for LLM(...) / EngineArgs callers too
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be a number in (0, 1], got {gmu!r}")
        nt = self.num_threads
        if nt is not None and (isinstance(nt, bool) or not isinstance(nt, int) or nt < 1):
            raise ValueError(f"num_threads: must be a positive integer (or None for the default), got {nt!r}")
        if self.seed is not None:
            try:
                if isinstance(self.seed, bool) or int(self.seed) != self.seed:
                    raise ValueError
            except (TypeError, ValueError):
                raise ValueError(f"seed: must be an integer, got {self.seed!r}") from None

    def kv_prefix_cache_bytes(self) -> int:
        """``kv_prefix_cache_memory`` in bytes (None = DEFAULT_KV_PREFIX_CACHE_BYTES; 0 = keep no
        free cached block resident).

        Raises:
            ValueError: not a size (naming the field and the flag).
        """
        v = self.kv_prefix_cache_memory
        if v is None:
            return DEFAULT_KV_PREFIX_CACHE_BYTES
        if str(v).strip() in ("0", "0B", "0b"):
            return 0
        try:
            return parse_bytes(v)
        except ValueError as e:
            raise ValueError(f"kv_prefix_cache_memory (--kv-prefix-cache-memory): {e}") from None

    def check_memory_args(self, device_type: str = "cpu") -> Optional[int]:
        """Check the memory settings before anything is loaded; returns ``kv_cache_memory`` in
        bytes (None when not given).

        On CPU a ``kv_cache_memory`` larger than the machine's memory (MemTotal in /proc/meminfo)
        is refused, naming the flag and what would fit; one larger than MemAvailable is allowed
        (pages are committed on use) with a warning.

        Raises:
            ValueError: ``kv_cache_memory`` or ``kv_prefix_cache_memory`` is not a positive size,
                or ``kv_cache_memory`` exceeds the machine's memory.
        """
        import logging

        from pagedllm.metrics.memory import format_bytes, read_meminfo

        self.kv_prefix_cache_bytes()
        if self.kv_cache_memory is None:
            return None
        try:
            n = parse_bytes(self.kv_cache_memory)
        except ValueError as e:
            raise ValueError(f"kv_cache_memory (--kv-cache-memory): {e}; give a positive size such as "
                             f"512MiB or 4GiB, or leave it unset to size the cache from free memory") from None
        if device_type != "cpu":
            return n
        mi = read_meminfo()
        total, avail = mi.get("MemTotal"), mi.get("MemAvailable")
        if total and n > total:
            fit = int((avail or total) * KV_AUTO_MEMORY_FRACTION)
            raise ValueError(
                f"kv_cache_memory (--kv-cache-memory): {format_bytes(n)} is more than this machine's memory "
                f"(MemTotal {format_bytes(total)}, MemAvailable {format_bytes(avail or 0)} in /proc/meminfo); "
                f"use at most {format_bytes(avail or total)} (what is free now), e.g. {fit // 1024**2}MiB, "
                f"or leave it unset to size the cache from free memory")
        if avail and n > avail:
            logging.getLogger("pagedllm").warning(
                "pagedllm: kv_cache_memory %s is more than the memory available now (MemAvailable %s): "
                "the cache's pages are committed as they are written, and filling it would swap or "
                "exhaust memory", format_bytes(n), format_bytes(avail))
        return n

    @property
    def world_size(self) -> int:
        """Ranks of one engine replica: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
    speculative_config: Optional[Any] = None
    kv_transfer_config: Optional[Any] = None
    kv_offloading_size: Optional[float] = None
    kv_offloading_backend: Optional[str] = None
    kv_cache_dir: Optional[str] = None
    kv_cache_dir_size: Optional[float] = None

    def lora_limits(self) -> tuple[int, int, int]:
        """``(max_loras, max_lora_rank, max_cpu_loras)`` checked (``enable_lora`` engines).

        Raises:
            ValueError: a limit below 1, or ``max_cpu_loras < max_loras`` (naming the field).
        """
        max_cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        for name, v in (("max_loras", self.max_loras), ("max_lora_rank", self.max_lora_rank),
                        ("max_cpu_loras", max_cpu)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if max_cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got {max_cpu}")
        return self.max_loras, self.max_lora_rank, max_cpu

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
