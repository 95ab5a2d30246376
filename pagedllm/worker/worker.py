"""One device's share of the model: load (its shard of) the weights, quantize, prepack, size the
KV cache, build the model runner and capture graphs; then run the scheduler's steps.

An executor (``pagedllm.executor``) owns one ``Worker`` per rank and is the only thing that calls
it: in-process for one rank (``UniProcExecutor``), in a spawned process or a Ray actor otherwise.
The call order is ``init_device -> load_model -> determine_available_memory / get_kv_cache_spec
-> initialize_cache -> execute_model ...``.
"""
from __future__ import annotations

import gc
import linecache
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs, apply_hf_overrides, parse_bytes
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.metrics.memory import format_bytes as fmt_bytes

logger = logging.getLogger("pagedllm")


@dataclass
class KVCacheSpec:
    """One rank's per-layer KV cache shape.

    Attributes:
        num_layers: KV caches on this rank (its pipeline stage's attention layers).
        num_kv_heads: KV heads per cache on this rank (its tensor-parallel share).
        head_dim: D.
        dtype: the cache's torch dtype.
        extra_bytes_per_token: bytes per token of caches that share the block tables (a
            speculative draft model's), counted in the budget.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    extra_bytes_per_token: int = 0

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token takes over this rank's layers (and the draft's)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem + self.extra_bytes_per_token


@dataclass
class ModelInfo:
    """What the engine needs to know about the loaded model (front end and scheduler).

    Attributes:
        loaded: the ``LoadedModel`` (hf_config, tokenizer, generation_config, model_path, source),
            or None from a rank that does not hold the tokenizer.
        dtype, kv_cache_dtype, device: resolved torch values.
        vocab_size: logits width; eos_token_id: from the tokenizer, else the config (or None).
        weight_bytes: resident weight bytes on this rank (after quantization and prepacking).
        load_seconds: wall time of this rank's ``load_model``.
        weight_file_bytes: bytes of the checkpoint files the weights were read from (0: dummy).
        weight_mapped_bytes: of ``weight_bytes``, what is served from the mapped cache file
            (``loader.mapped_weights``; file-backed pages), 0 when nothing is mapped.
        weight_mapped_path: that cache file, or None.
    """

    loaded: Any
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    device: torch.device
    vocab_size: int
    eos_token_id: Optional[int]
    weight_bytes: int
    load_seconds: float
    weight_file_bytes: int = 0
    weight_mapped_bytes: int = 0
    weight_mapped_path: Optional[str] = None


def eos_token_id(tokenizer: Any, hf_config: Any) -> Optional[int]:
    """The EOS id from the tokenizer, else the config (the first of a list), else None."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


def load_model_info(args: EngineArgs):
    """Config and tokenizer of ``args.model`` without reading its weights (for an engine whose
    ranks run elsewhere): a ``LoadedModel``."""
    from pagedllm.loader import load_model
    from pagedllm.loader.model_loader import hub_kwargs
    from pagedllm.platforms import resolve_device, resolve_dtype

    dtype = resolve_dtype(args.dtype, resolve_device(args.device))
    loaded = load_model(args.model, dtype=dtype, tokenizer=args.tokenizer,
                        ignore_patterns=args.ignore_patterns or None, quantization=args.quantization,
                        **hub_kwargs(args))
    if args.hf_overrides is not None:
        loaded.hf_config = apply_hf_overrides(loaded.hf_config, args.hf_overrides)
    return loaded


