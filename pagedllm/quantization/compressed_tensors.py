"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, llm-compressor's output).

``quantization_config``: ``config_groups`` (each a scheme: ``targets``, ``weights``,
``input_activations``, optionally its own ``format``), ``format``, ``ignore``. Each linear takes the
first group whose targets match (``"Linear"`` or a ``re:`` / exact module name); ignored ones stay
float. What runs:

| format | weights | activations | runs as | tensors |
|---|---|---|---|---|
| pack-quantized | int4 / int8, group or channel, sym or asym, actorder | none | group GEMM (int4/int8 codes) | ``weight_packed`` int32 ``[N, K b / 32]`` (codes ``+ 2^(b-1)``, little end first), ``weight_scale`` ``[N, G]``, ``weight_zero_point`` (asym, packed along N), ``weight_shape``, ``weight_g_idx`` |
| int-quantized / naive-quantized | int8 channel / tensor, symmetric | int8 dynamic per token, or static per tensor | W8A8 (``W8A8LinearMethod``) | ``weight`` int8, ``weight_scale``, ``input_scale`` (static) |
| int-quantized / naive-quantized | int8 channel / group / tensor | none | group GEMM (int8 codes) | ``weight`` int8, ``weight_scale``, ``weight_zero_point`` |
| float-quantized | fp8 e4m3, tensor / channel / block | fp8 (ignored) or none | group GEMM (fp8 codes upcast) | ``weight`` fp8, ``weight_scale``, ``input_scale`` (ignored) |

``w = scale * (q - zero)`` (the library's ``dequantize``). Anything else (other bit widths, float
activations for int weights, asymmetric or group-wise int8 activations, nvfp4/mxfp4, sparsity
compressors, transforms) is a load error naming it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.quantization import group_quant as gq
from pagedllm.quantization.base import QuantizationConfig, register_quantization_config
from pagedllm.quantization.checkpoint import (
    CheckpointLinearMethod,
    checkpoint_names,
    group_perm,
    is_ignored,
    matches,
    shard_order,
)
from pagedllm.quantization.fp8 import fp8_group_weight
from pagedllm.quantization.w8a8 import W8A8LinearMethod, install_int8_weight

_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def unpack_ct_int32(packed: torch.Tensor, bits: int, n_values: int, dim: int = 1) -> torch.Tensor:
    """compressed-tensors ``pack_to_int32`` inverse for ``bits`` in (4, 8): int32 words -> signed
    int32 values (stored ``value + 2^(bits-1)``, ``32 / bits`` per word, lowest bits first) along
    ``dim``, cut to ``n_values``."""
    from pagedllm.quantization.gptq import unpack_int32

    codes = unpack_int32(packed, bits, dim=dim)
    codes = codes[:, :n_values] if dim == 1 else codes[:n_values]
    return codes - (1 << (bits - 1))


def _group_of(args: dict, k: int) -> int:
    strategy = args.get("strategy")
    if strategy == "group":
        return int(args["group_size"])
    if strategy in ("channel", "tensor"):
        return k
    raise ValueError(f"compressed-tensors: weight strategy {strategy!r} is not supported here")


def _scales_nk(scale: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """A weight_scale / zero point as ``[n, G]`` (per tensor values broadcast)."""
    s = scale.reshape(-1, 1) if scale.dim() < 2 else scale
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, g).contiguous()
    if s.shape[0] != n:
        raise ValueError(f"compressed-tensors: scale shape {tuple(scale.shape)} does not fit {n} outputs")
    return s


