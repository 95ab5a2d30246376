"""A model whose forward costs ~nothing: for measuring the engine's host time per step.

``pagedllm bench throughput --null-model`` runs the real engine (scheduler, input batch,
sampler, output processor, detokenizer) over :class:`NullModel`, so what a step costs is the
host work around the model. The logits are correctly shaped (``[N, vocab_size]`` float32) and
deterministic: the step's ``N`` rows are ``N`` consecutive rows of a fixed seeded table, starting
at a row keyed by the first token's position and id, returned as a view (no copy: the logits
cost nothing either), so different requests and steps sample different tokens and greedy runs
repeat.
"""
from __future__ import annotations

from typing import Optional

import torch

# Rows of the fixed logits table (enough that a batch's tokens differ).
_TABLE_ROWS = 97


class NullModel(torch.nn.Module):
    """Stands in for a causal LM with the ``forward`` / ``compute_logits`` interface.

    Args:
        vocab_size: logits width.
        kv_spec: ``(num_layers, num_kv_heads, head_dim)`` reported by ``get_kv_cache_spec``
            (the runner allocates a KV cache of that shape; nothing reads or writes it).
        seed: seeds the logits table.
        token_range: ``(lo, hi)``: each table row peaks (logit +8, the rest N(0, 1)) at a
            token in ``[lo, hi)``, so greedy decoding emits ordinary text tokens of the real
            tokenizer (None: ``[0, vocab_size)``).

    ``forward(input_ids int64 [T], positions int64 [T])`` returns float32 ``[T, 1]`` "hidden
    states" (a per-token key into the table); ``compute_logits(hidden [N, 1])`` returns float32
    ``[N, vocab_size]``.
    """

    def __init__(self, vocab_size: int, kv_spec: tuple[int, int, int] = (1, 1, 8), seed: int = 0,
                 token_range: Optional[tuple[int, int]] = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self._kv_spec = kv_spec
        self._seed = seed
        lo, hi = token_range or (0, vocab_size)
        self._lo, self._hi = max(0, min(lo, vocab_size - 1)), max(1, min(hi, vocab_size))
        self.table = torch.empty(0, vocab_size)
        self._grow(64)

    def _grow(self, rows: int) -> None:
        """(Re)build the table with at least ``rows + _TABLE_ROWS`` rows: N(0, 1), one +8 peak a
        row at a token in ``token_range`` (the same rows whatever the size: seeded per row)."""
        n = rows + _TABLE_ROWS
        g = torch.Generator().manual_seed(self._seed)
        table = torch.randn(n, self.vocab_size, generator=g)
        peaks = torch.randint(self._lo, max(self._hi, self._lo + 1), (n,), generator=g)
        table[torch.arange(n), peaks] = 8.0
        self.table = table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, 1]``: ``(positions * 7919 + input_ids) % table_rows``."""
        return ((positions * 7919 + input_ids) % _TABLE_ROWS).to(torch.float32).unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, vocab_size]``: table rows ``o .. o + N - 1``, ``o = hidden[0, 0]`` (a view)."""
        n = hidden.shape[0]
        if n == 0:
            return self.table[:0]
        if n + _TABLE_ROWS > self.table.shape[0]:
            self._grow(2 * n)
        o = int(hidden[0, 0])
        return self.table[o:o + n]

    def get_kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` given at construction."""
        return self._kv_spec
