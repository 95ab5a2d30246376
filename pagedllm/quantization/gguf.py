"""GGUF files run in their own block formats (``quant_method`` / ``--quantization`` "gguf", the
default for a quantized GGUF file).

Each llama.cpp block type maps exactly onto the engine's group layout (``group_quant``): the codes
are unpacked once at load and keep their bit width class, the block's scales become float32 per
group (computed with the same float32 operations as gguf-py's dequantizer, so ``scale * code +
min`` is bit-identical to it; Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 keep them float16, the file's own
fields, which the kernels widen exactly):

| GGUF type | codes | group | value (gguf-py / llama.cpp ``dequantize_row_*``) |
|---|---|---|---|
| Q8_0 | int8 | 32 | ``d * q`` |
| Q4_0 | int4 (0..15) | 32 | ``d * (q - 8)`` = ``d * q + (-8 d)`` (exact: both products fit float32) |
| Q4_1 | int4 | 32 | ``d * q + m`` |
| Q5_0 | int8 (-16..15) | 32 | ``d * (q - 16)`` |
| Q5_1 | int8 (0..31) | 32 | ``d * q + m`` |
| Q2_K | int4 (0..3) | 16 | ``(d * sc) * q - (dmin * m)`` |
| Q3_K | int4 (0..7) | 16 | ``(d * (sc - 32)) * (q - 4)`` = ``dl * q + (-4 dl)`` (exact) |
| Q4_K | int4 | 32 | ``(d * sc) * q - (dmin * m)`` |
| Q5_K | int8 (0..31) | 32 | ``(d * sc) * q - (dmin * m)`` |
| Q6_K | int8 (-32..31) | 16 | ``(d * sc) * q`` |

``x - y`` is stored as ``x + (-y)`` (the same IEEE result). Other block types (IQ*, TQ*, MXFP4)
have no kernel here: their tensors are dequantized at load (gguf-py, bit-exact) with a log line
naming them. F32/F16/BF16 tensors load as float.

A fused projection whose shards have different types (Gemma 3 Q4_K_M: q/k Q5_0, v Q8_0 or Q5_0;
other files: Q4_K beside Q6_K) is stored in the widest common layout (int4 codes as int8, groups
split to the smallest size), still exact.

Tied embeddings: the table stays quantized (lookups dequantize the selected rows) and the LM head
runs the group GEMM on the same tensors (no second copy).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from pagedllm.quantization import group_quant as gq
from pagedllm.quantization.base import QuantizationConfig, register_quantization_config, set_weight_attrs

logger = logging.getLogger("pagedllm")

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _qtype(t: Any):
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(int(t))


def is_block_type(ggml_type: Any) -> bool:
    """Whether a GGUF tensor type is a quantized block format (not F32/F16/BF16/F64/integer)."""
    return _qtype(ggml_type).name not in _FLOAT_TYPES + ("I8", "I16", "I32", "I64")


class GGUFRawTensor:
    """A GGUF tensor's blocks as the loader yields them for ``GGUFConfig``'s methods.

    Attributes:
        data: uint8 numpy ``[rows, row_bytes]`` (a view of the mapped file, or a copy for llama's
            un-permuted q/k rows).
        ggml_type: ``gguf.GGMLQuantizationType``.
        shape: row-major ``(rows, K)``.
        name: the GGUF tensor name (for log lines).
    """

    __slots__ = ("data", "ggml_type", "shape", "name")

    def __init__(self, data: np.ndarray, ggml_type: Any, shape: tuple, name: str = "") -> None:
        self.data, self.ggml_type, self.shape, self.name = data, _qtype(ggml_type), tuple(shape), name

    def dequantize(self) -> torch.Tensor:
        """float32 ``shape`` by gguf-py (the reference)."""
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(dequantize(self.data, self.ggml_type))).reshape(self.shape)


# ----------------------------------------------------------------------------- block converters
def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row -> float32 ``[nb, 1]`` (f16 -> f32 is exact)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int, run: int) -> np.ndarray:
    """``[nb, n/2]`` bytes -> ``[nb, n]`` codes: ``qs`` is made of runs of ``run`` bytes, each
    holding ``2 run`` values, the low nibbles first, then the high ones (llama.cpp's order: runs
    of 16 in Q4_0/Q4_1/Q5_*, of 32 in Q4_K/Q5_K)."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(nb, n)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block (llama.cpp
    ``get_scale_min_k4``)."""
    nb = scales.shape[0]
    s = scales.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _convert_blocks(name: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], int, int]:
    """Blocks ``[nb, type_size]`` of type ``name`` -> (codes ``[nb, block]``, scales ``[nb, g]``,
    mins or None, kind, group) with ``g`` groups per block; None-returning types are handled by
    the caller."""
    nb = b.shape[0]
    if name == "Q8_0":
        return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, gq.KIND_INT8, 32
    if name == "Q4_0":
        d = _f16(b[:, :2])
        return _nibbles(b[:, 2:], 32, 16), d, d * np.float32(-8), gq.KIND_INT4, 32
    if name == "Q4_1":
        return _nibbles(b[:, 4:], 32, 16), _f16(b[:, :2]), _f16(b[:, 2:4]), gq.KIND_INT4, 32
    if name in ("Q5_0", "Q5_1"):
        off = 2 if name == "Q5_0" else 4
        qh = np.ascontiguousarray(b[:, off:off + 4]).view(np.uint32)
        qh = ((qh >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1).astype(np.uint8)
        q = _nibbles(b[:, off + 4:], 32, 16) | (qh << 4)
        if name == "Q5_0":
            return (q.astype(np.int16) - 16).astype(np.int8), _f16(b[:, :2]), None, gq.KIND_INT8, 32
        return q.astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4]), gq.KIND_INT8, 32
    if name == "Q2_K":
        scales, qs = b[:, :16], b[:, 16:80]
        d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
        dl = d * (scales & 0x0F).astype(np.float32)
        ml = dmin * (scales >> 4).astype(np.float32)
        q = (qs.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        return q.reshape(nb, 256), dl, -ml, gq.KIND_INT4, 16
    if name == "Q3_K":
        hmask, qs, sc12 = b[:, :32], b[:, 32:96], b[:, 96:108]
        d = _f16(b[:, 108:110])
        lo = (sc12[:, :8].reshape(nb, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(nb, 16)
        hi = (sc12[:, 8:].reshape(nb, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(nb, 16)
        sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int8) - np.int8(32)
        dl = d * sc.astype(np.float32)
        ql = (qs.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        qh = (hmask.reshape(nb, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        # value = dl * (ql - 4 * (1 - h)) = dl * (ql + 4 h) + (-4 dl)
        q = ql.reshape(nb, 256) + (qh.reshape(nb, 256) << 2)
        return q.astype(np.uint8), dl, dl * np.float32(-4), gq.KIND_INT4, 16
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        dl = d * sc.astype(np.float32)
        ml = dmin * mn.astype(np.float32)
        if name == "Q4_K":
            return _nibbles(b[:, 16:144], 256, 32), dl, -ml, gq.KIND_INT4, 32
        qh, qs = b[:, 16:48], b[:, 48:176]
        ql = _nibbles(qs, 256, 32)
        h = ((qh.reshape(nb, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1).reshape(nb, 8, 32)
        q = ql.reshape(nb, 8, 32) | (h.reshape(nb, 8, 32) << 4)
        return q.reshape(nb, 256).astype(np.int8), dl, -ml, gq.KIND_INT8, 32
    if name == "Q6_K":
        ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8)
        d = _f16(b[:, 208:210])
        dl = d * sc.astype(np.float32)
        lo = ((ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F)
        lo = lo.reshape(nb, 8, 32)
        hi = ((qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
        hi = hi.reshape(nb, 8, 32)
        q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
        return q.reshape(nb, 256), dl, None, gq.KIND_INT8, 16
    raise KeyError(name)


#: block types with an exact mapping onto the group layout
NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

#: types whose scales (and mins) are the file's own float16 fields: kept float16 in the group layout
HALF_SCALE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def gguf_to_group(raw: GGUFRawTensor) -> Optional[gq.GroupWeight]:
    """A GGUF tensor's blocks in the group layout (exact), or None for a type without a mapping."""
    from gguf.constants import GGML_QUANT_SIZES

    name = raw.ggml_type.name
    if name not in NATIVE_TYPES:
        return None
    block, size = GGML_QUANT_SIZES[raw.ggml_type]
    rows, k = raw.shape[0], raw.shape[-1]
    blocks = np.ascontiguousarray(raw.data).reshape(-1, size)
    codes, scales, mins, kind, group = _convert_blocks(name, blocks)
    g = k // group
    # the f16-field types keep d (and m) as float16: exactly the file's values, half the bytes of
    # float32 (a Q4 weight's 0.25 of 0.75 bytes); kept float32 where a value is not a float16 (Q4_0's
    # -8 d past the float16 range) and for the K-quants (d * sc products)
    sdt = np.float32
    if name in HALF_SCALE_TYPES:
        sh = scales.astype(np.float16)
        mh = None if mins is None else mins.astype(np.float16)
        if (np.array_equal(sh.astype(np.float32), scales, equal_nan=True)
                and (mins is None or np.array_equal(mh.astype(np.float32), mins, equal_nan=True))):
            sdt = np.float16
    return gq.GroupWeight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, k)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=sdt).reshape(rows, g)),
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins, dtype=sdt).reshape(rows, g)),
        kind, group)


