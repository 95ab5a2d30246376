"""Every environment variable pagedllm reads, declared once: name, type, default and meaning.

Read a value with ``envs.get("PAGEDLLM_KV_LAZY")`` or as an attribute (``envs.PAGEDLLM_KV_LAZY``,
as in vLLM's ``vllm.envs``); it is read from ``os.environ`` at that moment (not cached at import),
parsed to its type, and an unset or empty variable gives its default. A value that does not
parse is a ``ValueError`` naming the variable. ``python -m pagedllm.envs`` prints the table that
``docs/environment.md`` holds (a test keeps the two equal, and checks that every
``PAGEDLLM_*`` name the package reads from the environment is declared here).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable.

    Attributes:
        name: the variable's name.
        type: ``bool`` ("1"/"true"/"yes"/"on" or "0"/"false"/"no"/"off"), ``int``, ``float``,
            ``str``, ``bytes`` (a size: ``512MiB``, ``1.5G``, a plain number of bytes) or
            ``choice`` (one of ``choices``, lowercased).
        default: the value when unset or empty (already of the type; None = unset).
        doc: what it does (one or two sentences, user-facing).
        choices: the allowed values of a ``choice``.
        aliases: other names read when ``name`` is unset (vLLM's, for drop-in use), first wins.
        internal: set by pagedllm itself for its own child processes (not for users).
    """
    name: str
    type: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    internal: bool = False


def _v(name: str, type_: str, default: Any, doc: str, **kw: Any) -> EnvVar:
    return EnvVar(name, type_, default, doc, **kw)


