"""Shared model building blocks: norms, rotary embedding, fused linears, gated MLP, attention block.

All tensors are flat over the step's tokens: ``[T, ...]``, no batch dimension.
Parameters are created uninitialised (``torch.empty``): every one is expected from ``load_weights``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm._custom_ops import cpu_op

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class Linear(nn.Linear):
    """``nn.Linear`` without random init (weights come from the checkpoint).

    ``quant_method``: the layer's one hook. None (the default) runs ``F.linear`` on the float
    ``weight``; a ``LinearMethodBase`` attached from outside the model (a quantization format,
    oneDNN-packed bf16 ``kernels.onednn``, the batch-invariant GEMM ``worker.batch_invariant``)
    owns how the weight is stored and runs ``quant_method.apply(self, x, self.bias)`` instead.
    """

    quant_method = None

    def reset_parameters(self) -> None:  # NOTE: skipping init saves seconds on big models
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qm = self.quant_method
        if qm is not None:
            return qm.apply(self, x, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without random init.

    Inside a forward whose ``ForwardContext.inputs_embeds`` is set (prompt embeddings), those
    rows of the output are the given embeddings instead of the lookup.

    ``quant_method``: None (a float table) or a ``pagedllm.quantization`` embedding method that
    keeps the table quantized and dequantizes the looked-up rows (``quant_method.embedding``).
    """

    quant_method = None

    def reset_parameters(self) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        qm = self.quant_method
        out = qm.embedding(self, ids) if qm is not None else F.embedding(ids, self.weight)
        from pagedllm.attention.backend import current_forward_context
        ctx = current_forward_context()
        if ctx is not None and ctx.inputs_embeds is not None and ids.dim() == 1:
            # NOTE: prompt embeddings (--enable-prompt-embeds) replace the rows of their
            # placeholder ids; whatever the model does next (Gemma's scale, ...) applies to both.
            rows, embeds = ctx.inputs_embeds
            out = out.index_copy(0, rows.to(out.device), embeds.to(out.device, out.dtype))
        return out


class PackedLinear(Linear):
    """One linear holding several checkpoint matrices stacked along the output dim.

    Args:
        in_features: input size.
        shard_sizes: ``{shard_id: out_features}`` in stacking order (e.g. q, k, v or 0, 1).
        bias: whether there is a bias (packed the same way).

    ``param.weight_loader(param, tensor, shard_id)`` copies one checkpoint tensor into its rows.
    """

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict = {}
        off = 0
        for sid, size in shard_sizes.items():
            self.shard_offsets[sid] = (off, size)
            off += size
        for p in self.parameters():
            p.weight_loader = self._load_shard
            p.shard_ids = tuple(shard_sizes)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
        off, size = self.shard_offsets[shard_id]
        if tensor.shape[0] != size or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"shard {shard_id!r}: got shape {tuple(tensor.shape)}, expected "
                             f"{(size, *param.shape[1:])}")
        param.data[off : off + size].copy_(tensor)


