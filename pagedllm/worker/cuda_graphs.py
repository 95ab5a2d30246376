"""CUDA graphs for decode-only steps (a no-op on CPU).

A decode-only step of B requests runs the model on B tokens. ``CudaGraphRunner`` captures the
model forward once per padded batch size (1, 2, 4, 8, then every 8 up to ``max_num_seqs``) over
static device buffers, and replays the smallest graph that fits: the step's inputs are copied into
the buffers, the rows beyond B are padding (slot -1: nothing written; seq_len 0: the attention
output is zeros), and the first B rows of the static output are returned.

Only backends whose kernels take every per-step value from device tensors can be captured: the
Triton backend does (its grid depends on (T, B) alone, which a padded size fixes); the torch
backend reads python lists and syncs, so the runner must not use graphs with it.

Usage (model runner)::

    graphs = CudaGraphRunner(model, attn_impl, kv_caches, max_num_seqs, max_blocks_per_seq,
                             block_size, device)
    if not enforce_eager:
        graphs.capture()                       # after the KV cache is allocated; logs the time
    ...
    if graphs.can_run(meta):                   # decode-only and small enough
        hidden = graphs.run(input_ids, positions, meta)   # [B, hidden] on device
    else:
        with set_forward_context(...): hidden = model(input_ids, positions)
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from pagedllm.attention.backend import AttentionMetadata, ForwardContext, set_forward_context

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int, step: int = 8) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every ``step``, up to the first one >= ``max_num_seqs``."""
    sizes, s = [], 1
    while not sizes or sizes[-1] < max_num_seqs:
        sizes.append(s)
        s = s * 2 if s < 8 else s + step
    return sizes


class CudaGraphRunner:
    """Captures and replays decode-only forwards.

    Args:
        model: ``forward(input_ids [T], positions [T]) -> [T, hidden]``.
        attn_impl: the attention backend (must read all step data from device tensors: Triton).
        kv_caches: the runner's per-layer KV cache tensors (captured by address: never reallocate).
        max_num_seqs: the largest decode batch.
        max_blocks_per_seq: block-table width (``ceil(max_model_len / block_size)``).
        block_size: tokens per block.
        device: the model's device; on a non-CUDA device the runner is disabled (``capture`` is a
            no-op and ``can_run`` is always False).
        sizes: padded batch sizes to capture (default ``capture_sizes(max_num_seqs)``).
    """

    def __init__(self, model: torch.nn.Module, attn_impl: Any, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, sizes: Optional[list[int]] = None) -> None:
        self.model, self.attn_impl, self.kv_caches = model, attn_impl, kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda"
        self.sizes = sorted(sizes or capture_sizes(max_num_seqs))
        self.max_size = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.capture_seconds = 0.0
        if not self.enabled:
            return
        n, dev = self.max_size, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=dev)  # one token each
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)

    # ------------------------------------------------------------------ capture
    def _meta(self, size: int) -> AttentionMetadata:
        """Static metadata for ``size`` rows: views of the device buffers (python fields are nominal)."""
        return AttentionMetadata(
            num_reqs=size, num_decodes=size, num_decode_tokens=size,
            query_start_loc=self.query_start_loc[:size + 1], query_lens=[1] * size,
            seq_lens=self.seq_lens[:size], seq_lens_list=[0] * size,
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size, max_seq_len=self.max_blocks * self.block_size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        ctx = ForwardContext(attn_metadata=self.metas[size], kv_caches=self.kv_caches, impl=self.attn_impl)
        with set_forward_context(ctx):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture one graph per size (largest first, sharing one memory pool); returns seconds.

        The padding state (seq_len 0, slot -1) is what the buffers hold during capture, so the
        warm-up runs (which also JIT-compile the Triton kernels) write nothing to the KV cache.
        """
        if not self.enabled:
            return 0.0
        t0 = time.perf_counter()
        from pagedllm.models.layers import reserve_rope_tables
        # NOTE: the graphs hold the rope tables' addresses, and capture allows no position check (a sync)
        reserve_rope_tables(self.model, self.max_blocks * self.block_size, self.device)
        self._reset_padding(0)
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in sorted(self.sizes, reverse=True):
                self.metas[size] = self._meta(size)
                for _ in range(2):  # warm-up: compile kernels, settle allocator
                    self._forward(size)
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self.outputs[size] = self._forward(size)
                pool = g.pool()
                self.graphs[size] = g
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("pagedllm: captured %d CUDA graphs (decode batch sizes %s) in %.2f s",
                    len(self.graphs), self.sizes, self.capture_seconds)
        return self.capture_seconds

    # ------------------------------------------------------------------ replay
    def padded_size(self, num_reqs: int) -> Optional[int]:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def can_run(self, meta: Optional[AttentionMetadata]) -> bool:
        """True for a decode-only step that a captured graph covers."""
        return (self.enabled and bool(self.graphs) and meta is not None and meta.num_reqs > 0
                and meta.num_decodes == meta.num_reqs and meta.num_reqs <= self.max_size
                and meta.block_tables.shape[1] <= self.max_blocks)

    def _reset_padding(self, start: int) -> None:
        self.input_ids[start:].zero_()
        self.positions[start:].zero_()
        self.seq_lens[start:].zero_()
        self.slot_mapping[start:].fill_(-1)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for ``meta.num_reqs`` decodes; returns ``[B, hidden]`` (a view of a
        static buffer: consume it before the next ``run``)."""
        b = meta.num_reqs
        size = self.padded_size(b)
        nb = meta.block_tables.shape[1]
        # Copies from (pinned) host tensors are async; from device tensors they are device copies.
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:b, :nb].copy_(meta.block_tables, non_blocking=True)
        if size > b:
            self._reset_padding(b)
        self.graphs[size].replay()
        return self.outputs[size][:b]