# ----------------------------------------------------------------------------- methods
def _shard_order(layer: nn.Module) -> list:
    offsets = getattr(layer, "shard_offsets", None)
    return list(offsets) if offsets else [None]


class GGUFLinearMethod(gq.GroupQuantLinearMethod):
    """A linear layer loaded from GGUF tensors (one per shard for fused q/k/v and gate/up).

    ``create_weights`` swaps the float ``weight`` for an empty placeholder whose loader keeps each
    shard (converted to the group layout at once, so the mapped file pages are not needed after
    loading); ``process_weights_after_loading`` stacks the shards. Float shards (F32/F16 tensors)
    and block types without a mapping make the whole layer float (dequantized by gguf-py, logged).
    Calls on int4 / int8 group-32 layers run the integer-dot kernel at every M (``group_quant``).
    """

    intdot = True

    def create_weights(self, layer, prefix: str = "", params_dtype: torch.dtype = torch.float32, **kwargs):
        layer.gguf_prefix, layer.gguf_dtype = prefix, params_dtype
        layer.gguf_shards = {}
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(placeholder, weight_loader=self._load, output_dim=0, input_dim=1,
                         gguf_owner=weakref.ref(layer))
        ids = _shard_order(layer)
        if ids != [None]:
            placeholder.shard_ids = tuple(ids)
        layer.weight = placeholder

    @staticmethod
    def _load(param: nn.Parameter, tensor, shard_id=None) -> None:
        layer = param.gguf_owner()
        layer.gguf_shards[shard_id] = _convert_shard(tensor, layer)

    def process_weights_after_loading(self, layer):
        parts = [layer.gguf_shards.get(sid) for sid in _shard_order(layer)]
        if any(p is None for p in parts):
            raise ValueError(f"{layer.gguf_prefix}: GGUF tensors missing for shards {_shard_order(layer)}")
        del layer.gguf_shards
        if all(isinstance(p, gq.GroupWeight) for p in parts):
            try:
                gq.install(layer, gq.merge(parts))
                return
            except ValueError as e:  # shards that share no layout (not produced by llama.cpp)
                logger.warning("pagedllm: gguf: %s dequantized to %s (%s)", layer.gguf_prefix,
                               str(layer.gguf_dtype).replace("torch.", ""), e)
        w = torch.cat([p.dequantize() if isinstance(p, gq.GroupWeight) else p.float() for p in parts])
        layer.weight = nn.Parameter(w.to(layer.gguf_dtype).contiguous(), requires_grad=False)
        layer.quant_method = None