class QKVLinear(PackedLinear):
    """Fused q/k/v projection: ``[T, hidden] -> [T, (Hq + 2 Hkv) * D]`` (shards "q", "k", "v")."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__(hidden, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                  "v": num_kv_heads * head_dim}, bias=bias)


def residual_norm(norm: Callable[..., Any], x: torch.Tensor,
                  residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's first norm with vLLM's residual passing: ``(norm(x), x)`` in the first
    layer (``residual`` None), else ``norm(x, residual)`` (the previous layer's add folded into
    the norm, ``RMSNorm.forward``). ``norm`` may be any module with that call shape (an EAGLE
    head's identity norm)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 as HF does.

    ``gemma=False`` (Llama/Qwen): ``w * normed.to(x.dtype)``; weight starts at 1.
    ``gemma=True``: ``(normed * (1 + w.float())).to(x.dtype)``; weight starts at 0.
    """

    def __init__(self, dim: int, eps: float = 1e-6, gemma: bool = False) -> None:
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self._eff_weight: Optional[torch.Tensor] = None
        self._weight_key: Optional[tuple] = None

    def _effective_weight(self) -> torch.Tensor:
        """The float32 multiplier (``w``, or ``1 + w`` for Gemma), cached per weight version."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._eff_weight is None or self._weight_key != key:
            w = self.weight.detach().float()
            self._eff_weight, self._weight_key = ((1.0 + w) if self.gemma else w).contiguous(), key
        return self._eff_weight

    #: how the norm is computed: None = ``forward_native``; a method object (``apply(norm, x,
    #: residual)``) attached from outside: W8A8's quantizing norm, the batch-invariant norm
    norm_method = None

    @property
    def quantize_output(self) -> bool:
        """Whether this norm emits W8A8-quantized rows (its method says so)."""
        return bool(getattr(self.norm_method, "quantize_output", False))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """RMSNorm of ``x [..., dim]``; with ``residual`` (same shape) the sum ``x + residual`` is
        normalized and ``(out, x + residual)`` is returned (vLLM's fused add + norm)."""
        m = self.norm_method
        if m is not None:
            return m.apply(self, x, residual)
        return self.forward_native(x, residual)

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """``forward`` without a method. On CPU with the C++ kernels (2-D contiguous
        float32/bfloat16 input) this is one pass and the residual tensor is updated in place."""
        if x.dim() == 2 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            if residual is None or (residual.dtype == x.dtype and residual.is_contiguous()):
                rms_norm = cpu_op("rms_norm")
                if rms_norm is not None:
                    out = rms_norm(x.contiguous(), residual, self._effective_weight(), self.eps)
                    return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            out = (xf * (1.0 + self.weight.float())).to(x.dtype)
        else:
            out = self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, gemma={self.gemma}"


def rope_inv_freq(config, head_dim: int, layer_type: Optional[str] = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[D/2]`` float32 and the cos/sin scaling for a config's rope.

    Reads ``config.rope_parameters`` (transformers >= 5: flat, or keyed by layer type as in
    Gemma 3) or the older ``rope_theta``/``rope_scaling``. Non-default rope types use
    transformers' own init functions; dynamically rescaled types are refused.

    Raises:
        NotImplementedError: for "dynamic" / "longrope" rope types.
    """
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    else:
        layer_type = None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        # NOTE: partial rotary (Phi-3/4, ...): only the first int(D * factor) dims rotate, as in transformers.
        dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """HF-style rope (``rotate_half``, ``cat(freqs, freqs)``) at arbitrary per-token positions.

    The cos/sin table (float32 ``[n, D]``, ``n`` a power of two >= 1024) lives on the device of the
    positions it is given and grows on demand to the largest position seen. On CPU only its first
    ``R/2`` columns are kept (``_cos_half`` / ``_sin_half``, what the in-place C++ rope and the fused
    decode read); the full ``[n, D]`` tables (``_cos`` / ``_sin``, for ``forward``) are built from the
    same formula on first use, so a model on the C++ path holds a third of the bytes (Gemma 3: 8
    instead of 24 MiB at 4,096 positions, 64 instead of 192 at 32,768; issue 30.4). The growth check reads
    ``positions.max()`` once per step (every layer passes the same ``positions`` tensor), which is
    free on CPU but a device sync on CUDA; ``reserve(max_model_len, device)`` sizes the table up
    front so CUDA steps skip the check, which CUDA-graph capture requires (no syncs while
    capturing, and a captured graph keeps the table's address).
    """

    def __init__(self, head_dim: int, inv_freq: torch.Tensor, scaling: float = 1.0,
                 row_inv_freq: Optional[Callable[[int], torch.Tensor]] = None) -> None:
        super().__init__()
        self.head_dim, self.scaling = head_dim, scaling
        self.inv_freq = inv_freq.float()
        # Rotated dims R = 2 * len(inv_freq) <= D: the first R dims of each head rotate, the rest pass through
        # (partial rotary, as transformers' apply_rotary_pos_emb).
        self.rotary_dim = 2 * self.inv_freq.numel()
        # Position-dependent frequencies (dynamic NTK, longrope): n -> float32 [n, R/2], row p = the
        # inverse frequencies a token at position p is rotated with (see models/rope.py).
        self.row_inv_freq = row_inv_freq
        self._full: Optional[tuple[torch.Tensor, torch.Tensor]] = (torch.empty(0, head_dim), torch.empty(0, head_dim))
        self._cos_half = self._sin_half = torch.empty(0, head_dim // 2)
        self._rows, self._table_device = 0, torch.device("cpu")  # the table's positions and device
        self._reserved = 0  # positions below this are covered on the table's device without a check
        self._checked_positions: Optional[torch.Tensor] = None  # the last positions checked against the table

    def _full_table(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 ``[n, D]`` (``n`` as given) on ``device``, times the scaling."""
        inv_freq = (self.row_inv_freq(n) if self.row_inv_freq is not None else self.inv_freq.unsqueeze(0)).to(device)
        freqs = torch.arange(n, dtype=torch.float, device=device).unsqueeze(1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def _table(self, n: int, device: torch.device) -> None:
        n = 1 << max(10, math.ceil(math.log2(max(n, 1))))
        cos, sin = self._full_table(n, device)
        half = self.rotary_dim // 2
        self._cos_half, self._sin_half = cos[:, :half].contiguous(), sin[:, :half].contiguous()
        self._rows, self._table_device = n, cos.device
        # NOTE: off CPU (CUDA graphs keep the table's address; no allocation while capturing) the full
        # table stays; on CPU it is rebuilt by the same code when ``forward`` first needs it.
        self._full = (cos, sin) if device.type != "cpu" else None

    def _full_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._full is None:
            self._full = self._full_table(self._rows, self._table_device)
        return self._full

    @property
    def _cos(self) -> torch.Tensor:
        """cos float32 ``[n, D]`` (built on first use on CPU); assigning an empty tensor drops the table."""
        return self._full_pair()[0]

    @_cos.setter
    def _cos(self, value: torch.Tensor) -> None:
        if value.shape[0]:
            raise ValueError("RotaryEmbedding._cos: only an empty tensor may be assigned (drops the table)")
        self._table_device = value.device
        self._rows = 0
        self._full = (value.new_empty(0, self.head_dim), value.new_empty(0, self.head_dim))
        self._cos_half = self._sin_half = value.new_empty(0, self.head_dim // 2)

    def drop_table(self) -> None:
        """Forget the table (kept on its device); the next use rebuilds it."""
        self._cos = self._cos_half[:0]

    @property
    def _sin(self) -> torch.Tensor:
        """sin float32 ``[n, D]`` (built on first use on CPU)."""
        return self._full_pair()[1]

    def reserve(self, n: int, device: torch.device | str) -> None:
        """Build the table for positions ``0 .. n-1`` on ``device`` now (e.g. ``max_model_len``
        before CUDA-graph capture); later steps on that device do not check positions."""
        device = torch.device(device)
        if self._table_device != device or self._rows < n:
            self._table(max(n, self._rows), device)
        self._reserved = n
        self._checked_positions = None

    def _ensure(self, positions: torch.Tensor) -> None:
        """Make the table cover ``positions`` on their device (checked once per positions tensor)."""
        if positions is self._checked_positions:  # NOTE: every layer passes the same tensor
            return
        if self._table_device != positions.device:
            self._table(max(self._rows, self._reserved), positions.device)
        if positions.numel() and (positions.device.type == "cpu" or self._reserved == 0):
            top = int(positions.max())
            if top >= self._rows:
                self._table(top + 1, positions.device)
        self._checked_positions = positions

    def apply_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Like ``forward`` but may rotate ``q``/``k`` in place (they must not be needed unrotated).

        On CPU with the C++ kernels this is one pass over q and k in float32 math with no
        temporaries (``rotary_inplace``); otherwise it is ``forward``.
        """
        rotary = cpu_op("rotary_inplace") if q.device.type == "cpu" and self.rotary_dim == self.head_dim else None
        if (rotary is None or q.dtype not in (torch.float32, torch.bfloat16)
                or q.stride(-1) != 1 or k.stride(-1) != 1 or positions.dtype != torch.int64):
            return self.forward(positions, q, k)
        self._ensure(positions)
        rotary(q, k, positions.contiguous(), self._cos_half, self._sin_half)
        return q, k

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 ``[T]`` (on q's device); q ``[T, Hq, D]``, k ``[T, Hkv, D]`` -> rotated, same dtypes."""
        self._ensure(positions)
        cos = self._cos[positions].to(q.dtype).unsqueeze(1)
        sin = self._sin[positions].to(q.dtype).unsqueeze(1)
        r = self.rotary_dim
        if r != self.head_dim:  # partial rotary: the dims past R pass through unchanged
            qr, kr = q[..., :r], k[..., :r]
            return (torch.cat((qr * cos + _rotate_half(qr) * sin, q[..., r:]), -1),
                    torch.cat((kr * cos + _rotate_half(kr) * sin, k[..., r:]), -1))
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def reserve_rope_tables(model: nn.Module, n: int, device: torch.device | str) -> int:
    """``reserve(n, device)`` on every rope of ``model`` (shared ropes sit in lists/dicts, not
    submodules, so they are reached through the attention blocks); returns how many."""
    seen: dict[int, RotaryEmbedding] = {}
    for m in model.modules():
        r = getattr(m, "rotary", None)
        for cand in (r.values() if isinstance(r, dict) else r if isinstance(r, (list, tuple)) else [r]):
            if isinstance(cand, RotaryEmbedding):
                seen[id(cand)] = cand
    for r in seen.values():
        r.reserve(n, device)
    return len(seen)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate/up fused into ``gate_up_proj`` (shards 0, 1)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {sorted(ACTIVATIONS)}")
        self.gate_up_proj = PackedLinear(hidden, {0: intermediate, 1: intermediate}, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    #: how ``act(gate) * up`` is computed from the fused ``[T, 2I]`` output: None = in torch (or
    #: the gate/up method's ``apply_act_and_mul``); a method object (``apply(mlp, gate_up)``)
    #: attached from outside (the batch-invariant row-wise kernel)
    act_method = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]`` (or what the gate/up projection's quantization method takes) -> ``[T, hidden]``."""
        am = self.act_method
        if am is not None:
            return self.down_proj(am.apply(self, self.gate_up_proj(x)))
        qm = self.gate_up_proj.quant_method
        if qm is not None:
            # NOTE: a method may compute act(gate) * up in its own form (W8A8: int8 rows for down_proj)
            h = qm.apply_act_and_mul(self.gate_up_proj, x, self.act)
            if h is not None:
                return self.down_proj(h)
        gu = self.gate_up_proj(x)
        if self.act is F.silu and gu.dtype in (torch.float32, torch.bfloat16) and gu.device.type == "cpu":
            # NOTE: the fused CPU decode step (fused_decode.cpp act_mul) computes the same
            silu_and_mul = cpu_op("silu_and_mul")
            if silu_and_mul is not None:
                lead, n2 = gu.shape[:-1], gu.shape[-1]
                return self.down_proj(silu_and_mul(gu.reshape(-1, n2)).reshape(*lead, n2 // 2))
        gate, up = gu.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SelfAttention(nn.Module):
    """qkv projection -> optional per-head q/k norm -> rope -> paged attention -> o_proj.

    Args:
        hidden, num_heads, num_kv_heads, head_dim: sizes.
        layer_idx: which KV cache this layer uses.
        rotary: a (possibly shared) ``RotaryEmbedding``.
        scale: softmax scale.
        qkv_bias, o_bias: biases of the projections.
        qk_norm: factory ``dim -> nn.Module`` for per-head q/k norms (Qwen3, Gemma 3), or None.
        qk_norm_per_head: False = the q/k norms span all heads (``dim`` = Hq*D / Hkv*D: OLMo 2, OLMoE).
        clip_qkv: clamp q, k, v to ``[-clip, clip]`` after the norms (OLMoE), or None.
        sliding_window, soft_cap: passed to ``Attention``.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, scale: float, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: Optional[Callable[[int], nn.Module]] = None,
                 sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                 qk_norm_per_head: bool = True, clip_qkv: Optional[float] = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj = QKVLinear(hidden, num_heads, num_kv_heads, head_dim, qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=o_bias)
        self.qk_norm_per_head, self.clip_qkv = qk_norm_per_head, clip_qkv
        q_dim, k_dim = (head_dim, head_dim) if qk_norm_per_head else (num_heads * head_dim, num_kv_heads * head_dim)
        self.q_norm = qk_norm(q_dim) if qk_norm else None
        self.k_norm = qk_norm(k_dim) if qk_norm else None
        self.rotary = [rotary]  # NOTE: a list, so a shared rope is not registered as a submodule
        self.attn = Attention(num_heads, head_dim, scale, num_kv_heads, layer_idx, sliding_window, soft_cap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions int64 ``[T]`` (``[3, T]``: M-RoPE), x ``[T, hidden]`` (or a W8A8 ``QuantizedActivation``) -> ``[T, hidden]``."""
        t, d = positions.shape[-1], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:
            q, k, v = (y.clamp(-self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q, k = q.reshape(t, self.num_heads, d), k.reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0].apply_(positions, q, k)  # NOTE: q/k are fresh views of qkv: in place is safe
        return self.o_proj(self.attn(q, k, v))


class LogitsProcessor(nn.Module):
    """hidden ``[N, hidden]`` -> float32 logits ``[N, vocab]``: the LM head's GEMM (through its own
    ``quant_method``), the tensor-parallel gather, ``1 / logits_scaling`` and the final soft cap.

    ``forward(head, hidden)`` takes the model's LM head: an untied ``lm_head`` (a ``Linear``, which
    runs its own ``quant_method``), or for tied embeddings the ``Embedding``, whose table is used
    through ``tied_head`` when set (a quantized copy of the table), else through this module's
    ``quant_method`` (a ``LinearMethodBase`` applied to the embedding as the layer: the
    oneDNN-packed table, the batch-invariant GEMM), else ``F.linear`` on the table.

    Attributes:
        tied_head: a separate quantized ``Linear`` for a tied head, or None.
        quant_method: the tied table's linear method, or None.
        tp_vocab: ``(vocab, padded)`` with tensor parallelism: this rank's vocabulary-sharded
            logits are gathered onto TP rank 0 (None on the other ranks) and cut to ``vocab``.
        emits_logits: False on a pipeline stage before the last (returns None).
        logits_scaling: a divisor of the logits (Granite's ``config.logits_scaling``), or None.
        soft_cap: ``config.final_logit_softcapping`` (``tanh(x / cap) * cap``), or None.
    """

    def __init__(self, soft_cap: Optional[float] = None, logits_scaling: Optional[float] = None) -> None:
        super().__init__()
        self.tied_head: Optional[Linear] = None
        self.quant_method = None
        self.tp_vocab: Optional[tuple[int, int]] = None
        self.emits_logits = True
        self.soft_cap, self.logits_scaling = soft_cap, logits_scaling

    def forward(self, head: nn.Module, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        if not self.emits_logits:
            return None
        if not isinstance(head, nn.Embedding):
            logits = head(hidden).float()
        elif self.tied_head is not None:
            logits = self.tied_head(hidden).float()
        elif self.quant_method is not None:
            logits = self.quant_method.apply(head, hidden, None).float()
        else:
            logits = F.linear(hidden, head.weight).float()
        if self.tp_vocab is not None:
            from pagedllm.distributed.parallel_state import get_tp_group

            vocab = self.tp_vocab[0]
            logits = get_tp_group().gather(logits, dim=-1)
            if logits is None:
                return None
            if logits.shape[-1] != vocab:
                logits = logits[:, :vocab].contiguous()
        if self.soft_cap:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        return logits
