"""FP8 checkpoints (``quant_method: "fp8"``: vLLM's / transformers' FP8 and fine-grained FP8).

Per linear: ``weight`` float8_e4m3fn ``[N, K]`` and either ``weight_scale_inv`` float32
``[ceil(N / bn), ceil(K / bk)]`` (``weight_block_size: [bn, bk]``; despite the name, the value
multiplies: ``w = fp8 * scale``) or ``weight_scale`` (per tensor ``[]`` / ``[1]``, or per output
channel ``[N]`` / ``[N, 1]``); ``input_scale`` when ``activation_scheme: "static"``.

CPUs have no FP8 GEMM here: the weights stay FP8 (1 byte each) and are upcast inside the group
GEMM (the e4m3 code decoded exactly through the fp16 conversion), the activations stay in the
model dtype (a checkpoint's activation scales are not needed for that and are ignored; vLLM does
the same for FP8 weight-only kernels on GPUs without FP8 math).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from pagedllm.quantization import group_quant as gq
from pagedllm.quantization.base import QuantizationConfig, register_quantization_config
from pagedllm.quantization.checkpoint import CheckpointLinearMethod, quantizes_linear

logger = logging.getLogger("pagedllm")


def fp8_group_weight(w: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]] = None) -> gq.GroupWeight:
    """float8_e4m3fn ``w [n, k]`` and its scale -> the group layout (fp8 codes).

    ``scale``: one value (per tensor), ``[n]`` / ``[n, 1]`` (per channel), or ``[ceil(n / bn),
    ceil(k / bk)]`` with ``block = (bn, bk)``.

    Raises:
        ValueError: a weight that is not float8_e4m3fn, or a scale shape that fits none of these.
    """
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 weight must be float8_e4m3fn, got {w.dtype}")
    n, k = w.shape
    s = scale.float()
    if s.numel() == 1:
        scales, group = s.reshape(1, 1).expand(n, 1).contiguous(), k
    elif s.dim() == 2 and block is not None and s.shape == (-(-n // block[0]), -(-k // block[1])):
        scales, group = s.repeat_interleave(block[0], dim=0)[:n].contiguous(), block[1]
    elif s.numel() == n and (s.dim() == 1 or s.shape[-1] == 1):
        scales, group = s.reshape(n, 1).contiguous(), k
    else:
        raise ValueError(f"fp8 weight_scale of shape {tuple(s.shape)} does not fit weight [{n}, {k}] "
                         f"(block {block})")
    return gq.GroupWeight(w.view(torch.uint8), scales, None, gq.KIND_FP8, group)


class Fp8LinearMethod(CheckpointLinearMethod):
    """An FP8-weight linear layer (see the module docstring)."""

    def __init__(self, config: "Fp8Config") -> None:
        super().__init__()
        self.config = config
        scale = "weight_scale_inv" if config.weight_block_size else "weight_scale"
        self.tensor_specs = {"weight": dict(output_dim=0, input_dim=1),
                             scale: dict(output_dim=0 if config.weight_block_size else None,
                                         input_dim=1 if config.weight_block_size else None),
                             "input_scale": dict(required=False)}

    def convert(self, layer, t):
        scale = t.get("weight_scale_inv", t.get("weight_scale"))
        block = tuple(self.config.weight_block_size) if self.config.weight_block_size else None
        return fp8_group_weight(t["weight"], scale, block), None


@register_quantization_config("fp8")
class Fp8Config(QuantizationConfig):
    """``quantization_config`` with ``quant_method: "fp8"``: ``activation_scheme`` ("dynamic" /
    "static"), ``weight_block_size`` (``[bn, bk]``, bk a multiple of 16) or per-tensor scales,
    ``modules_to_not_convert`` / ``ignored_layers``."""

    def __init__(self, activation_scheme: str, weight_block_size: Optional[list[int]], ignored: list[str]) -> None:
        super().__init__()
        self.activation_scheme, self.weight_block_size, self.ignored = activation_scheme, weight_block_size, ignored

    @classmethod
    def from_config(cls, config):
        scheme = str(config.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8: activation_scheme {scheme!r} is not supported ('dynamic' or 'static')")
        block = config.get("weight_block_size")
        if block is not None:
            block = [int(b) for b in block]
            if len(block) != 2 or block[0] <= 0 or block[1] <= 0 or block[1] % 16:
                raise ValueError(f"fp8: weight_block_size {block} is not supported ([bn, bk], bk a multiple of 16)")
        fmt = config.get("fmt", "e4m3")
        if str(fmt).lower() != "e4m3":
            raise ValueError(f"fp8: fmt {fmt!r} is not supported (e4m3)")
        ignored = list(config.get("modules_to_not_convert") or []) + list(config.get("ignored_layers") or [])
        return cls(scheme, block, ignored)

    def describe(self):
        how = f"block {self.weight_block_size}" if self.weight_block_size else "per-tensor/channel scales"
        return f"fp8 (e4m3 weights upcast in the GEMM, {how}; activations in the model dtype)"

    def get_quant_method(self, layer, prefix):
        return Fp8LinearMethod(self) if quantizes_linear(layer, prefix, self.ignored) else None
