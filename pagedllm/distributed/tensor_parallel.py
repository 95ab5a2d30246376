"""Tensor parallelism applied to a built model from outside (gpt-fast style): model files hold
no parallelism code.

``shard_tensor_parallel(model, rank, size)`` runs on the freshly built (not yet loaded) model
and replaces, keyed on the shared layer classes of ``pagedllm.models.layers``:

* ``SelfAttention``: ``qkv_proj`` -> this rank's query heads and KV heads (column-parallel;
  KV heads replicated when there are fewer than ranks), ``o_proj`` -> its input columns
  (row-parallel), head counts of the attention module;
* ``GatedMLP``: ``gate_up_proj`` -> this rank's slice of the intermediate size (column),
  ``down_proj`` -> the same slice of its input (row);
* ``embed_tokens`` -> ``VocabParallelEmbedding`` (this rank's vocabulary rows), an untied
  ``lm_head`` -> this rank's vocabulary rows.

Each replaced parameter gets a ``weight_loader`` that copies only this rank's slice of a
checkpoint tensor, so no rank holds more than its shard (plus the one tensor being loaded).
A row-parallel bias is loaded on rank 0 only (zeros elsewhere) so the all-reduce adds it once.

``install_tensor_parallel_comm(model)`` runs after quantization and prepacking (which swap or
repack linears) and adds the communication: an all-reduce after every row-parallel projection
(``RowParallelReduce`` wraps whatever module sits there: ``Linear``, an int8/int4/W8A8 linear)
and a gather of the vocabulary-sharded logits onto TP rank 0 (``compute_logits`` returns None
on the other ranks, which then skip sampling).

Splits (``split_range``): sizes are split as evenly as possible in units of ``align``; heads are
split on KV-head boundaries (SmolLM2's 9 query / 3 KV heads over 2 ranks: 3+6 query heads,
1+2 KV heads), so ranks may hold different KV cache sizes (the engine uses the smallest fit).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.models.base import default_dtype
from pagedllm.models.layers import Embedding, GatedMLP, Linear, PackedLinear, QKVLinear, SelfAttention


def split_range(n: int, size: int, rank: int, align: int = 1) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s part of ``n`` items split over ``size`` ranks as
    evenly as possible in whole units of ``align`` (``align`` must divide ``n``).

    Raises:
        ValueError: fewer units than ranks.
    """
    units = n // align
    if units < size:
        raise ValueError(f"cannot split {n} over {size} ranks in units of {align}")
    lo, hi = rank * units // size, (rank + 1) * units // size
    return lo * align, (hi - lo) * align


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[int, int, int, int]:
    """``(q_start, q_count, kv_start, kv_count)`` of this rank's attention heads.

    With at least as many KV heads as ranks, KV heads are split (contiguously, as evenly as
    possible) and each rank takes the query heads of its KV heads. With fewer, each KV head is
    replicated over ``size / num_kv_heads`` ranks, which split its query heads evenly.

    Raises:
        ValueError: fewer KV heads than ranks and ``size`` not a multiple of ``num_kv_heads``
            or ``num_heads`` not a multiple of ``size``.
    """
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv0, nkv = split_range(num_kv_heads, size, rank)
        return kv0 * group, nkv * group, kv0, nkv
    if size % num_kv_heads or num_heads % size:
        raise ValueError(
            f"tensor_parallel_size: {size} ranks cannot share {num_kv_heads} KV heads / {num_heads} query heads "
            f"(with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and divide the "
            f"query heads)")
    per = num_heads // size
    return rank * per, per, rank // (size // num_kv_heads), 1


def check_head_split(hf_config: Any, size: int) -> None:
    """Raise what ``head_split`` would raise on some rank of ``size`` for the attention heads of
    ``hf_config`` (its ``text_config`` when it has one): ``num_attention_heads`` and
    ``num_key_value_heads`` (default: the query heads). A config without head counts passes.

    Raises:
        ValueError: ``tensor_parallel_size`` ranks cannot share the heads.
    """
    cfg = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(cfg, "num_attention_heads", None)
    if size <= 1 or not isinstance(heads, int):
        return
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    for rank in range(size):
        head_split(heads, kv, size, rank)


