"""Batch-invariant CPU paged attention: one kernel for every query token of a step.

The default CPU backend (``torch_paged``) attends decodes with one kernel and prefill chunks
with another (SDPA, or the AVX512-BF16 flash kernel), and each sums in an order set by its own
blocking, so a token's attention output depends on whether it was computed in a decode step,
in which chunk of a prefill, and (through SDPA's blocking) on the chunk's length. Here every
query token, decode or prefill, is one row of the same computation
(``kernels/csrc/batch_invariant.cpp``: keys in tiles of 16 at absolute positions, online
softmax in float32, fixed-order dot products and sums), so its output depends only on its own
q, its position and the K/V of its context: the same bits alone or in any batch, in any chunk,
with K/V from this step or from the prefix cache.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.attention.backend import AttentionImpl, AttentionMetadata
from pagedllm.attention.torch_paged import write_kv


class BatchInvariantAttention(AttentionImpl):
    """Paged attention on CPU with batch-invariant numerics (see ``AttentionImpl.forward``).

    K/V are stored with the C++ ``reshape_and_cache`` (an exact copy) when the main kernels are
    built, else with the torch store; the attention itself needs the batch-invariant kernels
    (``pagedllm.kernels.batch_invariant``). The KV cache must have the compute dtype
    (float32 or bfloat16; an fp8 cache is refused at start-up by ``EngineArgs``).

    Raises:
        RuntimeError: at construction, when the batch-invariant kernels cannot be built.
    """

    def __init__(self) -> None:
        from pagedllm.kernels.batch_invariant import get_bi_ops
        from pagedllm.kernels.cpu_ops import get_ops

        self._bi = get_bi_ops()
        self._ops = get_ops()

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        write_kv(kv_cache, k, v, meta.slot_mapping, self._ops)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, sliding_window: Optional[int], logits_soft_cap: Optional[float]) -> torch.Tensor:
        """All query tokens of the step in one kernel call.

        Raises:
            RuntimeError: a cache dtype other than q's, or a non-CPU tensor.
        """
        return self._bi.attention(q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                  float(scale), int(sliding_window or 0), float(logits_soft_cap or 0.0))
