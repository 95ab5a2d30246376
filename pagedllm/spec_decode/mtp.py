"""Multi-token-prediction draft head in the Gemma 4 style ("assistant" checkpoints, vLLM's
``gemma4_mtp``): the drafter owns no KV cache; its attention layers project queries only and
read the **target's** KV cache.

One draft step for a request whose target cache holds positions ``0..p`` (``p + 1`` tokens):

1. ``x = [embed_target(token) ; h]`` (``2 Hb``: the target's scaled embedding of the last token
   and a backbone-sized hidden state: the target's last hidden state at the first step, the
   previous step's ``post_projection`` output after that);
2. ``pre_projection``: ``2 Hb -> Hd``;
3. Gemma-style decoder layers: ``input_layernorm``, Q-only attention (``q_proj``, per-head
   ``q_norm``, rope at the constant position ``p + 1``, keys/values = the target layer
   ``kv_layers[i]``'s cache at positions ``0..p``, within ``sliding_window`` for sliding layers),
   ``o_proj``, ``post_attention_layernorm``, residual; ``pre_feedforward_layernorm``, gated GELU
   MLP, ``post_feedforward_layernorm``, residual;
4. final ``norm`` -> logits through the drafter's own (tied) embedding (``Hd`` wide);
5. ``post_projection``: ``Hd -> Hb`` gives the next step's ``h``.

Every draft step queries from the same position (vLLM: "constant draft positions"): drafts never
enter any cache. Gemma norms multiply by ``1 + w``.

Checkpoint layout (``gemma4_assistant``): ``model.embed_tokens.weight``,
``model.layers.{i}.{input_layernorm,post_attention_layernorm,pre_feedforward_layernorm,
post_feedforward_layernorm}.weight``, ``model.layers.{i}.self_attn.{q_proj,q_norm,o_proj}.weight``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``,
``pre_projection.weight``, ``post_projection.weight`` (``lm_head`` tied). With
``use_ordered_embeddings`` the checkpoint also carries the ordered-embedding centroids
``masked_embedding.centroids.weight`` ``[C, Hd]`` and ``masked_embedding.token_ordering`` ``[V]``
(token ids grouped by centroid, ``V / C`` per centroid): a sparse LM head
(:func:`centroid_candidates`); without the flag such tensors are rejected by name.

Each drafter layer uses the rope of its attention type (the keys it reads were rotated by the
target layer of that type).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding


def gather_paged_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[N, max_len, Hkv, D]`` of the first ``max_len`` positions of each row's block
    table from a paged cache ``[num_blocks, 2, block_size, Hkv, D]``."""
    bs = kv_cache.shape[2]
    nb = -(-max_len // bs)
    x = kv_cache[block_tables[:, :nb]]  # [N, nb, 2, bs, Hkv, D]
    n = x.shape[0]
    k = x[:, :, 0].reshape(n, nb * bs, *x.shape[-2:])[:, :max_len]
    v = x[:, :, 1].reshape(n, nb * bs, *x.shape[-2:])[:, :max_len]
    return k, v


def centroid_candidates(normed: torch.Tensor, centroids: torch.Tensor, ordering: torch.Tensor,
                        embedding: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The centroid-masked sparse LM head's selection (Gemma 4 assistants' ordered embeddings):
    the ``top_k`` centroids of each row, their tokens' embeddings gathered, and only those dot
    products computed. The one routine behind :func:`scatter_candidates` (full vocabulary, for
    sampling) and :func:`sparse_argmax` (greedy drafting).

    Args:
        normed: ``[N, Hd]`` the drafter's final-norm output.
        centroids: ``[C, Hd]`` ``masked_embedding.centroids.weight``.
        ordering: int64 ``[C, V // C]`` token ids of each centroid
            (``masked_embedding.token_ordering`` viewed per centroid).
        embedding: ``[V, Hd]`` the (tied) LM head.
        top_k: centroids kept per row (``centroid_intermediate_top_k``).

    Returns:
        ``(token_ids int64 [N, top_k * V // C], logits float32 [N, top_k * V // C])``.
    """
    top = torch.topk(F.linear(normed, centroids).float(), top_k, dim=-1).indices  # [N, top_k]
    cand = ordering[top].reshape(normed.shape[0], -1)  # [N, M]
    emb = embedding[cand]  # [N, M, Hd]
    logits = torch.einsum("nh,nmh->nm", normed.float(), emb.float())
    return cand, logits


def scatter_candidates(cand: torch.Tensor, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 ``[N, vocab_size]``: the candidates' logits at their token ids, ``-inf`` elsewhere."""
    out = torch.full((cand.shape[0], vocab_size), float("-inf"), dtype=torch.float32, device=logits.device)
    return out.scatter_(1, cand, logits.float())


def sparse_argmax(cand: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: the candidate token with the largest logit in each row."""
    return cand.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)


class QOnlyAttention(nn.Module):
    """Queries from the drafter, keys/values from a target layer's paged cache."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 rotary: RotaryEmbedding, eps: float, sliding_window: Optional[int]) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.q_proj = Linear(hidden, num_heads * head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps, gemma=True)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=False)
        self.rotary = [rotary]
        self.sliding_window = sliding_window

    def gather(self, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               ctx_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's keys/values for queries at positions ``ctx_lens``: ``(k, v [N, L, Hq, D]``
        float32, ``valid bool [N, L])``. Draft positions are constant within a step, so one
        gather serves every draft step (and every drafter layer reading the same cache)."""
        L = int(ctx_lens.max())
        k, v = gather_paged_kv(kv_cache, block_tables, L)
        rep = self.num_heads // self.num_kv_heads
        k = k.float().repeat_interleave(rep, dim=2)  # [N, L, Hq, D]
        v = v.float().repeat_interleave(rep, dim=2)
        pos = torch.arange(L, device=ctx_lens.device)
        valid = pos.unsqueeze(0) < ctx_lens.unsqueeze(1)
        if self.sliding_window is not None:
            # The query sits at position ctx_len: it sees keys > ctx_len - window.
            valid &= pos.unsqueeze(0) > (ctx_lens - self.sliding_window).unsqueeze(1)
        return k, v, valid

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                block_tables: torch.Tensor, ctx_lens: torch.Tensor, kv: Optional[tuple] = None) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).reshape(n, self.num_heads, d))
        dummy = torch.zeros(n, 1, d, dtype=q.dtype, device=q.device)
        q, _ = self.rotary[0](positions, q, dummy)
        k, v, valid = kv if kv is not None else self.gather(kv_cache, block_tables, ctx_lens)
        scores = torch.einsum("nhd,nlhd->nhl", q.float(), k) * self.scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        out = torch.einsum("nhl,nlhd->nhd", scores.softmax(-1), v).to(x.dtype)
        return self.o_proj(out.reshape(n, self.num_heads * d))


class MTPLayer(nn.Module):
    """Gemma-style block with Q-only attention (four norms, gated GELU MLP)."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        head_dim = config.head_dim
        types = getattr(config, "layer_types", None)
        sliding = types is not None and types[layer_idx] == "sliding_attention"
        self.layer_type = types[layer_idx] if types is not None else "full_attention"
        scale = float(getattr(config, "query_pre_attn_scalar", head_dim)) ** -0.5
        self.self_attn = QOnlyAttention(H, config.num_attention_heads, config.num_key_value_heads, head_dim, scale,
                                        rotary, eps, config.sliding_window if sliding else None)
        self.mlp = GatedMLP(H, config.intermediate_size, getattr(config, "hidden_activation", "gelu_pytorch_tanh"))
        self.input_layernorm = RMSNorm(H, eps, gemma=True)
        self.post_attention_layernorm = RMSNorm(H, eps, gemma=True)
        self.pre_feedforward_layernorm = RMSNorm(H, eps, gemma=True)
        self.post_feedforward_layernorm = RMSNorm(H, eps, gemma=True)

    def forward(self, positions, x, kv_cache, block_tables, ctx_lens, kv=None):
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, block_tables, ctx_lens, kv)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class MTPHead(nn.Module):
    """Gemma-4-style multi-token-prediction drafter (see the module docstring).

    Args:
        config: the assistant's config: ``hidden_size`` (Hd), ``backbone_hidden_size`` (Hb),
            ``num_attention_heads``, ``num_key_value_heads`` (the target cache's), ``head_dim``,
            ``intermediate_size``, ``num_hidden_layers``, ``rms_norm_eps``, ``vocab_size``,
            optional ``layer_types`` / ``sliding_window`` / ``query_pre_attn_scalar`` / rope,
            ``use_ordered_embeddings`` / ``num_centroids`` / ``centroid_intermediate_top_k``.
        kv_layers: per drafter layer, the index of the target KV cache it reads.
        embed_target: token ids ``[N]`` -> the target's (scaled) embeddings ``[N, Hb]``.
        dtype: parameter dtype.
    """

    def __init__(self, config, kv_layers: Sequence[int], embed_target: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if len(kv_layers) != config.num_hidden_layers:
            raise ValueError(f"kv_layers: need one target cache per drafter layer ({config.num_hidden_layers}), "
                             f"got {len(kv_layers)}")
        Hd, Hb = config.hidden_size, config.backbone_hidden_size
        self.kv_layers = list(kv_layers)
        self.embed_target = embed_target
        self.vocab_size = config.vocab_size
        self.use_ordered_embeddings = bool(getattr(config, "use_ordered_embeddings", False))
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            from pagedllm.models.rope import make_rotary
            keyed = set(types) <= set((getattr(config, "rope_parameters", None) or {}))
            self.rotaries = nn.ModuleDict({t: make_rotary(config, config.head_dim, t if keyed else None)
                                           for t in sorted(set(types))})
            self.embed_tokens = nn.Embedding(config.vocab_size, Hd)
            self.pre_projection = Linear(2 * Hb, Hd, bias=False)
            self.layers = nn.ModuleList(MTPLayer(config, i, self.rotaries[types[i]])
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(Hd, config.rms_norm_eps, gemma=True)
            self.post_projection = Linear(Hd, Hb, bias=False)
            if self.use_ordered_embeddings:
                C = int(config.num_centroids)
                if C < 1 or config.vocab_size % C:
                    raise ValueError(f"num_centroids: {C} does not divide vocab_size {config.vocab_size}")
                self.top_k = int(config.centroid_intermediate_top_k)
                if not 1 <= self.top_k <= C:
                    raise ValueError(f"centroid_intermediate_top_k: must be in [1, num_centroids={C}], "
                                     f"got {self.top_k}")
                self.centroids = Linear(Hd, C, bias=False)
                self.register_buffer("token_ordering", torch.arange(config.vocab_size, dtype=torch.int64))
        finally:
            torch.set_default_dtype(prev)

    def prepare(self, kv_caches: Sequence[torch.Tensor], block_tables: torch.Tensor,
                ctx_lens: torch.Tensor) -> list[tuple]:
        """Per drafter layer, the gathered keys/values/mask it attends to (``QOnlyAttention.gather``);
        computed once per engine step and reused by every draft step (constant positions).
        Layers reading the same target cache with the same window share one gather."""
        done: dict = {}
        out = []
        for layer, kv in zip(self.layers, self.kv_layers):
            key = (kv, layer.self_attn.sliding_window)
            if key not in done:
                done[key] = layer.self_attn.gather(kv_caches[kv], block_tables, ctx_lens)
            out.append(done[key])
        return out

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                prepared: Optional[list] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for ``N`` requests.

        Args:
            token_ids: int64 ``[N]`` the last token (sampled or drafted).
            hidden: ``[N, Hb]`` the backbone-sized hidden state (see the module docstring).
            kv_caches: the target's per-layer paged caches.
            block_tables: int64 ``[N, max_blocks]`` each request's target block table.
            ctx_lens: int64 ``[N]`` tokens in the target cache (``p + 1``); the query position.
            prepared: :meth:`prepare`'s output for these arguments (None: gathered here).

        Returns:
            ``(normed [N, Hd]`` for :meth:`compute_logits`, ``h_next [N, Hb])``.
        """
        x = self.pre_projection(torch.cat([self.embed_target(token_ids).to(hidden.dtype), hidden], dim=-1))
        if prepared is None:
            prepared = self.prepare(kv_caches, block_tables, ctx_lens)
        positions = ctx_lens
        for layer, kv in zip(self.layers, prepared):
            x = layer(positions, x, None, block_tables, ctx_lens, kv)
        normed = self.norm(x)
        return normed, self.post_projection(normed)

    def candidates(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The centroid path's ``(token_ids, logits)`` (:func:`centroid_candidates`); needs
        ``use_ordered_embeddings``."""
        C = self.centroids.weight.shape[0]
        return centroid_candidates(normed, self.centroids.weight, self.token_ordering.view(C, -1),
                                   self.embed_tokens.weight, self.top_k)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, vocab]`` through the tied drafter embedding (with ordered embeddings:
        the selected centroids' tokens only, ``-inf`` elsewhere)."""
        if self.use_ordered_embeddings:
            return scatter_candidates(*self.candidates(normed), self.vocab_size)
        return F.linear(normed, self.embed_tokens.weight).float()

    def greedy(self, normed: torch.Tensor) -> torch.Tensor:
        """int64 ``[N]`` greedy drafts: the dense argmax, or with ordered embeddings the sparse
        argmax over the selected candidates (no full-vocabulary row is built)."""
        if self.use_ordered_embeddings:
            return sparse_argmax(*self.candidates(normed))
        return self.compute_logits(normed).argmax(-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``gemma4_assistant`` checkpoint names (see the module docstring).

        Raises:
            ValueError: unexpected names (e.g. ``masked_embedding.*`` without
                ``use_ordered_embeddings``), shape mismatches, or missing parameters.
        """
        from pagedllm.spec_decode.eagle import _load

        def rename(n: str) -> Optional[str]:
            if n == "lm_head.weight":
                return None  # tied
            if self.use_ordered_embeddings and n.startswith("masked_embedding."):
                return {"masked_embedding.centroids.weight": "centroids.weight",
                        "masked_embedding.token_ordering": "token_ordering"}.get(n, n)
            return n.removeprefix("model.")
        weights = list(weights)
        if self.use_ordered_embeddings:
            names = {n for n, _ in weights}
            need = ["masked_embedding.centroids.weight", "masked_embedding.token_ordering"]
            if not set(need) <= names:
                raise ValueError(f"use_ordered_embeddings: the checkpoint lacks {sorted(set(need) - names)}")
        # NOTE: q_proj stays its own module (no k/v to pack with); gate/up are packed.
        loaded = _load(self, weights, rename, {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)})
        if self.use_ordered_embeddings:
            order = self.token_ordering
            if not torch.equal(torch.sort(order).values, torch.arange(self.vocab_size, device=order.device)):
                raise ValueError("masked_embedding.token_ordering: must be a permutation of the vocabulary")
        return loaded


def default_mtp_kv_layers(target_layer_types: Sequence[str], draft_layer_types: Sequence[str],
                          num_kv_shared_layers: int = 0) -> list[int]:
    """Each drafter layer reads the target's last non-shared layer of the same attention type
    (Gemma 4: sliding drafter layers -> the target's last sliding layer, full -> its last full
    layer). The last ``num_kv_shared_layers`` target layers reuse earlier layers' caches (Gemma
    3n / 4) and are skipped.

    Raises:
        ValueError: a drafter layer type the target does not have.
    """
    own = list(target_layer_types)[:len(target_layer_types) - int(num_kv_shared_layers or 0)]
    last = {t: i for i, t in enumerate(own)}
    try:
        return [last[t] for t in draft_layer_types]
    except KeyError as e:
        raise ValueError(f"the target has no {e.args[0]!r} layer for the drafter to read") from None


__all__ = ["MTPHead", "centroid_candidates", "default_mtp_kv_layers", "gather_paged_kv", "scatter_candidates",
           "sparse_argmax"]