def _convert_shard(tensor, layer: nn.Module):
    """A loaded shard: ``GroupWeight`` for a mapped block type, else a float tensor."""
    if isinstance(tensor, GGUFRawTensor):
        gw = gguf_to_group(tensor)
        if gw is not None:
            return gw
        logger.warning("pagedllm: gguf: %s (%s) has no kernel for %s blocks; dequantized to %s at load",
                       tensor.name, layer.gguf_prefix, tensor.ggml_type.name,
                       str(layer.gguf_dtype).replace("torch.", ""))
        return tensor.dequantize()
    return tensor.detach().float()


class GGUFEmbeddingMethod(gq.GroupQuantEmbeddingMethod):
    """An embedding table loaded from a GGUF tensor, kept in the group layout when its block type
    maps (lookups dequantize the selected rows, bit-identical to the dequantized table)."""

    def create_weights(self, layer, prefix: str = "", params_dtype: torch.dtype = torch.float32, **kwargs):
        self.dtype = params_dtype
        layer.gguf_prefix, layer.gguf_dtype = prefix, params_dtype
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(placeholder, weight_loader=GGUFLinearMethod._load, gguf_owner=weakref.ref(layer))
        layer.gguf_shards = {}
        layer.weight = placeholder

    def process_weights_after_loading(self, layer):
        part = layer.gguf_shards.get(None)
        if part is None:
            raise ValueError(f"{layer.gguf_prefix}: GGUF tensor missing")
        del layer.gguf_shards
        if isinstance(part, gq.GroupWeight):
            gq.install(layer, part)
            layer.weight = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
            return
        layer.weight = nn.Parameter(part.to(self.dtype).contiguous(), requires_grad=False)
        layer.quant_method = None