#: Declared variables, in the order of docs/environment.md.
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    # Threads and CPU kernels
    _v("PAGEDLLM_NUM_THREADS", "int", None,
       "Engine compute threads when --num-threads is not given (then OMP_NUM_THREADS, then all cores)."),
    _v("PAGEDLLM_THREAD_POLICY", "choice", "adaptive",
       "adaptive: run one thread fewer while another process keeps a core busy; fixed: keep the count.",
       choices=("adaptive", "fixed")),
    _v("PAGEDLLM_CPU_KERNELS", "bool", True,
       "0 skips the C++ CPU kernels (pure-torch path, ~11x slower; for debugging)."),
    _v("PAGEDLLM_CACHE_DIR", "str", None,
       "Cache directory (compiled kernels, converted models); default ~/.cache/pagedllm."),
    _v("PAGEDLLM_FUSED_DECODE", "bool", True,
       "0 turns off the fused decode step (all decoder layers of a decode-only step in one C++ call)."),
    _v("PAGEDLLM_GGUF_INTDOT", "bool", True,
       "GGUF int4/int8 group-32 layers and the tied LM head run the integer-dot kernel (int8 activations "
       "per 32-block, as llama.cpp); 0 runs the float-activation group GEMM instead (near-tie greedy answers "
       "can differ between the two)."),
    _v("PAGEDLLM_GGUF_INTDOT_MAX_M", "int", 1 << 62,
       "Rows per call up to which GGUF layers take the integer-dot kernel (default: every M)."),
    _v("PAGEDLLM_ONEDNN_FLOAT32", "choice", "auto",
       "float32 linears on CPU run oneDNN's GEMM on weights packed once at load (instead of F.linear, whose "
       "MKL sgemm packs them on every call): auto = on CPUs with AVX-512, 1 / 0 force it.",
       choices=("auto", "1", "0")),
    _v("PAGEDLLM_ISA", "choice", "auto",
       "ISA path of the integer-dot kernel: auto (the best this CPU has), portable, avx2 or avx512vnni "
       "(a path the CPU lacks is an error).", choices=("auto", "portable", "avx2", "avx512vnni")),
    _v("PAGEDLLM_DECODE_GENERIC", "bool", False,
       "1 runs CPU decode attention on the per-head loop even where the grouped kernel applies (float32 q "
       "on AVX2; read once by the C++ kernel, for A/B runs)."),
    _v("PAGEDLLM_DECODE_PER_HEAD", "choice", "auto",
       "How CPU decode attention splits work: auto = whole requests per thread when a step's distinct K/V "
       "exceed 1 MiB per layer and most rows have a context of their own (else per (request, kv head)), "
       "1 = always per (request, kv head), 0 = always request-wise (read on every call by the C++ kernel, "
       "for A/B runs and tests).", choices=("auto", "1", "0")),
    _v("PAGEDLLM_GROUP_GEMM_LARGE_M", "int", 16,
       "Rows above which the quantized-weight GEMM dequantizes tiles for ATen's GEMM."),
    _v("PAGEDLLM_W8A8_PACKED_MAX_M", "int", 256,
       "Rows up to which W8A8 uses the packed VNNI int8 GEMM (0 = always oneDNN)."),
    _v("PAGEDLLM_W8A8_NK_GEMM", "bool", True,
       "0 runs W8A8's int8 GEMM through torch._int_mm on CPUs without AVX512-VNNI instead of the AVX2 kernel "
       "(ATen's reference loop there; for A/B runs)."),
    _v("PAGEDLLM_BATCH_INVARIANT", "bool", False,
       "1 makes every kernel batch invariant (as --batch-invariant).", aliases=("VLLM_BATCH_INVARIANT",)),
    _v("PAGEDLLM_ATTENTION_BACKEND", "choice", None,
       "Attention backend: torch, triton or flashinfer (default: triton on CUDA when installed, else torch).",
       choices=("torch", "triton", "flashinfer")),
    # Memory
    _v("PAGEDLLM_GC_FREEZE", "bool", True,
       "0 keeps the start-up heap in the garbage collector's view; by default the first engine of a process "
       "freezes it (gc.freeze) after start-up and raises the generation-0 threshold (PAGEDLLM_GC_THRESHOLD) "
       "until it shuts down."),
    _v("PAGEDLLM_GC_THRESHOLD", "int", 10000,
       "Generation-0 threshold of the garbage collector while an engine serves (PAGEDLLM_GC_FREEZE on, Python's "
       "default thresholds not changed by the process); 0 keeps Python's 700."),
    _v("PAGEDLLM_KV_LAZY", "bool", True,
       "0 allocates and touches the whole CPU KV cache at start-up instead of committing pages on use."),
    _v("PAGEDLLM_IDLE_RELEASE_S", "float", 10.0,
       "Idle seconds after which free allocator blocks, free KV pages and glibc's heap go back to the OS "
       "(0 = never)."),
    _v("PAGEDLLM_STRUCTURED_OUTPUTS_PREWARM", "bool", False,
       "1 builds the grammar backend's tokenizer tables at server start-up (first constrained request "
       "faster; Gemma 3: +173 MiB resident whether or not grammars are used)."),
    _v("PAGEDLLM_SLEEP_DIR", "str", None,
       "Directory of the temporary file level-1 sleep writes the weights to (default: TMPDIR, else /tmp)."),
    _v("PAGEDLLM_CPU_ALLOCATOR", "bool", True, "0 keeps torch's CPU allocator instead of pagedllm's caching one."),
    _v("PAGEDLLM_CPU_ALLOCATOR_CACHE", "bytes", 1 << 30,
       "Most free blocks the caching CPU allocator keeps mapped (e.g. 512MiB)."),
    _v("PAGEDLLM_CPU_ALLOCATOR_HUGEPAGES", "bool", False,
       "1 asks for transparent huge pages for large CPU tensors."),
    _v("PAGEDLLM_WEIGHT_MMAP", "choice", "1",
       "1 serves a GGUF model's loaded weights from a mapped cache file (file-backed pages), all also "
       "safetensors models, 0 keeps anonymous copies.", choices=("1", "0", "all")),
    _v("PAGEDLLM_WEIGHT_CACHE_DIR", "str", None,
       "Directory of the mapped weight cache files (unset: $XDG_CACHE_HOME/pagedllm/weights, i.e. "
       "~/.cache/pagedllm/weights)."),
    _v("PAGEDLLM_WEIGHT_CACHE_MAX", "bytes", 4 << 30,
       "Most bytes of mapped weight cache files kept (least recently used deleted first; a larger "
       "model is not cached)."),
    # Serving
    _v("PAGEDLLM_API_KEY", "str", None, "Default of --api-key (unset = no authentication)."),
    _v("PAGEDLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "bool", True,
       "--kv-events-config: block hashes as the low 64 bits (unsigned int, vLLM's default); 0 sends "
       "the full hash bytes.", aliases=("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",)),
    _v("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "bool", False,
       "1 serves /v1/load_lora_adapter and /v1/unload_lora_adapter.",
       aliases=("VLLM_ALLOW_RUNTIME_LORA_UPDATING",)),
    _v("PAGEDLLM_HUB_CONNECT_TIMEOUT", "float", 3.0,
       "Seconds to wait for the Hugging Face Hub before a model id that is not cached fails."),
    _v("PAGEDLLM_DEBUG", "bool", False, "1 checks the scheduler's invariants after every step (slow)."),
    # Processes and distribution
    _v("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S", "float", 300.0,
       "Seconds a worker process or Ray actor may take for one step before the engine is declared dead."),
    _v("PAGEDLLM_WORKER_STARTUP_TIMEOUT_S", "float", 1800.0,
       "Seconds worker processes may take to start and load the model."),
    _v("PAGEDLLM_WORKER_HEARTBEAT_TIMEOUT_S", "float", 30.0,
       "Seconds without a worker heartbeat before it is declared dead."),
    _v("PAGEDLLM_WORKER_SHUTDOWN_TIMEOUT_S", "float", 5.0, "Seconds to wait for workers to exit at shutdown."),
    _v("PAGEDLLM_DIST_TIMEOUT_S", "float", 600.0, "Timeout of torch.distributed collectives, seconds."),
    _v("PAGEDLLM_RAY_OBJECT_STORE_BYTES", "int", 256 * 1024**2,
       "Object store size of a Ray instance started by pagedllm."),
    _v("PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S", "float", 120.0,
       "Seconds to wait for Ray to place the ranks' placement group."),
    _v("PAGEDLLM_WORKER_ADDRESS", "str", None, "Address of the engine for its worker processes.", internal=True),
    _v("PAGEDLLM_WORKER_AUTHKEY", "str", None, "Authentication key of the worker connection.", internal=True),
)}


