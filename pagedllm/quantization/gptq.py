"""GPTQ checkpoints (``quant_method: "gptq"``: AutoGPTQ / GPTQModel / optimum), 4- and 8-bit.

Layout per linear (the published AutoGPTQ format; ``N`` outputs, ``K`` inputs, ``b`` bits,
``p = 32 / b`` codes per int32, ``G`` groups):

* ``qweight`` int32 ``[K / p, N]``: code of input ``k`` in word ``k // p``, bits ``b * (k % p)``;
* ``qzeros`` int32 ``[G, N / p]``: zero point of output ``n`` in word ``n // p``, bits ``b * (n % p)``;
  ``checkpoint_format`` "gptq" (v1, the default) stores ``zero - 1`` (modulo ``2^b``), "gptq_v2"
  the zero itself;
* ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]``: the group of each input (``k // group_size``
  unless ``desc_act``); ``group_size: -1`` = one group;
* ``w[n, k] = scales[g, n] * (code[k, n] - zero[g, n])``, ``g = g_idx[k]``.

Runs as the group layout: int4 codes (0..15) with ``mins = -scale * zero`` (4-bit), int8 codes
``code - 128`` with ``mins = scale * (128 - zero)`` (8-bit); both exact in float32. With
``desc_act`` the input channels are permuted so groups are contiguous (``input_perm``) and each
call gathers ``x``'s columns in that order. Other bit widths (2, 3) are a load error.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.quantization import group_quant as gq
from pagedllm.quantization.base import QuantizationConfig, register_quantization_config
from pagedllm.quantization.checkpoint import CheckpointLinearMethod, group_perm, quantizes_linear


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Optional[list[int]] = None) -> torch.Tensor:
    """int32 words -> int32 codes, ``32 / bits`` per word, expanded along ``dim`` (0 or 1);
    ``order[i]`` = which code of each group of ``32 / bits`` bit field ``i`` holds (AWQ), default
    field ``i`` = code ``i``."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    mask = (1 << bits) - 1
    w = packed.to(torch.int32)
    if dim == 0:
        codes = (w.unsqueeze(1) >> shifts.view(1, per, 1)) & mask  # [R, per, C]
        if order is not None:
            codes = codes[:, _inverse(order)]
        return codes.reshape(-1, w.shape[1])
    codes = (w.unsqueeze(2) >> shifts.view(1, 1, per)) & mask  # [R, C, per]
    if order is not None:
        codes = codes[:, :, _inverse(order)]
    return codes.reshape(w.shape[0], -1)


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for field, code in enumerate(order):
        inv[code] = field
    return inv


def int_group_weight(codes_nk: torch.Tensor, scales_ng: torch.Tensor, zeros_ng: torch.Tensor, bits: int,
                     group: int) -> gq.GroupWeight:
    """Unsigned codes ``[N, K]`` (0..2^bits-1), float scales and integer zero points ``[N, G]`` ->
    the group layout of ``w = scale * (code - zero)`` (exact in float32 for float16/bfloat16 scales)."""
    s = scales_ng.float()
    z = zeros_ng.float()
    if bits == 4:
        return gq.GroupWeight(codes_nk.to(torch.uint8), s, -(s * z), gq.KIND_INT4, group)
    return gq.GroupWeight((codes_nk - 128).to(torch.int8), s, s * (128.0 - z), gq.KIND_INT8, group)


class GPTQLinearMethod(CheckpointLinearMethod):
    """A GPTQ linear layer (see the module docstring)."""

    def __init__(self, config: "GPTQConfig") -> None:
        super().__init__()
        self.config = config
        p = 32 // config.bits
        self.tensor_specs = {
            "qweight": dict(input_dim=0, output_dim=1, packed_dim=0, packed_factor=p),
            "qzeros": dict(input_dim=0, output_dim=1, packed_dim=1, packed_factor=p),
            "scales": dict(input_dim=0, output_dim=1),
            "g_idx": dict(required=False, input_dim=0),
        }

    def convert(self, layer, t):
        c = self.config
        bits, p = c.bits, 32 // c.bits
        qweight = t["qweight"]
        k, n = qweight.shape[0] * p, qweight.shape[1]
        if k != layer.in_features:
            raise ValueError(f"{layer.ckpt_prefix}: gptq qweight {tuple(qweight.shape)} gives K={k}, "
                             f"the layer has {layer.in_features}")
        group = c.group_size if c.group_size > 0 else k
        codes = unpack_int32(qweight, bits, dim=0).t()  # [N, K]
        zeros = unpack_int32(t["qzeros"], bits, dim=1)[:, :n]  # [G, N]
        if c.checkpoint_format == "gptq":
            zeros = (zeros + 1) & ((1 << bits) - 1)  # NOTE: v1 stores zero - 1
        scales = t["scales"]
        perm = group_perm(t.get("g_idx"), group, k, layer.ckpt_prefix)
        if perm is not None:
            codes = codes[:, perm]
        return int_group_weight(codes, scales.t(), zeros.t(), bits, group), perm


@register_quantization_config("gptq")
class GPTQConfig(QuantizationConfig):
    """``quantization_config`` of a GPTQ checkpoint.

    Keys read: ``bits`` (4 or 8), ``group_size`` (-1 or a multiple of 16), ``desc_act``, ``sym``
    (either: the zeros are stored), ``checkpoint_format`` ("gptq" or "gptq_v2"), ``lm_head``
    (quantized head: not supported), ``modules_to_not_convert`` / ``dynamic`` exclusions (``-:``
    patterns only).
    """

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str,
                 modules_to_not_convert: Optional[list[str]] = None) -> None:
        super().__init__()
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.checkpoint_format = checkpoint_format
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, config):
        bits = int(config.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"gptq: bits={bits} is not supported (4 or 8)")
        group = int(config.get("group_size", 128))
        if group != -1 and (group <= 0 or group % 16):
            raise ValueError(f"gptq: group_size={group} is not supported (-1 or a multiple of 16)")
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported ('gptq' or 'gptq_v2')")
        if config.get("lm_head", False):
            raise ValueError("gptq: a quantized lm_head (lm_head: true) is not supported")
        skip = list(config.get("modules_to_not_convert") or [])
        for key, rule in (config.get("dynamic") or {}).items():
            if not str(key).startswith("-:") or rule:
                raise ValueError(f"gptq: per-module 'dynamic' overrides are not supported ({key!r})")
            skip.append("re:" + str(key)[2:])
        return cls(bits, group, bool(config.get("desc_act", False)), bool(config.get("sym", True)), fmt, skip)

    def describe(self):
        return (f"gptq ({self.bits}-bit, group {self.group_size}, desc_act={self.desc_act}, "
                f"sym={self.sym}, {self.checkpoint_format})")

    def get_quant_method(self, layer, prefix):
        return GPTQLinearMethod(self) if quantizes_linear(layer, prefix, self.modules_to_not_convert) else None
