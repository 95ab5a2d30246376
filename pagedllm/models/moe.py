"""Mixture-of-experts feed-forward: a top-k router, the experts as one grouped GEMM, a shared expert.

Routing (transformers' ``*TopKRouter`` of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): ``softmax`` of the
router logits in float32 over all experts, ``torch.topk`` (the call transformers makes, so exact ties
between experts are broken the same way), then, where the model normalises (``renormalize``: Mixtral
always, the others per ``config.norm_topk_prob``), the k weights divided by their sum.

Experts (``FusedMoE``): every expert is a gated MLP ``down(act(gate(x)) * up(x))``; their weights
are stacked as ``w13`` ``[E, 2I, H]`` (gate rows, then up rows) and ``w2`` ``[E, H, I]`` (the layout
transformers 5 keeps in memory). A step's (token, expert) pairs are sorted by expert and each
projection runs as one grouped GEMM over the sorted rows (``torch._grouped_mm`` with the groups'
end offsets), so no Python loop runs per expert; the outputs are weighted and summed back per token
with one ``index_add_``. An expert that receives no rows is an empty group.

Parallelism (for a sharding pass over the built model; tested in tests/models/test_moe.py): either
``FusedMoE.shard_experts(rank, world_size)`` (expert parallelism: keeps experts
``[rank * E / world, (rank + 1) * E / world)``) or ``FusedMoE.shard_intermediate(rank, world_size)``
(tensor parallelism: every expert keeps a 1/world slice of its intermediate dim). Either way a rank's
output is a partial sum, and the ranks' outputs add up (all-reduce) to the full layer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import re

from pagedllm.models.layers import ACTIVATIONS, GatedMLP


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing.

    Args:
        router_logits: ``[T, E]`` (any float dtype).
        top_k: experts per token (k <= E).
        renormalize: divide the k weights by their sum.

    Returns:
        ``(weights float32 [T, k], expert ids int64 [T, k])``.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM: rows ``offs[g-1]:offs[g]`` of ``a`` ``[N, K]`` times ``b[g]`` ``[K, M]``.

    Args:
        a: ``[N, K]`` rows sorted by group; b: ``[G, K, M]`` (a transposed view is fine);
        offs: int32 ``[G]`` cumulative row counts (``offs[-1] == N``).

    Returns:
        ``[N, M]`` in ``a``'s dtype. ``torch._grouped_mm`` where torch has a kernel for the
        device and dtype (CPU: float32/bfloat16/float16; CUDA: bfloat16 on compute capability >= 9),
        else one matmul per non-empty group.
    """
    if a.device.type == "cpu" or (a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device)[0] >= 9):
        return torch._grouped_mm(a, b, offs=offs)
    return grouped_mm_loop(a, b, offs)


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` as one matmul per non-empty group (the reference, and the benchmark baseline)."""
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


class FusedMoE(nn.Module):
    """``E`` gated-MLP experts applied to routed tokens (see the module doc).

    Args:
        num_experts: E; hidden: H; intermediate: I (per expert); act: activation name (``ACTIVATIONS``).

    Parameters (checkpoint shard ids for ``weight_loader``): ``w13_weight`` ``[E, 2I, H]``
    (``(expert, 0)`` gate rows, ``(expert, 1)`` up rows), ``w2_weight`` ``[E, H, I]`` (``(expert, 0)``).
    A whole stacked tensor (transformers 5's ``experts.gate_up_proj`` / ``experts.down_proj``) loads
    through ``whole_loader``. Shard ids of experts this rank does not hold are accepted and ignored.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {sorted(ACTIVATIONS)}")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.act = ACTIVATIONS[act]
        self.expert_start, self.expert_end = 0, num_experts  # this rank's experts [start, end)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.use_grouped_mm = True  # False: one matmul per expert (benchmark baseline)
        self._set_loaders()

    def _set_loaders(self) -> None:
        local = range(self.expert_start, self.expert_end)
        for p, parts in ((self.w13_weight, (0, 1)), (self.w2_weight, (0,))):
            p.weight_loader = self._load_shard
            p.whole_loader = self._load_whole
            p.shard_ids = tuple((e, i) for e in local for i in parts)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id
        if not self.expert_start <= expert < self.expert_end:
            return
        rows = param.shape[1] // (2 if param is self.w13_weight else 1)
        if tuple(tensor.shape) != (rows, param.shape[2]):
            raise ValueError(f"expert {expert} shard {part}: got shape {tuple(tensor.shape)}, "
                             f"expected {(rows, param.shape[2])}")
        param.data[expert - self.expert_start, part * rows:(part + 1) * rows].copy_(tensor)

    def _load_whole(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape[1:]) != tuple(param.shape[1:]) or tensor.shape[0] != self.num_experts:
            raise ValueError(f"stacked experts: got shape {tuple(tensor.shape)}, expected "
                             f"{(self.num_experts, *param.shape[1:])}")
        param.data.copy_(tensor[self.expert_start:self.expert_end])

    def shard_experts(self, rank: int, world_size: int) -> None:
        """Keep only experts ``[rank * E / world, (rank + 1) * E / world)`` (expert parallelism).

        Raises:
            ValueError: E not divisible by ``world_size``, or a rank out of range.
        """
        if self.num_experts % world_size or not 0 <= rank < world_size:
            raise ValueError(f"expert parallel: {self.num_experts} experts cannot be split {world_size} ways "
                             f"(rank {rank})")
        n = self.num_experts // world_size
        lo = rank * n - self.expert_start
        with torch.no_grad():
            self.w13_weight = nn.Parameter(self.w13_weight.data[lo:lo + n].clone(), requires_grad=False)
            self.w2_weight = nn.Parameter(self.w2_weight.data[lo:lo + n].clone(), requires_grad=False)
        self.expert_start, self.expert_end = rank * n, rank * n + n
        self._set_loaders()

    def shard_intermediate(self, rank: int, world_size: int) -> None:
        """Keep rows ``[rank * I / world, (rank + 1) * I / world)`` of every expert's gate and up
        projections and the matching columns of its down projection (tensor parallelism), after loading.

        Raises:
            ValueError: I not divisible by ``world_size``, or a rank out of range.
        """
        i = self.intermediate
        if i % world_size or not 0 <= rank < world_size:
            raise ValueError(f"tensor parallel: expert size {i} cannot be split {world_size} ways (rank {rank})")
        n = i // world_size
        lo, hi = rank * n, rank * n + n
        with torch.no_grad():
            w13 = torch.cat([self.w13_weight.data[:, lo:hi], self.w13_weight.data[:, i + lo:i + hi]], dim=1)
            self.w13_weight = nn.Parameter(w13.contiguous(), requires_grad=False)
            self.w2_weight = nn.Parameter(self.w2_weight.data[:, :, lo:hi].contiguous(), requires_grad=False)
        self.intermediate = n
        self._set_loaders()

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]``; topk_weights float32 ``[T, k]``; topk_ids int64 ``[T, k]`` (global expert ids)
        -> ``[T, H]`` in x's dtype: ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` over this rank's experts."""
        k = topk_ids.shape[1]
        ids = topk_ids.reshape(-1)
        if self.expert_start == 0 and self.expert_end == self.num_experts:
            order = torch.argsort(ids, stable=True)
        else:
            sel = ((ids >= self.expert_start) & (ids < self.expert_end)).nonzero().squeeze(1)
            order = sel[torch.argsort(ids[sel], stable=True)]
        local = ids[order] - self.expert_start
        offs = torch.bincount(local, minlength=self.expert_end - self.expert_start).cumsum(0).to(torch.int32)
        tokens = order // k
        mm = grouped_mm if self.use_grouped_mm else grouped_mm_loop
        h = mm(x[tokens], self.w13_weight.transpose(1, 2), offs)
        gate, up = h.chunk(2, dim=-1)
        y = mm(self.act(gate) * up, self.w2_weight.transpose(1, 2), offs)
        y = (y.float() * topk_weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, y)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (local {self.expert_start}..{self.expert_end - 1}), "
                f"hidden={self.hidden}, intermediate={self.intermediate}")