class Worker:
    """One rank of an engine replica.

    Args:
        args: EngineArgs.
        rank: this rank in the replica, ``pp_rank * tensor_parallel_size + tp_rank``.
        distributed_init_method: ``torch.distributed`` init URL (``tcp://host:port``) when the
            replica has more than one rank; None for a single rank.
        local_world_size: ranks sharing this machine (splits the default thread count).
        load_tokenizer: also load the tokenizer (the rank whose ``model_info`` the engine reads
            in-process).
    """

    def __init__(self, args: EngineArgs, rank: int = 0, distributed_init_method: Optional[str] = None,
                 local_world_size: int = 1, load_tokenizer: bool = True) -> None:
        self.args = args
        self.rank = rank
        self.tp_size = args.tensor_parallel_size
        self.pp_size = args.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        self.tp_rank = rank % self.tp_size
        self.pp_rank = rank // self.tp_size
        self.distributed_init_method = distributed_init_method
        self.local_world_size = local_world_size
        self.load_tokenizer = load_tokenizer
        self.model: Any = None
        self.runner: Any = None
        self.pooler: Any = None
        self.loaded: Any = None
        self.info: Optional[ModelInfo] = None
        self.batch_invariant = False  # set by load_model (EngineArgs.batch_invariant or the environment)
        self.draft_model: Any = None  # speculative decoding's draft model (method draft_model)
        self.lora_manager: Any = None  # pagedllm.lora.model_manager.LoRAModelManager (enable_lora)
        self.thread_controller: Any = None  # pagedllm.worker.cpu_threads.AdaptiveThreads (CPU, >1 thread)
        self._cache_shape: Optional[tuple[int, int]] = None  # (num_blocks, max_model_len) of initialize_cache
        self._sleep: dict = {}  # sleep mode: tag -> what wake_up restores (pagedllm.worker.sleep)
        self._sleep_level = 0

    @property
    def is_output_rank(self) -> bool:
        """The rank whose ``execute_model`` result the engine reads: TP rank 0 of the last stage."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1

    # ------------------------------------------------------------------ start-up
    def init_device(self) -> None:
        """Threads, seed, device, dtype, the CPU allocator and (several ranks) the process groups."""
        from pagedllm.platforms import default_num_threads, resolve_device, resolve_dtype, resolve_kv_cache_dtype

        args = self.args
        n = args.num_threads or default_num_threads()
        if args.num_threads is None and self.local_world_size > 1 and not _threads_from_env():
            n = max(1, n // self.local_world_size)  # NOTE: ranks on one machine share its cores
        torch.set_num_threads(n)
        torch.manual_seed(args.seed)
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and (self.world_size > 1 or args.data_parallel_size > 1):
            index = args.data_parallel_rank * self.world_size + self.rank  # one GPU per rank of every replica
            self.device = torch.device("cuda", index % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        if self.device.type == "cpu":
            from pagedllm.kernels.cpu_ops import install_cpu_allocator
            from pagedllm.worker.cpu_threads import make_thread_controller
            install_cpu_allocator()  # before the weights and KV cache are allocated
            # NOTE: the team shrinks while other processes hold cores (cpu_threads.py: a busy
            # neighbour otherwise stalls every parallel region of a step)
            self.thread_controller = make_thread_controller(n)
        from pagedllm.worker.batch_invariant import batch_invariant_requested
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype, self.device, args.dtype,
                                                     batch_invariant_requested(args))
        if self.world_size > 1:
            from pagedllm.distributed.parallel_state import init_distributed

            init_distributed(self.world_size, self.rank, self.distributed_init_method, self.tp_size,
                             self.pp_size, self.device)

    def load_model(self) -> ModelInfo:
        """Build this rank's model (``loader.model_loader.build_model``: its ordered steps), then
        the speculative draft, which needs the finished target.

        Raises:
            ValueError: unknown model / bad settings, a checkpoint that does not fit the model,
                or a model this tensor/pipeline split cannot take.
        """
        from pagedllm.loader.model_loader import ParallelSetup, build_model, checkpoint_bytes

        t0 = time.perf_counter()
        parallel = ParallelSetup(self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)
        b = build_model(self.args, parallel, self.device, self.dtype, self.kv_cache_dtype, self.load_tokenizer)
        self.loaded, self.model, self.pooler, self.batch_invariant = b.loaded, b.model, b.pooler, b.batch_invariant
        self.mapped_weights, self.lora_manager = b.mapped_weights, b.lora_manager
        hf_config, weight_bytes = b.loaded.hf_config, b.weight_bytes
        if self.args.speculative_config is not None:
            weight_bytes += self._load_draft_model(int(hf_config.vocab_size))
        self.info = ModelInfo(
            loaded=b.loaded, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, device=self.device,
            vocab_size=int(hf_config.vocab_size), eos_token_id=eos_token_id(b.loaded.tokenizer, hf_config),
            weight_bytes=weight_bytes, load_seconds=time.perf_counter() - t0,
            weight_file_bytes=checkpoint_bytes(b.loaded), weight_mapped_bytes=self.mapped_weights.mapped_bytes,
            weight_mapped_path=self.mapped_weights.path)
        return self.info

    def _load_draft_model(self, vocab_size: int) -> int:
        """Load the draft model of ``speculative_config`` (method "draft_model": its own path,
        or the target's with ``quantization`` for a self-draft) through a second Worker on this
        device; returns its weight bytes (0 for other methods).

        Raises:
            ValueError: a draft whose vocabulary differs from the target's, or several ranks.
        """
        import dataclasses

        from pagedllm.spec_decode.config import SpeculativeConfig
        from pagedllm.spec_decode.registry import DRAFT_HEAD, DRAFT_NONE, get_proposer_kind

        cfg = SpeculativeConfig.from_any(self.args.speculative_config)
        kind = get_proposer_kind(cfg.method)
        if kind.draft == DRAFT_NONE:
            return 0
        if self.world_size > 1:
            raise ValueError(f"speculative_config: method {cfg.method!r} runs on one rank "
                             "(tensor_parallel_size = pipeline_parallel_size = 1)")
        if kind.draft == DRAFT_HEAD:
            # NOTE: a head proposes from the target's hidden states (LoRA applied when the
            # request has an adapter); the target verifies every token.
            self.draft_model = kind.load_head(cfg.model, self.model, self.dtype).to(self.device)
            return sum(p.numel() * p.element_size() for p in self.draft_model.parameters())
        # NOTE: the draft runs without LoRA adapters (a draft only proposes; the target, adapters
        # applied, verifies every token)
        dargs = dataclasses.replace(self.args, model=cfg.model, quantization=cfg.quantization, tokenizer=None,
                                    speculative_config=None, hf_overrides=None, runner="generate",
                                    enable_lora=False)
        w = Worker(dargs, load_tokenizer=False)
        w.device, w.dtype, w.kv_cache_dtype = self.device, self.dtype, self.kv_cache_dtype
        info = w.load_model()
        if info.vocab_size != vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {info.vocab_size} tokens, "
                             f"the target's {vocab_size}; a draft model must share the target's tokenizer")
        self.draft_model = w.model
        logger.info("pagedllm: speculative draft model %s%s loaded: weights %s", cfg.model,
                    f" ({cfg.quantization})" if cfg.quantization else "", fmt_bytes(info.weight_bytes))
        return info.weight_bytes

    def add_lora(self, lora_request: Any) -> bool | str:
        """Load an adapter into this rank's CPU cache (``LoRAModelManager.add_adapter``): True
        when it was read from disk, False when it was cached, or the error message (str) of an
        adapter that cannot be loaded (returned, not raised: the engine raises it, and a raising
        RPC would mark a multi-process executor dead).

        Raises:
            ValueError: LoRA not enabled on this engine.
        """
        from pagedllm.lora.peft_loader import LoRAAdapterError

        if self.lora_manager is None:
            raise ValueError("lora_request: LoRA is not enabled (start the engine with enable_lora=True / --enable-lora)")
        try:
            return self.lora_manager.add_adapter(lora_request)
        except LoRAAdapterError as e:
            return str(e)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from this rank's CPU cache and slot table; True when it was held."""
        return self.lora_manager.remove_adapter(lora_int_id) if self.lora_manager is not None else False

    def list_loras(self) -> list[int]:
        """Adapter ids in this rank's CPU cache (least recently used first)."""
        return self.lora_manager.list_adapters() if self.lora_manager is not None else []

    def lora_stats(self) -> dict:
        """This rank's ``LoRAModelManager.stats()`` ({} without LoRA)."""
        return self.lora_manager.stats() if self.lora_manager is not None else {}

    def model_info(self, with_loaded: bool = True) -> ModelInfo:
        """The ``ModelInfo`` of ``load_model``; ``with_loaded=False`` leaves out the
        ``LoadedModel`` (not picklable: it holds a weight iterator factory)."""
        if with_loaded:
            return self.info
        import dataclasses
        return dataclasses.replace(self.info, loaded=None)

    def get_pooler(self) -> Any:
        """The pooler (``runner="pooling"``), or None: the front end validates pooling params with it."""
        return self.pooler

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """This rank's KV cache shape (its layers, its share of the KV heads)."""
        num_layers, num_kv_heads, head_dim = self.model.get_kv_cache_spec()
        if self.world_size > 1:
            from pagedllm.distributed.sharding import local_kv_cache_spec
            num_layers, num_kv_heads, head_dim = local_kv_cache_spec(self.model)
        extra = 0
        if self.draft_model is not None and hasattr(self.draft_model, "get_kv_cache_spec"):  # MTP: none
            extra = KVCacheSpec(*self.draft_model.get_kv_cache_spec(), self.kv_cache_dtype).bytes_per_token
        return KVCacheSpec(num_layers, num_kv_heads, head_dim, self.kv_cache_dtype, extra)

    def determine_available_memory(self) -> int:
        """Bytes this rank may spend on its KV cache: ``kv_cache_memory`` when given, else on
        CUDA what a profiling forward leaves of ``gpu_memory_utilization``, else on CPU a share of
        the free memory (``_kv_bytes_from_free_memory``) capped by ``_kv_bytes_usable``.

        Raises:
            ValueError: an unparsable ``kv_cache_memory``, or no GPU memory left for the cache.
        """
        args = self.args
        if args.kv_cache_memory is not None:
            try:
                return parse_bytes(args.kv_cache_memory)
            except ValueError as e:
                raise ValueError(f"kv_cache_memory: {e}") from None
        if self.device.type == "cuda":
            return self._profile_gpu_kv_bytes()
        return min(self._kv_bytes_from_free_memory(), self._kv_bytes_usable())

    def _kv_bytes_from_free_memory(self) -> int:
        """The CPU default budget: ``KV_AUTO_MEMORY_FRACTION`` of MemAvailable (/proc/meminfo, read
        after this rank's weights are loaded), split evenly between the ranks of this machine and
        the data-parallel replicas (assumed on this machine too); DEFAULT_CPU_KV_CACHE_BYTES where
        /proc/meminfo is unavailable."""
        from pagedllm.config import KV_AUTO_MEMORY_FRACTION
        from pagedllm.metrics.memory import read_meminfo

        avail = read_meminfo().get("MemAvailable")
        if not avail:
            return DEFAULT_CPU_KV_CACHE_BYTES
        sharers = max(1, self.local_world_size) * max(1, int(self.args.data_parallel_size))
        kv = int(avail * KV_AUTO_MEMORY_FRACTION) // sharers
        logger.info("pagedllm: KV cache budget from free memory: %.0f%% of MemAvailable %s%s = %s (at most "
                    "what max_num_seqs x max_model_len tokens fill)", 100 * KV_AUTO_MEMORY_FRACTION,
                    fmt_bytes(avail), f" / {sharers} ranks" if sharers > 1 else "", fmt_bytes(kv))
        return kv

    def _kv_bytes_usable(self) -> int:
        """KV bytes that ``max_num_seqs`` requests of ``max_model_len`` tokens can fill (the
        model's context length when ``max_model_len`` is unset), plus the null block: a default
        cache larger than this would never be used."""
        args = self.args
        mml = args.max_model_len or int(getattr(self.info.loaded.hf_config, "max_position_embeddings", 0) or 0)
        if mml <= 0:
            return self._kv_bytes_from_free_memory()
        blocks = args.max_num_seqs * -(-int(mml) // args.block_size) + 1
        return blocks * args.block_size * self.get_kv_cache_spec().bytes_per_token

    def _profile_gpu_kv_bytes(self) -> int:
        """KV bytes on CUDA: ``gpu_memory_utilization`` x total memory minus weights and the peak
        activations of a dummy forward over ``max_num_batched_tokens`` tokens (vLLM's method)."""
        from pagedllm.attention.backend import ForwardContext, set_forward_context
        from pagedllm.attention.torch_paged import TorchPagedAttention

        args, model = self.args, self.model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = args.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        with torch.inference_mode(), set_forward_context(
                ForwardContext(None, [], TorchPagedAttention(use_cpu_kernel=False))):
            hidden = model(ids, pos)
            model.compute_logits(hidden[-min(n, args.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        if self.lora_manager is not None:  # NOTE: the adapter slots are filled later, on demand
            peak += self.lora_manager.max_device_bytes()
        total = torch.cuda.get_device_properties(self.device).total_memory
        kv = int(total * args.gpu_memory_utilization - peak)
        logger.info("pagedllm: GPU memory %s total x %.2f; peak with weights + activations %s; KV cache %s",
                    fmt_bytes(total), args.gpu_memory_utilization, fmt_bytes(peak), fmt_bytes(max(kv, 0)))
        if kv <= 0:
            raise ValueError(
                f"gpu_memory_utilization: {args.gpu_memory_utilization} leaves no memory for the KV cache "
                f"(weights + activations peak at {fmt_bytes(peak)} of {fmt_bytes(total)})")
        return kv

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate ``num_blocks`` KV blocks per layer, build the runner, reserve rope tables and
        capture CUDA graphs (CUDA, one rank, not ``enforce_eager``)."""
        from pagedllm.attention.selector import get_attn_backend
        from pagedllm.worker.model_runner import ModelRunner

        from pagedllm.models.rope import set_rope_max_model_len

        args = self.args
        self._cache_shape = (num_blocks, max_model_len)
        set_rope_max_model_len(self.model, max_model_len)  # longrope: long factors iff max_model_len > original (vLLM)
        spec = self.get_kv_cache_spec()
        if self.batch_invariant:
            from pagedllm.attention.batch_invariant import BatchInvariantAttention
            attn_impl = BatchInvariantAttention()
        else:
            attn_impl = get_attn_backend(self.device, args.attention_backend)
        spec_decoder = self._build_spec_decoder(num_blocks, attn_impl)
        self.runner = ModelRunner(self.model, num_blocks, args.block_size,
                                  (spec.num_layers, spec.num_kv_heads, spec.head_dim), self.dtype,
                                  self.info.vocab_size, self.device, attn_impl=attn_impl, pooler=self.pooler,
                                  eos_token_id=self.info.eos_token_id, kv_cache_dtype=self.kv_cache_dtype,
                                  spec_decoder=spec_decoder, max_model_len=max_model_len,
                                  lora_manager=self.lora_manager)
        self._build_decode_accelerators()  # NOTE: after the spec decoder, whose hooks rule it out
        _size_encoder_cache(self.runner, args)
        if spec_decoder is not None and hasattr(spec_decoder.proposer, "bind"):
            spec_decoder.proposer.bind(self.runner.kv_caches)  # MTP reads the target's caches
        if self.device.type != "cpu":
            from pagedllm.models.layers import reserve_rope_tables
            # NOTE: full-size rope tables now: no per-step position check (a device sync) and a
            # fixed table address for the CUDA graphs.
            reserve_rope_tables(self.model, max_model_len, self.device)
        # NOTE: a proposer reading activations through forward hooks (EAGLE-3) rules out graphs,
        # which do not run hooks on replay.
        from pagedllm.spec_decode.registry import get_proposer_kind
        no_graphs = spec_decoder is not None and not get_proposer_kind(spec_decoder.config.method).cuda_graphs
        if self.device.type == "cuda" and not args.enforce_eager and self.world_size == 1 and not no_graphs:
            secs = self.runner.capture_cuda_graphs(args.max_num_seqs, max_model_len)
            logger.info("pagedllm: captured decode CUDA graphs in %.2f s", secs)
        self.release_idle_memory()  # what loading left behind: dequantized tensors, file buffers

    def release_idle_memory(self) -> int:
        """Give memory this rank holds but is not using back to the OS: unreachable Python
        objects (``gc.collect``), the caching CPU allocator's free blocks and glibc's free heap.
        Called after start-up and by a server that has been idle a while; the next busy step
        re-faults what it needs (~0.4 s/GB).

        Returns:
            bytes of resident memory released (this process's RSS before minus after).
        """
        from pagedllm.metrics.memory import resident_memory_bytes
        from pagedllm.platforms import trim_heap

        before = resident_memory_bytes()
        # NOTE: the start-up heap is frozen and young collections are rare while serving
        # (engine.gc_tuning), so the requests' cyclic garbage waits for a full collection; this
        # one walks only what was allocated since start-up (issue 30.4).
        gc.collect()
        if self.device.type == "cpu":
            from pagedllm.kernels.cpu_ops import cpu_allocator_empty_cache
            cpu_allocator_empty_cache()
        # NOTE: source lines that start-up's tracebacks / inspect calls (torch's op registration)
        # read into linecache, ~27k lines (2.8 MiB) for SmolLM2; a later traceback re-reads them.
        linecache.clearcache()
        trim_heap()
        return max(0, before - resident_memory_bytes())

    def kv_caches(self) -> list[torch.Tensor]:
        """Every KV cache tensor of this rank that the block tables index: the runner's, and a
        model-based speculative proposer's (draft model, EAGLE head)."""
        if self.runner is None:
            return []
        caches = list(self.runner.kv_caches)
        sd = self.runner.spec_decoder
        if sd is not None:
            caches += list(getattr(sd.proposer, "kv_caches", None) or [])
        return caches

    def release_kv_blocks(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Give the pages of the KV blocks in ``runs`` (``[b0, b1)`` ranges of block ids whose
        contents are not needed: free blocks, the null block) back to the OS, in every cache of
        this rank (``pagedllm.worker.kv_memory.release_kv_ranges``: madvise(2) MADV_DONTNEED on
        whole pages; nothing on CUDA).

        Returns:
            ranges of the blocks that lost at least one page (their contents now read as zeros).
        """
        from pagedllm.worker.kv_memory import release_kv_ranges

        return release_kv_ranges(self.kv_caches(), [tuple(r) for r in runs])

    def kv_resident_bytes(self) -> int:
        """Resident bytes of this rank's lazily committed KV caches (their mappings' Rss in
        /proc/self/smaps); 0 on CUDA. For tests and diagnostics."""
        from pagedllm.worker.kv_memory import kv_resident_bytes

        return kv_resident_bytes(self.kv_caches())

    def _build_spec_decoder(self, num_blocks: int, attn_impl: Any) -> Any:
        """The runner's ``SpecDecoder`` (``speculative_config``), or None."""
        if self.args.speculative_config is None:
            return None
        from pagedllm.spec_decode.config import SpeculativeConfig
        from pagedllm.spec_decode.registry import ProposerContext
        from pagedllm.worker.spec_decoder import SpecDecoder, build_proposer

        cfg = SpeculativeConfig.from_any(self.args.speculative_config)
        ctx = ProposerContext(draft_model=self.draft_model, target=self.model, num_blocks=num_blocks,
                              block_size=self.args.block_size, kv_cache_dtype=self.kv_cache_dtype,
                              device=self.device, attn_impl=attn_impl)
        return SpecDecoder(cfg, build_proposer(cfg, ctx))

    def _build_decode_accelerators(self) -> None:
        """The fused CPU decode step (``worker.fused_decode``) of the runner's model and of a draft
        model's proposer: built once from the finished models, eligibility logged."""
        from pagedllm.worker.fused_decode import build_decode_accelerator

        self.runner.decode_accelerator = build_decode_accelerator(
            self.model, sharded=self.world_size > 1, batch_invariant=self.batch_invariant)
        proposer = getattr(self.runner.spec_decoder, "proposer", None)
        if proposer is not None and hasattr(proposer, "decode_accelerator"):
            proposer.decode_accelerator = build_decode_accelerator(proposer.model, name="draft model")

    def _drop_decode_accelerators(self) -> None:
        """Drop the fused decode steps' operand lists (they hold the oneDNN-packed weights that
        sleep frees and wake re-packs as new tensors)."""
        self.runner.decode_accelerator = None
        proposer = getattr(self.runner.spec_decoder, "proposer", None)
        if proposer is not None and hasattr(proposer, "decode_accelerator"):
            proposer.decode_accelerator = None

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int) -> int:
        """Sleep mode (``pagedllm.worker.sleep``): free the weights (level 1: a copy goes to a
        temporary file first; level 2: no copy, ``wake_up`` reloads the checkpoint) and the KV
        caches allocated up front (lazily committed ones are released page by page by the engine
        core through ``release_kv_blocks`` before this call). A no-op when already asleep.

        Returns:
            ``(resident bytes released (this process's RSS before minus after), bytes of the
            level-1 copy in its temporary file)``.

        Raises:
            ValueError: a level other than 1 or 2.
            OSError: the level-1 copy cannot be written (nothing is freed then).
        """
        from pagedllm.metrics.memory import resident_memory_bytes
        from pagedllm.worker import sleep as S

        level = S.check_level(level)
        if self._sleep:
            return 0, 0
        before = resident_memory_bytes()
        mods = [self.model, self.draft_model]
        if self.runner is not None:
            self._drop_decode_accelerators()
        extra = [] if self.pooler is None else [t for t in vars(self.pooler).values() if isinstance(t, torch.Tensor)]
        self._sleep["weights"] = S.offload(mods, level, extra)
        self._sleep["kv_cache"] = S.free_eager_kv(self.kv_caches())
        self._sleep_level = level
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.release_idle_memory()
        backup = self._sleep["weights"].nbytes if level == 1 else 0
        return max(0, before - resident_memory_bytes()), backup

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Undo ``sleep`` for ``tags`` ("weights", "kv_cache"; None = both): level 1 reads the
        weights back into the same tensors (bit-identical), level 2 reloads the checkpoint and
        rebuilds the runner (``load_model`` + ``initialize_cache``: a fresh, empty KV cache, and
        LoRA adapters loaded again on first use). Tags not asleep are ignored.

        Raises:
            ValueError: an unknown tag.
        """
        from pagedllm.worker import sleep as S

        tags = S.check_tags(tags)
        if "weights" in tags and "weights" in self._sleep:
            state = self._sleep.pop("weights")
            if self._sleep_level == 1:
                S.restore(state)
                if self.runner is not None:
                    self._build_decode_accelerators()
            else:
                # NOTE: the old model's storages are already freed; the rebuild replaces the model,
                # its runner (and KV caches), the pooler, draft model and LoRA wrappers.
                self._sleep.pop("kv_cache", None)
                self.model = self.runner = self.pooler = self.draft_model = self.lora_manager = None
                del state
                gc.collect()
                self.load_model()
                self.initialize_cache(*self._cache_shape)
                if getattr(self, "kv_connector", None) is not None:  # the caches are new tensors
                    self.kv_connector.register_kv_caches({f"model.layers.{i}.self_attn": c
                                                          for i, c in enumerate(self.runner.kv_caches)})
        if "kv_cache" in tags and "kv_cache" in self._sleep:
            S.restore_eager_kv(self._sleep.pop("kv_cache"))
        if not self._sleep:
            self._sleep_level = 0

    def is_sleeping(self) -> list[str]:
        """The tags asleep on this rank ("weights", "kv_cache")."""
        return sorted(self._sleep)

    def init_kv_connector(self, config: Any, layout: Any) -> None:
        """Build the worker side of the KV connector and register this rank's KV caches with it
        (after ``initialize_cache``)."""
        from pagedllm.distributed.kv_transfer.base import KVConnectorRole
        from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

        self.kv_connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, layout)
        self.kv_connector.register_kv_caches({f"model.layers.{i}.self_attn": c
                                              for i, c in enumerate(self.runner.kv_caches)})

    # ------------------------------------------------------------------ steps
    def execute_model(self, so: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """Run one step; the runner's output on the output rank, None on the others. With a KV
        connector, its loads and saves for the step run around the forward (``start_load_kv``
        before, ``wait_for_save`` after) and its report rides on ``kv_connector_output``."""
        if self.thread_controller is not None:
            self.thread_controller.step()
        conn = getattr(self, "kv_connector", None)
        if conn is None or so.kv_connector_metadata is None:
            out = self.runner.execute(so)
            self._trim_workspace(so)
            return out if self.is_output_rank else None
        conn.bind_connector_metadata(so.kv_connector_metadata)
        conn.start_load_kv(None)
        try:
            out = self.runner.execute(so)
            conn.wait_for_save()
            out.kv_connector_output = conn.get_connector_output()
        finally:
            conn.clear_connector_metadata()
        self._trim_workspace(so)
        return out if self.is_output_rank else None

    def trim_workspace(self) -> int:
        """Give the last steps' freed workspace back now (CPU; a server calls this when its batch
        empties): all of the caching allocator's free blocks (no decode step is running to reuse
        them; the next request re-faults its own, a few MiB for a decode step) and glibc's free
        heap, after a garbage collection. Cheaper than ``release_idle_memory`` (KV pages stay).
        Returns resident bytes released (RSS before minus after)."""
        if self.device.type != "cpu":
            return 0
        from pagedllm.metrics.memory import WorkspaceTrimmer, resident_memory_bytes

        before = resident_memory_bytes()
        gc.collect()  # the burst's cyclic garbage (see release_idle_memory), before glibc's trim
        trimmer = getattr(self, "workspace_trimmer", None)
        if trimmer is None:
            trimmer = self.workspace_trimmer = WorkspaceTrimmer()
        trimmer.trim(keep_bytes=0)
        trimmer.dirty = False
        return max(0, before - resident_memory_bytes())

    def _trim_workspace(self, so: SchedulerOutput) -> None:
        """CPU: after the first decode-sized step that follows a prefill chunk, give the chunk's
        freed workspace back (``pagedllm.metrics.memory.WorkspaceTrimmer``: allocator cache down to
        32 MiB, glibc heap trimmed), so a long prompt does not leave it resident."""
        if self.device.type != "cpu":
            return
        trimmer = getattr(self, "workspace_trimmer", None)
        if trimmer is None:
            from pagedllm.metrics.memory import WorkspaceTrimmer
            trimmer = self.workspace_trimmer = WorkspaceTrimmer()
        trimmer.step(so.total_num_scheduled_tokens, so.num_reqs)  # (num_reqs: builds no ScheduledRequest)

    def check_health(self) -> None:
        """Nothing to check in-process (a dead rank is the executor's to detect)."""

    def shutdown(self) -> None:
        """Leave the process groups (several ranks)."""
        if self.world_size > 1:
            from pagedllm.distributed.parallel_state import destroy_distributed
            destroy_distributed()


def _threads_from_env() -> bool:
    return any((os.environ.get(v) or "").isdigit() for v in ("PAGEDLLM_NUM_THREADS", "OMP_NUM_THREADS"))


def _size_encoder_cache(runner, args) -> None:
    """Bound the runner's encoder cache (image-text models) by ``args.encoder_cache_size`` tokens."""
    size = getattr(args, "encoder_cache_size", None)
    if runner.encoder_cache is not None and size is not None:
        runner.encoder_cache.capacity = int(size)