class CTWeightOnlyMethod(CheckpointLinearMethod):
    """compressed-tensors weights run by the group GEMM (int4/int8 codes, or fp8 codes)."""

    def __init__(self, scheme: dict, fmt: str) -> None:
        super().__init__()
        self.scheme, self.fmt = scheme, fmt
        w = scheme["weights"]
        self.bits, self.sym = int(w["num_bits"]), bool(w.get("symmetric", True))
        if fmt == "pack-quantized":
            specs = {"weight_packed": dict(output_dim=0, input_dim=1, packed_dim=1, packed_factor=32 // self.bits),
                     "weight_scale": dict(output_dim=0, input_dim=1),
                     "weight_shape": dict(required=False)}
            if not self.sym:
                specs["weight_zero_point"] = dict(output_dim=0, input_dim=1, packed_dim=0,
                                                  packed_factor=32 // self.bits)
        else:
            specs = {"weight": dict(output_dim=0, input_dim=1), "weight_scale": dict(output_dim=0, input_dim=1)}
            if not self.sym:
                specs["weight_zero_point"] = dict(output_dim=0, input_dim=1)
            if scheme.get("input_activations"):
                specs["input_scale"] = dict(required=False)
                specs["input_zero_point"] = dict(required=False)
        if w.get("actorder") is not None or fmt == "pack-quantized":
            specs["weight_g_idx"] = dict(required=False, input_dim=0)
        self.tensor_specs = specs

    def convert(self, layer, t):
        w = self.scheme["weights"]
        n_k = layer.in_features
        if self.fmt == "float-quantized":
            block = tuple(w["block_structure"]) if w.get("strategy") == "block" else None
            return fp8_group_weight(t["weight"], t["weight_scale"], block), None
        if self.fmt == "pack-quantized":
            packed = t["weight_packed"]
            n = packed.shape[0]
            q = unpack_ct_int32(packed, self.bits, n_k, dim=1)  # signed [n, K]
        else:
            q = t["weight"].to(torch.int32)
            n = q.shape[0]
        group = _group_of(w, n_k)
        g = -(-n_k // group)
        s = _scales_nk(t["weight_scale"], n, g).float()
        if self.sym:
            z = torch.zeros_like(s)
        elif self.fmt == "pack-quantized":
            z = unpack_ct_int32(t["weight_zero_point"], self.bits, n, dim=0).float()
            z = _scales_nk(z, n, g)
        else:
            z = _scales_nk(t["weight_zero_point"], n, g).float()
        perm = group_perm(t.get("weight_g_idx"), group, n_k, layer.ckpt_prefix)
        if perm is not None:
            q = q[:, perm]
        if self.bits == 4:
            # unsigned codes q + 8: w = s * (q - z) = s * (q + 8) + (-(s * (8 + z)))
            gw = gq.GroupWeight((q + 8).to(torch.uint8), s, -(s * (z + 8.0)), gq.KIND_INT4, group)
        else:
            gw = gq.GroupWeight(q.to(torch.int8), s, None if self.sym else -(s * z), gq.KIND_INT8, group)
        return gw, perm


class CTW8A8Method(W8A8LinearMethod):
    """compressed-tensors int8 weights (per channel / tensor, symmetric) with int8 activations
    (dynamic per token, or one static per-tensor scale): the W8A8 kernels."""

    specs = CheckpointLinearMethod.specs
    shard_tensors = CheckpointLinearMethod.shard_tensors
    create_weights = CheckpointLinearMethod.create_weights

    def __init__(self, static: bool) -> None:
        super().__init__(static=static)
        self.tensor_specs = {"weight": dict(output_dim=0, input_dim=1), "weight_scale": dict(output_dim=0),
                             "input_scale": dict(required=static)}

    def process_weights_after_loading(self, layer):
        qs, ss, ins = [], [], []
        for sid in shard_order(layer):
            t = self.shard_tensors(layer, sid)
            q = t["weight"]
            if q.dtype != torch.int8:
                raise ValueError(f"{layer.ckpt_prefix}: compressed-tensors int8 weight has dtype {q.dtype}")
            qs.append(q)
            ss.append(_scales_nk(t["weight_scale"], q.shape[0], 1).float().reshape(-1))
            if "input_scale" in t:
                ins.append(t["input_scale"].float().reshape(-1))
        for name in self.specs(layer):
            if name in layer._parameters:
                del layer._parameters[name]
        del layer.ckpt_tensors
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.ckpt_dtype), requires_grad=False)
        install_int8_weight(layer, torch.cat(qs), torch.cat(ss))
        if self.static:
            # NOTE: the shards of a fused layer see the same input; the largest scale covers all (vLLM)
            layer.input_scale = torch.nn.Parameter(torch.cat(ins).max().reshape(()), requires_grad=False)


@register_quantization_config("compressed-tensors")
class CompressedTensorsConfig(QuantizationConfig):
    """A compressed-tensors ``quantization_config`` (see the module docstring)."""

    def __init__(self, groups: list[tuple[list[str], dict, str]], ignore: list[str]) -> None:
        super().__init__()
        self.groups, self.ignore = groups, ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        fmt = config.get("format")
        status = config.get("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise ValueError(f"compressed-tensors: quantization_status {status!r} is not supported ('compressed')")
        if config.get("sparsity_config"):
            raise ValueError("compressed-tensors: sparsity_config (sparse compressors) is not supported")
        if config.get("transform_config"):
            raise ValueError("compressed-tensors: transform_config is not supported")
        if config.get("kv_cache_scheme"):
            raise ValueError("compressed-tensors: kv_cache_scheme is not supported (use --kv-cache-dtype fp8)")
        groups = []
        for gname, scheme in (config.get("config_groups") or {}).items():
            f = scheme.get("format") or fmt
            cls._check_scheme(gname, scheme, f)
            groups.append((list(scheme.get("targets") or []), scheme, f))
        if not groups:
            raise ValueError("compressed-tensors: config_groups is empty")
        return cls(groups, list(config.get("ignore") or []))

    @staticmethod
    def _check_scheme(gname: str, scheme: dict, fmt: Optional[str]) -> None:
        where = f"compressed-tensors group {gname!r}"
        if fmt not in _FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported (supported: {list(_FORMATS)})")
        w, a = scheme.get("weights"), scheme.get("input_activations")
        if not w:
            raise ValueError(f"{where}: no weight quantization")
        if scheme.get("output_activations"):
            raise ValueError(f"{where}: output activation quantization is not supported")
        bits, wtype, strategy = int(w.get("num_bits", 0)), w.get("type"), w.get("strategy")
        if fmt == "float-quantized":
            if wtype != "float" or bits != 8:
                raise ValueError(f"{where}: float-quantized needs 8-bit float weights, got {bits}-bit {wtype}")
            if strategy == "block":
                bs = w.get("block_structure") or []
                if len(bs) != 2 or int(bs[1]) % 16:
                    raise ValueError(f"{where}: block_structure {bs} is not supported ([bn, bk], bk a multiple of 16)")
            elif strategy not in ("tensor", "channel"):
                raise ValueError(f"{where}: fp8 weight strategy {strategy!r} is not supported")
            if a and a.get("type") not in ("float", None):
                raise ValueError(f"{where}: {a.get('type')} activations with fp8 weights are not supported")
            return
        if wtype != "int":
            raise ValueError(f"{where}: {fmt} needs int weights, got {wtype}")
        if fmt == "pack-quantized":
            if bits not in (4, 8):
                raise ValueError(f"{where}: {bits}-bit packed weights are not supported (4 or 8)")
            if a:
                raise ValueError(f"{where}: activation quantization with packed int{bits} weights "
                                 f"(W{bits}A{a.get('num_bits')}) is not supported")
        elif bits != 8:
            raise ValueError(f"{where}: {bits}-bit {fmt} weights are not supported (8)")
        if strategy not in ("group", "channel", "tensor"):
            raise ValueError(f"{where}: weight strategy {strategy!r} is not supported")
        if strategy == "group" and (int(w.get("group_size") or 0) <= 0 or int(w["group_size"]) % 16):
            raise ValueError(f"{where}: group_size {w.get('group_size')} is not supported (a multiple of 16)")
        if a:
            if a.get("type") != "int" or int(a.get("num_bits", 0)) != 8:
                raise ValueError(f"{where}: {a.get('num_bits')}-bit {a.get('type')} activations with int weights "
                                 f"are not supported (int8)")
            if not a.get("symmetric", True):
                raise ValueError(f"{where}: asymmetric activation quantization is not supported")
            dyn, ast = a.get("dynamic"), a.get("strategy")
            if not ((dyn is True and ast == "token") or (dyn is False and ast == "tensor")):
                raise ValueError(f"{where}: int8 activations {ast!r} dynamic={dyn} are not supported "
                                 f"(dynamic per token, or static per tensor)")
            if not w.get("symmetric", True) or strategy == "group":
                raise ValueError(f"{where}: W8A8 needs symmetric per-channel or per-tensor int8 weights")

    def describe(self):
        parts = []
        for _targets, s, f in self.groups:
            w, a = s["weights"], s.get("input_activations")
            parts.append(f"{f} w{w['num_bits']}{w['type']}/{w.get('strategy')}"
                         + (f" a{a['num_bits']}{a['type']}/{a.get('strategy')}" if a else ""))
        return "compressed-tensors (" + "; ".join(parts) + ")"

    def _scheme_for(self, layer, prefix: str) -> Optional[tuple[dict, str]]:
        names = checkpoint_names(prefix)
        found = None
        for targets, scheme, fmt in self.groups:
            hits = [any(t == type(layer).__name__ or t == "Linear" or matches(n, [t]) for t in targets) for n in names]
            if any(hits):
                if not all(hits):
                    raise ValueError(f"{prefix}: compressed-tensors targets match only some of {names}")
                found = (scheme, fmt)
                break
        return found

    def process_model(self, model):
        from pagedllm.quantization.w8a8 import fuse_norms

        return {"fused_norms": fuse_norms(model)}

    def get_quant_method(self, layer, prefix):
        if not isinstance(layer, torch.nn.Linear):
            return None
        if is_ignored(prefix, self.ignore):
            return None
        found = self._scheme_for(layer, prefix)
        if found is None:
            return None
        scheme, fmt = found
        if prefix == "lm_head":
            raise ValueError("compressed-tensors: a quantized lm_head is not supported (add it to 'ignore')")
        a = scheme.get("input_activations")
        if fmt in ("int-quantized", "naive-quantized") and a:
            return CTW8A8Method(static=a.get("dynamic") is False)
        return CTWeightOnlyMethod(scheme, fmt)

