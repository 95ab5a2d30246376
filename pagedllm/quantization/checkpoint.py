"""Shared loading for quantized HF checkpoints (GPTQ, AWQ, compressed-tensors, FP8).

A ``CheckpointLinearMethod`` registers one placeholder parameter per checkpoint tensor the format
stores for a linear layer (``qweight``, ``scales``, ... — replacing the float ``weight`` when the
format calls its codes ``weight``); their loader keeps each tensor per shard (q/k/v, gate/up).
``process_weights_after_loading`` converts each shard (``convert``: checkpoint tensors ->
``GroupWeight`` and an optional input permutation) and installs them stacked along N in the
group layout (``group_quant``), run by the group GEMM.

Placeholders carry vLLM's sharding attributes for a tensor-parallel pass: ``output_dim`` /
``input_dim`` (the dims of the checkpoint tensor along N / K), ``packed_dim`` / ``packed_factor``
(a dim holding several codes per element). Tensors a checkpoint may omit are ``optional``.
"""
from __future__ import annotations

import fnmatch
import re
import weakref
from typing import Optional

import torch
from torch import nn

from pagedllm.quantization import group_quant as gq
from pagedllm.quantization.base import set_weight_attrs

#: checkpoint module names of the fused layers' shards (CausalLM.packed_modules_mapping, inverted)
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_names(prefix: str) -> list[str]:
    """The checkpoint module names behind one of our modules (``...qkv_proj`` -> q/k/v_proj)."""
    head, _, last = prefix.rpartition(".")
    if last in FUSED_SHARDS:
        return [f"{head}.{s}" if head else s for s in FUSED_SHARDS[last]]
    return [prefix]


def matches(name: str, patterns) -> bool:
    """vLLM / compressed-tensors matching of a module name against ignore lists: ``re:REGEX``
    (search), a plain name (exact, or a suffix after a dot), or a substring (``modules_to_not_convert``)."""
    for p in patterns or ():
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p) or fnmatch.fnmatch(name, p):
            return True
    return False


def is_ignored(prefix: str, patterns, substring: bool = False) -> bool:
    """Whether every checkpoint module behind ``prefix`` is ignored; raises ValueError when only
    some shards of a fused layer are (one layer cannot be half float)."""
    names = checkpoint_names(prefix)
    hits = [matches(n, patterns) or (substring and any(p and p in n for p in patterns or ())) for n in names]
    if any(hits) and not all(hits):
        raise ValueError(f"{prefix}: the quantization config leaves only some of {names} unquantized; "
                         f"fused projections must be all quantized or all float")
    return all(hits)


def quantizes_linear(layer: nn.Module, prefix: str, ignored) -> bool:
    """Whether a checkpoint format quantizes ``layer`` (module name ``prefix``): an ``nn.Linear``
    other than the LM head whose checkpoint modules are not in ``ignored`` (the config's ignore
    list, matched as by ``is_ignored(..., substring=True)``; raises ValueError as it does)."""
    return (isinstance(layer, nn.Linear) and prefix != "lm_head"
            and not is_ignored(prefix, ignored, substring=True))


def shard_order(layer: nn.Module) -> list:
    offsets = getattr(layer, "shard_offsets", None)
    return list(offsets) if offsets else [None]


def _loader(param: nn.Parameter, tensor, shard_id=None) -> None:
    layer = param.ckpt_owner()
    layer.ckpt_tensors[(param.ckpt_name, shard_id)] = tensor


class CheckpointLinearMethod(gq.GroupQuantLinearMethod):
    """Base of the HF checkpoint formats' linear methods (see the module docstring).

    Subclasses set ``tensor_specs`` (``{name: dict(required=..., output_dim=..., ...)}``) and
    implement ``convert``.
    """

    tensor_specs: dict[str, dict] = {}

    def specs(self, layer: nn.Module) -> dict[str, dict]:
        return self.tensor_specs

    def create_weights(self, layer, prefix: str = "", params_dtype: torch.dtype = torch.float32, **kwargs):
        layer.ckpt_tensors, layer.ckpt_prefix, layer.ckpt_dtype = {}, prefix, params_dtype
        ids = shard_order(layer)
        # NOTE: the float weight is not in such a checkpoint: an empty stand-in nobody loads
        layer.weight = set_weight_attrs(nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False),
                                        optional=True)
        for name, spec in self.specs(layer).items():
            p = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            attrs = {k: v for k, v in spec.items() if k != "required"}
            set_weight_attrs(p, weight_loader=_loader, ckpt_name=name, ckpt_owner=weakref.ref(layer),
                             optional=not spec.get("required", True), **attrs)
            if ids != [None]:
                p.shard_ids = tuple(ids)
            if name in layer._parameters:
                del layer._parameters[name]
            layer.register_parameter(name, p)

    def convert(self, layer: nn.Module, t: dict[str, torch.Tensor]) -> tuple[gq.GroupWeight, Optional[torch.Tensor]]:
        """One shard's checkpoint tensors -> (``GroupWeight`` ``[n_shard, K]``, input permutation
        int64 ``[K]`` or None)."""
        raise NotImplementedError

    def shard_tensors(self, layer: nn.Module, sid) -> dict[str, torch.Tensor]:
        """The loaded tensors of shard ``sid`` by checkpoint name (missing optional ones absent).

        Raises:
            ValueError: a required tensor is missing.
        """
        out = {}
        for name, spec in self.specs(layer).items():
            t = layer.ckpt_tensors.get((name, sid))
            if t is None:
                if spec.get("required", True):
                    raise ValueError(f"{layer.ckpt_prefix}: checkpoint tensor {name!r} missing"
                                     + (f" for shard {sid!r}" if sid is not None else ""))
                continue
            out[name] = t
        return out

    def process_weights_after_loading(self, layer):
        parts, perms = [], []
        for sid in shard_order(layer):
            gw, perm = self.convert(layer, self.shard_tensors(layer, sid))
            parts.append(gw)
            perms.append(perm)
        if any(p is not None for p in perms) and not all(p is not None and torch.equal(p, perms[0]) for p in perms):
            raise ValueError(f"{layer.ckpt_prefix}: fused shards with different act-order permutations (g_idx) "
                             f"are not supported")
        for name in self.specs(layer):
            if name in layer._parameters:
                del layer._parameters[name]
        del layer.ckpt_tensors
        layer.weight = nn.Parameter(torch.empty(0, dtype=layer.ckpt_dtype), requires_grad=False)
        gq.install(layer, gq.merge(parts))
        if perms[0] is not None:
            layer.register_buffer("input_perm", perms[0], persistent=False)  # NOTE: moves with the layer

    def apply(self, layer, x, bias=None):
        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            x = x.index_select(-1, perm)
        return gq.group_linear(layer, x, bias, self.out_dtype)

    def dequantize(self, layer):
        w = gq.layer_dequantize(layer)
        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            out = torch.empty_like(w)
            out[:, perm] = w
            w = out
        return w


def group_perm(g_idx: Optional[torch.Tensor], group: int, k: int, what: str) -> Optional[torch.Tensor]:
    """Act-order: the permutation of K that makes ``g_idx`` contiguous groups of ``group``, or None
    when it already is ``k // group``.

    Raises:
        ValueError: groups that are not all ``group`` wide after sorting (no layout for them).
    """
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64).reshape(-1)
    want = torch.arange(k) // group
    if g_idx.numel() != k:
        raise ValueError(f"{what}: g_idx has {g_idx.numel()} entries for K={k}")
    if torch.equal(g_idx, want):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], want):
        raise ValueError(f"{what}: g_idx does not describe groups of {group} input channels")
    return perm