@register_quantization_config("gguf")
class GGUFConfig(QuantizationConfig):
    """A GGUF file's tensor types (``from_gguf``): every linear and the token embedding read their
    tensors' blocks; the tied LM head shares the embedding's quantized tensors."""

    def __init__(self, tensor_types: Optional[dict] = None) -> None:
        super().__init__()
        self.tensor_types = dict(tensor_types or {})

    @classmethod
    def from_config(cls, config: dict) -> "GGUFConfig":
        raise ValueError("'gguf' is read from .gguf files, not from a config.json quantization_config")

    @classmethod
    def from_gguf(cls, gguf_file) -> "GGUFConfig":
        """From an opened ``loader.gguf_file.GGUFFile``: the type of each tensor."""
        return cls({name: info.ggml_type for name, info in gguf_file.tensors.items()})

    def has_quantized_tensors(self) -> bool:
        return any(is_block_type(t) for t in self.tensor_types.values())

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensor_types.values():
            counts[_qtype(t).name] = counts.get(_qtype(t).name, 0) + 1
        kept = {k: v for k, v in counts.items() if k in NATIVE_TYPES}
        other = {k: v for k, v in counts.items() if k not in NATIVE_TYPES and k not in _FLOAT_TYPES}
        return f"gguf (blocks kept: {kept}" + (f"; dequantized at load: {other}" if other else "") + ")"

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, nn.Embedding):
            return GGUFEmbeddingMethod(getattr(layer.weight, "dtype", torch.float32))
        if isinstance(layer, nn.Linear):
            return GGUFLinearMethod()
        return None

    def tied_lm_head_method(self, model):
        embed = model.model.embed_tokens
        if not isinstance(embed.quant_method, GGUFEmbeddingMethod):
            return None  # a float table: the float head path
        return _SharedHeadMethod(embed)


class _SharedHeadMethod(gq.GroupQuantLinearMethod):
    """The tied LM head: the group GEMM on the embedding's own quantized tensors (float32 logits;
    the integer-dot kernel at decode sizes, as the other GGUF linears)."""

    intdot = True

    def __init__(self, embed: nn.Module) -> None:
        super().__init__(out_dtype=torch.float32)
        self.embed = [embed]  # NOTE: a list: not a submodule of the head

    def process_weights_after_loading(self, layer):
        e = self.embed[0]
        layer.qweight, layer.scales, layer.mins = e.qweight, e.scales, e.mins
        layer.scales_il = getattr(e, "scales_il", None)
        layer.gq_kind, layer.gq_group = e.gq_kind, e.gq_group
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)
