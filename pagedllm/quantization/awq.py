"""AWQ checkpoints (``quant_method: "awq"``, AutoAWQ's GEMM layout, ``version: "gemm"``), 4-bit.

Layout per linear (``N`` outputs, ``K`` inputs, groups of ``group_size`` along K):

* ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[K / group_size, N / 8]``: eight 4-bit
  codes per word along N, bit field ``i`` (bits ``4 i``) holding column ``8 c + AWQ_ORDER[i]``
  with ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (the interleave of AutoAWQ's GEMM kernel);
* ``scales`` float16 ``[K / group_size, N]``;
* ``w[n, k] = scales[g, n] * (code[k, n] - zero[g, n])``, ``g = k // group_size``
  (``zero_point: false``: zero 8).

Runs as the group layout: int4 codes with ``mins = -scale * zero`` (exact). GEMV / Marlin / IPEX
``version``s are other layouts: a load error.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.quantization.base import QuantizationConfig, register_quantization_config
from pagedllm.quantization.checkpoint import CheckpointLinearMethod, quantizes_linear
from pagedllm.quantization.gptq import int_group_weight, unpack_int32

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


class AWQLinearMethod(CheckpointLinearMethod):
    """An AWQ (GEMM layout) linear layer."""

    tensor_specs = {
        "qweight": dict(input_dim=0, output_dim=1, packed_dim=1, packed_factor=8),
        "qzeros": dict(input_dim=0, output_dim=1, packed_dim=1, packed_factor=8),
        "scales": dict(input_dim=0, output_dim=1),
    }

    def __init__(self, config: "AWQConfig") -> None:
        super().__init__()
        self.config = config

    def convert(self, layer, t):
        c = self.config
        qweight = t["qweight"]
        k = qweight.shape[0]
        if k != layer.in_features:
            raise ValueError(f"{layer.ckpt_prefix}: awq qweight {tuple(qweight.shape)} gives K={k}, "
                             f"the layer has {layer.in_features}")
        codes = unpack_int32(qweight, 4, dim=1, order=AWQ_ORDER).t()  # [N, K]
        scales = t["scales"]  # [G, N]
        if c.zero_point:
            zeros = unpack_int32(t["qzeros"], 4, dim=1, order=AWQ_ORDER)  # [G, N]
        else:
            zeros = torch.full_like(scales, 8, dtype=torch.int32)
        return int_group_weight(codes, scales.t(), zeros.t(), 4, c.group_size), None


@register_quantization_config("awq")
class AWQConfig(QuantizationConfig):
    """``quantization_config`` of an AutoAWQ checkpoint: ``bits`` (4), ``group_size`` (a multiple
    of 16), ``zero_point``, ``version`` ("gemm"), ``modules_to_not_convert``."""

    def __init__(self, group_size: int, zero_point: bool, modules_to_not_convert: Optional[list[str]] = None) -> None:
        super().__init__()
        self.group_size, self.zero_point = group_size, zero_point
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, config):
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"awq: bits={bits} is not supported (4)")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported ('gemm')")
        group = int(config.get("group_size", config.get("q_group_size", 128)))
        if group <= 0 or group % 16:
            raise ValueError(f"awq: group_size={group} is not supported (a multiple of 16)")
        return cls(group, bool(config.get("zero_point", True)), config.get("modules_to_not_convert"))

    def describe(self):
        return f"awq (4-bit gemm, group {self.group_size}, zero_point={self.zero_point})"

    def get_quant_method(self, layer, prefix):
        return AWQLinearMethod(self) if quantizes_linear(layer, prefix, self.modules_to_not_convert) else None
