"""The engine core: load the model, size the KV cache, and run the step loop.

``step()`` = ``scheduler.schedule()`` -> ``runner.execute()`` -> ``scheduler.update_from_output()``.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from pagedllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs, parse_bytes
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.metrics.memory import format_bytes as _fmt_bytes
from pagedllm.platforms import default_num_threads, resolve_device, resolve_dtype, resolve_kv_cache_dtype

logger = logging.getLogger("pagedllm")


class EngineCore:
    """Owns the model, KV cache, scheduler and runner.

    Args:
        args: EngineArgs.

    Raises:
        ValueError: unknown model / bad settings, or a ``max_model_len`` that the KV cache
            cannot hold (the message says what would fit).
    """

    def __init__(self, args: EngineArgs) -> None:
        from pagedllm.core.kv_cache_manager import KVCacheManager
        from pagedllm.core.scheduler import Scheduler
        from pagedllm.loader import load_model
        from pagedllm.models.registry import get_model_class
        from pagedllm.worker.model_runner import ModelRunner

        t0 = time.perf_counter()
        self.args = args
        torch.set_num_threads(args.num_threads or default_num_threads())
        torch.manual_seed(args.seed)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        if self.device.type == "cpu":
            from pagedllm.kernels.cpu_ops import install_cpu_allocator
            install_cpu_allocator()  # before the weights and KV cache are allocated
        if args.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {args.block_size}")
        if args.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {args.max_num_seqs}")
        if args.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {args.max_num_batched_tokens}")
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype, self.device)
        from pagedllm.spec_decode.config import SpeculativeConfig
        self.spec_config = SpeculativeConfig.from_any(args.speculative_config)
        if self.spec_config is not None and args.runner != "generate":
            raise ValueError("speculative_config: only for runner='generate'")

        loaded = load_model(args.model, dtype=self.dtype, tokenizer=args.tokenizer,
                            ignore_patterns=args.ignore_patterns or None)
        self.loaded = loaded
        self.hf_config = loaded.hf_config
        self.tokenizer = loaded.tokenizer
        if args.runner not in ("generate", "pooling"):
            raise ValueError(f"runner: must be 'generate' or 'pooling', got {args.runner!r}")
        archs = list(getattr(self.hf_config, "architectures", None) or [])
        if args.runner == "pooling":
            # *ForSequenceClassification / bare *Model checkpoints load into the causal-LM body.
            from pagedllm.pooling.adapters import pooling_architectures
            archs = pooling_architectures(archs)
        model_cls = get_model_class(archs)
        with torch.device(self.device):
            model = model_cls(self.hf_config, self.dtype)
        weights = loaded.weights()
        pool_head: dict = {}
        if args.runner == "pooling":
            from pagedllm.pooling.adapters import drop_lm_head, split_head_weights
            drop_lm_head(model)
            weights = split_head_weights(weights, pool_head)
        if loaded.source == "hf":
            from pagedllm.loader.hf_loader import check_checkpoint_files, safetensors_files
            check_checkpoint_files(model, loaded.model_path,
                                   safetensors_files(loaded.model_path, args.ignore_patterns or None),
                                   skip_names=("score.weight", "score.bias") if args.runner == "pooling" else ())
        try:
            model.load_weights(weights)
        except ValueError as e:
            from pagedllm.loader.hf_loader import annotate_load_error
            raise annotate_load_error(e, loaded, args.ignore_patterns or None, model_cls.__name__) from None
        model.eval()
        if args.quantization:
            from pagedllm.quantization import quantize_model
            qstats = quantize_model(model, args.quantization, quantize_lm_head=args.runner == "generate")
            logger.info("pagedllm: quantization %s: %d linear layers, %s -> %s", args.quantization,
                        qstats["num_linears"], _fmt_bytes(qstats["float_bytes"]), _fmt_bytes(qstats["quantized_bytes"]))
        self.model = model
        self.vocab_size = int(self.hf_config.vocab_size)
        def resident_bytes() -> int:  # parameters and buffers
            return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))

        weight_bytes = resident_bytes()
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            from pagedllm.models.layers import prepack_cpu_linears
            # NOTE: bf16 linears move to oneDNN's blocked layout and their dense copies are
            # dropped; a tied LM head gets a packed copy beside the dense embedding table.
            packed = prepack_cpu_linears(model, pack_head=args.runner == "generate")
            weight_bytes = resident_bytes() + packed

        # KV cache sizing from an explicit byte budget.
        num_layers, num_kv_heads, head_dim = model.get_kv_cache_spec()
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * elem
        if args.kv_cache_memory is not None:
            try:
                kv_bytes = parse_bytes(args.kv_cache_memory)
            except ValueError as e:
                raise ValueError(f"kv_cache_memory: {e}") from None
        elif self.device.type == "cuda":
            kv_bytes = self._profile_gpu_kv_bytes(model, args)
        else:
            kv_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = int(kv_bytes // (bytes_per_token * args.block_size))
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory: {kv_bytes} bytes hold {num_blocks} block(s) of {args.block_size} tokens "
                f"({bytes_per_token * args.block_size} bytes each); need at least 2")
        # Block 0 is reserved by the block pool as a null block.
        capacity_tokens = (num_blocks - 1) * args.block_size
        model_ctx = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0) or capacity_tokens
        if args.max_model_len is None:
            max_model_len = min(model_ctx, capacity_tokens)
        else:
            max_model_len = int(args.max_model_len)
            if max_model_len < 1:
                raise ValueError(f"max_model_len: must be >= 1, got {max_model_len}")
            if max_model_len > model_ctx:
                raise ValueError(
                    f"max_model_len: {max_model_len} exceeds the model's context length {model_ctx}")
            if max_model_len > capacity_tokens:
                raise ValueError(
                    f"max_model_len: {max_model_len} tokens do not fit in the KV cache "
                    f"({_fmt_bytes(kv_bytes)} holds {capacity_tokens} tokens at {bytes_per_token} bytes/token); "
                    f"use max_model_len <= {capacity_tokens} or kv_cache_memory >= "
                    f"{(-(-max_model_len // args.block_size) + 1) * args.block_size * bytes_per_token} bytes")
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = args.block_size
        self.kv_capacity_tokens = capacity_tokens

        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        self.eos_token_id = eos

        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks, block_size=args.block_size,
            enable_caching=args.enable_prefix_caching,
            hash_algo=args.prefix_caching_hash_algo, max_model_len=max_model_len)
        spec_decoder = None
        if self.spec_config is not None:
            from pagedllm.worker.spec_decoder import SpecDecoder, build_proposer
            spec_decoder = SpecDecoder(self.spec_config, build_proposer(self.spec_config))
        self.scheduler = Scheduler(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len, kv_cache_manager=self.kv_cache_manager,
            num_spec_tokens=self.spec_config.num_speculative_tokens if self.spec_config else 0,
            num_lookahead_tokens=spec_decoder.proposer.num_lookahead_tokens if spec_decoder else 0)
        pooler = None
        if args.runner == "pooling":
            from pagedllm.pooling.pooler import build_pooler
            pooler = build_pooler(args, self.hf_config, model, pool_head.get("weight"), pool_head.get("bias"))
        self.pooler = pooler
        from pagedllm.attention.selector import get_attn_backend
        attn_impl = get_attn_backend(self.device, args.attention_backend)
        self.runner = ModelRunner(model, num_blocks, args.block_size,
                                  (num_layers, num_kv_heads, head_dim), self.dtype,
                                  self.vocab_size, self.device, attn_impl=attn_impl, pooler=pooler,
                                  eos_token_id=self.eos_token_id, kv_cache_dtype=self.kv_cache_dtype,
                                  spec_decoder=spec_decoder, max_model_len=max_model_len)
        if self.device.type != "cpu":
            from pagedllm.models.layers import reserve_rope_tables
            # NOTE: full-size rope tables now: no per-step position check (a device sync) and a
            # fixed table address for the CUDA graphs.
            reserve_rope_tables(model, max_model_len, self.device)
        if self.device.type == "cuda" and not args.enforce_eager:
            secs = self.runner.capture_cuda_graphs(args.max_num_seqs, max_model_len)
            logger.info("pagedllm: captured decode CUDA graphs in %.2f s", secs)
        self.startup_seconds = time.perf_counter() - t0
        logger.info(
            "pagedllm: model %s (%s, %s) loaded in %.2f s; weights %s; KV cache %s %s = %d blocks x %d tokens "
            "= %d tokens (%d bytes/token); max_model_len %d",
            args.model, self.hf_config.architectures[0], str(self.dtype).replace("torch.", ""),
            self.startup_seconds, _fmt_bytes(weight_bytes), str(self.kv_cache_dtype).replace("torch.", ""),
            _fmt_bytes(num_blocks * args.block_size * bytes_per_token),
            num_blocks, args.block_size, capacity_tokens, bytes_per_token, max_model_len)
        self.weight_bytes = weight_bytes

    def _profile_gpu_kv_bytes(self, model, args: EngineArgs) -> int:
        """KV bytes on CUDA: ``gpu_memory_utilization`` x total memory minus weights and the peak
        activations of a dummy forward over ``max_num_batched_tokens`` tokens (vLLM's method)."""
        from pagedllm.attention.backend import ForwardContext, set_forward_context
        from pagedllm.attention.torch_paged import TorchPagedAttention

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
        total = torch.cuda.get_device_properties(self.device).total_memory
        kv = int(total * args.gpu_memory_utilization - peak)
        logger.info("pagedllm: GPU memory %s total x %.2f; peak with weights + activations %s; KV cache %s",
                    _fmt_bytes(total), args.gpu_memory_utilization, _fmt_bytes(peak), _fmt_bytes(max(kv, 0)))
        if kv <= 0:
            raise ValueError(
                f"gpu_memory_utilization: {args.gpu_memory_utilization} leaves no memory for the KV cache "
                f"(weights + activations peak at {_fmt_bytes(peak)} of {_fmt_bytes(total)})")
        return kv

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if request_ids:
            self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model and update request states once."""
        so = self.scheduler.schedule()
        runner_out = self.runner.execute(so)
        if so.is_empty:
            return []
        return self.scheduler.update_from_output(so, runner_out)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def get_scheduler_stats(self) -> dict:
        s = self.scheduler
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_cache_usage": self.kv_cache_manager.usage,
            "num_preemptions_total": s.num_preemptions_total,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
        }

    def get_memory_stats(self) -> dict:
        """Process memory now, in bytes: ``resident_memory_bytes`` (RSS) and, on CPU with the
        caching allocator installed, ``cpu_allocator_cached_bytes`` (free blocks kept for reuse,
        bounded by its cap), ``cpu_allocator_live_bytes`` (blocks held by tensors) and
        ``cpu_allocator_cache_limit_bytes`` (the cap)."""
        from pagedllm.kernels.cpu_ops import cpu_allocator_stats
        from pagedllm.metrics.memory import resident_memory_bytes

        out = {"resident_memory_bytes": resident_memory_bytes()}
        a = cpu_allocator_stats() if self.device.type == "cpu" else {}
        if a:
            out.update(cpu_allocator_cached_bytes=a["cached_bytes"], cpu_allocator_live_bytes=a["live_bytes"],
                       cpu_allocator_cache_limit_bytes=a["max_cached_bytes"])
        return out