def _slicing_loader(rows: Optional[tuple[int, int]] = None, cols: Optional[tuple[int, int]] = None,
                    inner: Optional[Callable] = None, zero: bool = False) -> Callable:
    """A ``weight_loader(param, tensor[, shard_id])`` copying ``tensor[rows][:, cols]`` (rows
    padded with zeros past the tensor's end; everything zero with ``zero``), through ``inner``
    (a packed linear's per-shard loader) when given."""

    def load(param: nn.Parameter, t: torch.Tensor, *shard) -> None:
        if zero:
            t = torch.zeros_like(t)
        if cols is not None and t.dim() > 1:
            t = t[:, cols[0]:cols[0] + cols[1]]
        if rows is not None:
            r0, n = rows
            part = t[r0:r0 + n]
            if part.shape[0] < n:  # vocabulary padding
                pad = torch.zeros((n - part.shape[0], *t.shape[1:]), dtype=t.dtype)
                part = torch.cat((part, pad))
            t = part
        if inner is not None:
            inner(param, t, *shard)
            return
        if t.shape != param.shape:
            raise ValueError(f"tensor-parallel shard: got shape {tuple(t.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(t)

    return load


def _column_packed(old: PackedLinear, new: PackedLinear, slices: dict) -> PackedLinear:
    """Give ``new`` (this rank's packed linear) loaders slicing each checkpoint shard by ``slices``
    (``{shard_id: (start, count)}`` rows of the full shard)."""
    for p in new.parameters():
        base = p.weight_loader

        def load(param, t, shard_id, base=base):
            _slicing_loader(rows=slices[shard_id], inner=base)(param, t, shard_id)

        p.weight_loader = load
    return new


def _row_linear(in_features: int, out_features: int, bias: bool, cols: tuple[int, int], rank: int) -> Linear:
    lin = Linear(cols[1], out_features, bias=bias)
    lin.weight.weight_loader = _slicing_loader(cols=cols)
    if bias:
        lin.bias.weight_loader = _slicing_loader(zero=rank != 0)
    return lin


def _shard_attention(attn: SelfAttention, rank: int, size: int) -> None:
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q0, nq, kv0, nkv = head_split(hq, hkv, size, rank)
    old = attn.qkv_proj
    hidden, bias = old.in_features, old.bias is not None
    with torch.device(old.weight.device), default_dtype(old.weight.dtype):
        qkv = QKVLinear(hidden, nq, nkv, d, bias)
        attn.qkv_proj = _column_packed(old, qkv, {"q": (q0 * d, nq * d), "k": (kv0 * d, nkv * d),
                                                  "v": (kv0 * d, nkv * d)})
        o = attn.o_proj
        attn.o_proj = _row_linear(o.in_features, o.out_features, o.bias is not None, (q0 * d, nq * d), rank)
    attn.num_heads = attn.attn.num_heads = nq
    attn.num_kv_heads = attn.attn.num_kv_heads = nkv


def _shard_mlp(mlp: GatedMLP, rank: int, size: int) -> None:
    old = mlp.gate_up_proj
    inter = old.shard_offsets[0][1]
    align = 64 if inter % 64 == 0 and inter // 64 >= size else 1  # NOTE: int4 groups and packing stay whole
    i0, ni = split_range(inter, size, rank, align)
    with torch.device(old.weight.device), default_dtype(old.weight.dtype):
        gu = PackedLinear(old.in_features, {0: ni, 1: ni}, bias=old.bias is not None)
        mlp.gate_up_proj = _column_packed(old, gu, {0: (i0, ni), 1: (i0, ni)})
        d = mlp.down_proj
        mlp.down_proj = _row_linear(d.in_features, d.out_features, d.bias is not None, (i0, ni), rank)


class VocabParallelEmbedding(Embedding):
    """This rank's rows ``[vocab_start, vocab_start + num_embeddings)`` of the embedding table
    (the last rank's padded with zero rows); ``forward`` looks up the ids it holds, zeros the
    others and sums over the TP group (exact: every id is non-zero on one rank only).

    Args:
        vocab_size: the full vocabulary V; padded_vocab: V rounded up to a multiple of the ranks.
        embedding_dim: hidden size; rank, size: this rank and the TP size.
    """

    def __init__(self, vocab_size: int, padded_vocab: int, embedding_dim: int, rank: int, size: int) -> None:
        self.vocab_start, n = split_range(padded_vocab, size, rank, padded_vocab // size)
        super().__init__(n, embedding_dim)
        self.full_vocab_size = vocab_size
        self.weight.weight_loader = _slicing_loader(rows=(self.vocab_start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 ``[T]`` -> ``[T, hidden]`` (summed over the TP group)."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return get_tp_group().all_reduce(x)


class RowParallelReduce(nn.Module):
    """``inner(x)`` summed over the TP group (the rank's partial product of a row-parallel
    projection; the bias, loaded on rank 0 only, is inside ``inner``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Any) -> torch.Tensor:
        return get_tp_group().all_reduce(self.inner(x))


def shard_tensor_parallel(model: nn.Module, rank: int, size: int) -> None:
    """Replace ``model``'s layers by this rank's shards (see the module docstring), in place,
    before ``load_weights``.

    Raises:
        ValueError: a linear layer outside the known blocks (its split is unknown), or heads
            that cannot be shared by ``size`` ranks.
    """
    handled: set[int] = set()
    for m in list(model.modules()):
        if isinstance(m, SelfAttention):
            _shard_attention(m, rank, size)
            handled.update(id(x) for x in (m.qkv_proj, m.o_proj))
        elif isinstance(m, GatedMLP):
            _shard_mlp(m, rank, size)
            handled.update(id(x) for x in (m.gate_up_proj, m.down_proj))
    inner = model.model
    embed = inner.embed_tokens
    vocab, hidden = embed.num_embeddings, embed.embedding_dim
    padded = -(-vocab // size) * size
    with torch.device(embed.weight.device), default_dtype(embed.weight.dtype):
        inner.embed_tokens = VocabParallelEmbedding(vocab, padded, hidden, rank, size)
        head = getattr(model, "lm_head", None)
        if head is not None:
            v0, n = inner.embed_tokens.vocab_start, inner.embed_tokens.num_embeddings
            lm = Linear(hidden, n, bias=False)
            lm.weight.weight_loader = _slicing_loader(rows=(v0, n))
            model.lm_head = lm
            handled.add(id(lm))
    others = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in handled]
    if others:
        raise ValueError(f"tensor_parallel_size: do not know how to split {others} of {type(model).__name__}")
    model.tp_vocab = (vocab, padded)


def install_tensor_parallel_comm(model: nn.Module) -> None:
    """After loading, quantization and prepacking: all-reduce after each row-parallel
    projection and gather the logits onto TP rank 0 (None elsewhere)."""
    for m in list(model.modules()):
        if isinstance(m, SelfAttention) and not isinstance(m.o_proj, RowParallelReduce):
            m.o_proj = RowParallelReduce(m.o_proj)
        elif isinstance(m, GatedMLP) and not isinstance(m.down_proj, RowParallelReduce):
            m.down_proj = RowParallelReduce(m.down_proj)
    # NOTE: the logits processor gathers the vocabulary-sharded logits onto TP rank 0
    model.logits_processor.tp_vocab = model.tp_vocab