class TopKRouter(nn.Module):
    """The router's ``weight`` ``[E, H]`` (checkpoint ``...mlp.gate.weight``). Not a ``Linear``, so
    weight quantization and sharding passes leave it whole (routing stays exact and replicated)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` -> router logits ``[T, E]`` (x's dtype)."""
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ optional shared expert gated by ``sigmoid(shared_expert_gate(x))``, Qwen2-MoE).

    Args:
        hidden, num_experts, top_k, intermediate: sizes; renormalize: see ``select_experts``;
        act: activation; shared_intermediate: the shared expert's size (None = no shared expert).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool,
                 act: str = "silu", shared_intermediate: Optional[int] = None) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = TopKRouter(num_experts, hidden)
        self.experts = FusedMoE(num_experts, hidden, intermediate, act)
        self.shared_expert = GatedMLP(hidden, shared_intermediate, act) if shared_intermediate else None
        self.shared_expert_gate = TopKRouter(1, hidden) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` -> ``[T, H]``."""
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# Checkpoint expert names: per expert (the Hub's: Mixtral w1/w3/w2, the others gate/up/down_proj) or
# stacked (transformers 5's in-memory ``experts.gate_up_proj`` / ``experts.down_proj``).
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": ("w13_weight", 0), "gate_proj": ("w13_weight", 0), "w3": ("w13_weight", 1),
         "up_proj": ("w13_weight", 1), "w2": ("w2_weight", 0), "down_proj": ("w2_weight", 0)}
_STACKED = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


def expert_param_target(name: str) -> Optional[tuple[str, object]]:
    """``(FusedMoE parameter name, shard id)`` for a checkpoint expert tensor name (shard None = the
    whole stacked tensor), or None when ``name`` is not an expert weight.

    E.g. ``model.layers.0.mlp.experts.3.up_proj.weight`` -> ``("model.layers.0.mlp.experts.w13_weight", (3, 1))``.
    """
    m = _PER_EXPERT.match(name)
    if m:
        param, part = _PART[m.group(3)]
        return f"{m.group(1)}.{param}", (int(m.group(2)), part)
    head, _, last = name.rpartition(".")
    if head.endswith(".experts") and last in _STACKED:
        return f"{head}.{_STACKED[last]}", None
    return None