def _parse(var: EnvVar, raw: str, source: str) -> Any:
    t = var.type
    try:
        if t == "bool":
            s = raw.strip().lower()
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
            raise ValueError(f"expected one of {_TRUE + _FALSE}")
        if t == "int":
            return int(raw.strip())
        if t == "float":
            return float(raw.strip())
        if t == "bytes":
            from pagedllm.config import parse_bytes
            return parse_bytes(raw)
        if t == "choice":
            s = raw.strip().lower()
            if s not in var.choices:
                raise ValueError(f"must be one of {list(var.choices)}")
            return s
        return raw
    except ValueError as e:
        raise ValueError(f"{source}: {raw!r} is not a valid value ({e})") from None


def get(name: str) -> Any:
    """The parsed value of the declared variable ``name`` (its aliases read when it is unset).

    Raises:
        KeyError: ``name`` is not declared in ``ENV_VARS``.
        ValueError: the value does not parse as the variable's type (the message names it).
    """
    var = ENV_VARS[name]
    for source in (var.name, *var.aliases):
        raw = os.environ.get(source)
        if raw is not None and raw.strip() != "":
            return _parse(var, raw, source)
    return var.default


def is_set(name: str) -> bool:
    """Whether ``name`` (or one of its aliases) is set to a non-empty value."""
    var = ENV_VARS[name]
    return any((os.environ.get(s) or "").strip() != "" for s in (var.name, *var.aliases))


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return get(name)
    raise AttributeError(f"module 'pagedllm.envs' has no attribute {name!r}")


def _fmt_default(var: EnvVar) -> str:
    d: Optional[Any] = var.default
    if d is None:
        return "unset"
    if var.type == "bool":
        return "1" if d else "0"
    if var.type == "bytes":
        from pagedllm.metrics.memory import format_bytes
        return format_bytes(int(d))
    return str(d)


def markdown_table() -> str:
    """The Markdown table of the user-facing variables (docs/environment.md)."""
    rows = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for var in ENV_VARS.values():
        if var.internal:
            continue
        t = var.type if var.type != "choice" else " / ".join(var.choices)
        alias = f" (also `{'`, `'.join(var.aliases)}`)" if var.aliases else ""
        rows.append(f"| `{var.name}`{alias} | {t} | {_fmt_default(var)} | {var.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
