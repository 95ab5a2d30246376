"""Decode-only steps of a Llama-shaped model on CPU in one C++ call.

At decode batch sizes a step's kernels are short (SmolLM2 W8A8 at batch 1: ~7 ms of kernels in a
~10 ms step), and the Python around them (module calls, argument checks, ~10 kernel calls per
layer) costs 2-3 ms per step. ``llama_decode_w8a8``, ``llama_decode_dense`` and ``llama_decode_group``
(``kernels/csrc/fused_decode.cpp``) run the decoder layers and the final norm of such a step from
one C++ loop, calling the same kernels and operators in the same order on the same operands as
the module path, so the output is bit-identical (``tests/kernels/test_fused_decode.py``); the GIL
stays released for the whole forward.

Three kinds of models qualify: W8A8 (every projection a ``Linear`` whose ``W8A8LinearMethod`` holds
packed weights, the norms feeding them quantizing, ``int8_gemm_packed``), float ones (every projection a plain ``Linear`` with no quantization method: bf16
with oneDNN-packed weights as ``kernels.onednn.prepack_cpu_linears`` leaves them, or float32) and
group-quantized ones ("group": every projection held in ``group_quant``'s layout by a
``GroupQuantLinearMethod`` -- GGUF blocks, the default for a GGUF file, GPTQ / AWQ / ... -- with
K a multiple of 32; each runs the kernel ``group_quant.group_linear`` picks for it, for GGUF int4 / int8
group-32 layers by default ``intdot_gemm`` (``PAGEDLLM_GGUF_INTDOT=0``: ``group_gemm``), called by address in the other modules).
Also required:
CPU, float32 or bfloat16 activations, SiLU MLP, Llama-style norms (no q/k norm, no soft cap), a
decode-only step (one query token per request; W8A8: at most ``PACKED_GEMM_MAX_M`` requests), and
a KV cache the C++ attention reads, and no LoRA adapter row in the step (projections wrapped for
LoRA are seen through: a step without adapter rows still runs here). Anything else runs the
module path.
``PAGEDLLM_FUSED_DECODE=0`` turns it off (for A/B runs).

It is a runner-level accelerator, not part of the model: ``build_decode_accelerator(model, ...)``
runs once after the model is built (``Worker.initialize_cache``, the draft model's proposer),
decides eligibility once and logs it; ``ModelRunner`` then tries ``FusedDecode.forward`` for each
step and runs the model's own forward when it returns None. Model files hold no hook for it.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from pagedllm import envs

logger = logging.getLogger("pagedllm")

#: Tensors per decoder layer passed to ``llama_decode_w8a8`` (its ``LayerTensor`` enum).
FUSED_W8A8_TENSORS_PER_LAYER = 17
#: Tensors per decoder layer passed to ``llama_decode_dense`` (its ``DenseTensor`` enum).
FUSED_DENSE_TENSORS_PER_LAYER = 10
#: Tensors per decoder layer passed to ``llama_decode_group`` (its ``GroupTensor`` enum).
FUSED_GROUP_TENSORS_PER_LAYER = 22


def fused_decode_enabled() -> bool:
    """Whether ``PAGEDLLM_FUSED_DECODE`` allows the fused path (default on; ``0`` turns it off)."""
    return bool(envs.get("PAGEDLLM_FUSED_DECODE"))


def _unwrap(lin):
    """The projection a wrapper computes (a LoRA wrapper's ``base_layer``; its deltas are added only
    in steps with adapter rows, which ``FusedDecode.run`` leaves to the module path), else ``lin``."""
    return getattr(lin, "base_layer", lin)


def _linear_tensors(lin, with_bias: bool) -> Optional[list[torch.Tensor]]:
    """A packed W8A8 layer's operands (packed weights, comp, scales[, bias or empty]), or None."""
    from pagedllm.quantization.w8a8 import W8A8LinearMethod

    lin = _unwrap(lin)
    qm = getattr(lin, "quant_method", None)
    if (not isinstance(qm, W8A8LinearMethod) or qm.out_dtype is not None or qm.static
            or getattr(lin, "weight_packed", None) is None):
        return None
    out = [lin.weight_packed, lin.weight_comp, lin.w_scales]
    if with_bias:
        out.append(torch.empty(0) if lin.bias is None else lin.bias.detach().float().contiguous())
    elif lin.bias is not None:
        return None
    return out


def _float_weight(lin) -> Optional[torch.Tensor]:
    """A float ``Linear``'s weight as its kernel reads it: the oneDNN-packed one
    (``OneDNNPackedLinearMethod``) or the dense one (no method); None for any other layer."""
    from pagedllm.kernels.onednn import OneDNNPackedLinearMethod
    from pagedllm.models.layers import Linear

    if not isinstance(lin, Linear) or type(lin).forward is not Linear.forward:
        return None
    if lin.quant_method is None:
        return lin.weight
    return lin.onednn_weight if isinstance(lin.quant_method, OneDNNPackedLinearMethod) else None


def _dense_tensors(lin, dtype: torch.dtype) -> Optional[tuple[list[torch.Tensor], bool]]:
    """A plain ``Linear``'s ``([weight, bias or empty], packed)`` in ``dtype``, or None."""
    lin = _unwrap(lin)
    w = _float_weight(lin)
    if w is None:
        return None
    packed = lin.quant_method is not None
    if w.dtype != dtype or (lin.bias is not None and lin.bias.dtype != dtype):
        return None
    # NOTE: the parameters themselves (not detached views), so that Module.to() swapping their
    # data in place is seen here too.
    return [w, torch.empty(0) if lin.bias is None else lin.bias], packed


def _group_tensors(lin) -> Optional[tuple[list[torch.Tensor], list[int]]]:
    """A group-quantized ``Linear``'s operands as ``group_quant.group_linear`` passes them to its
    kernels (``[qweight, scales, mins or empty, bias or empty, interleaved scales or empty]``) and
    its modes ``[kind, group, intdot allowed]``, or None for a layer whose calls do not always take
    the C++ kernels (K not a multiple of 32, group not a multiple of 16, a fixed output dtype, a
    method with its own apply)."""
    from pagedllm.models.layers import Linear
    from pagedllm.quantization import group_quant as gq

    lin = _unwrap(lin)
    qm = getattr(lin, "quant_method", None)
    if (not isinstance(lin, Linear) or type(lin).forward is not Linear.forward
            or not isinstance(qm, gq.GroupQuantLinearMethod) or type(qm).apply is not gq.GroupQuantLinearMethod.apply
            or qm.out_dtype is not None or getattr(lin, "qweight", None) is None
            or lin.qweight.device.type != "cpu" or lin.in_features % 32 or lin.gq_group % 16):
        return None
    intdot = bool(qm.intdot and gq.INTDOT and lin.gq_kind in (gq.KIND_INT4, gq.KIND_INT8) and lin.gq_group % 32 == 0)
    empty = torch.empty(0)
    smt = getattr(lin, "scales_il", None)
    return ([lin.qweight, lin.scales, empty if lin.mins is None else lin.mins, empty if lin.bias is None else lin.bias,
             empty if smt is None else smt],
            [int(lin.gq_kind), int(lin.gq_group), int(intdot)])


class FusedDecode:
    """The per-layer operands of ``llama_decode_w8a8`` / ``llama_decode_dense`` for one model,
    gathered once.

    Build with ``FusedDecode.build(model)`` (None when the model's structure does not fit);
    ``run(x, positions)`` returns the final hidden states or None when this step does not fit.

    Attributes:
        kind: "w8a8", "dense" or "group"; dtype: the activation dtype a dense model takes (None for
            W8A8 and group: float32 or bfloat16); packed: dense weights are oneDNN-packed;
            modes: per layer and projection (kind, group, intdot allowed) of a "group" model.
    """

    def __init__(self, kind: str, layer_tensors: list[torch.Tensor], windows: list[int], final_norm: torch.Tensor,
                 rotary, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, eps: float, ops,
                 dtype: Optional[torch.dtype] = None, packed: bool = False,
                 modes: Optional[list[int]] = None) -> None:
        self.kind, self.dtype, self.packed, self.modes = kind, dtype, packed, modes or []
        self.layer_tensors, self.windows, self.final_norm = layer_tensors, windows, final_norm
        self.rotary, self.num_heads, self.num_kv_heads, self.head_dim = rotary, num_heads, num_kv_heads, head_dim
        self.scale, self.eps, self.ops = scale, eps, ops
        self._cache_ok: dict[tuple, bool] = {}
        # layer_tensors as the kernels' TensorList, built on the first step (one object to convert
        # per call instead of ~18 tensors a layer)
        self._layer_list = None

    def __getstate__(self) -> dict:
        # NOTE: the kernels' extension module cannot be pickled or deep-copied (copy.deepcopy of a
        # model that has run a step); a copy looks it up again.
        state = dict(self.__dict__)
        state["ops"] = state["_layer_list"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        from pagedllm.kernels.cpu_ops import get_ops

        self.__dict__.update(state)
        self.ops = get_ops()

    @classmethod
    def build(cls, model: nn.Module) -> Optional["FusedDecode"]:
        """Gather the operands from a ``LlamaModel`` (embed_tokens, layers, norm), or None when
        any layer is not a Llama shape these kernels run, or the kernels are not built."""
        from pagedllm.kernels.cpu_ops import get_ops
        from pagedllm.models.layers import RMSNorm

        layers = getattr(model, "layers", None)
        norm = getattr(model, "norm", None)
        if not layers or not isinstance(norm, RMSNorm) or norm.gemma or getattr(norm, "quantize_output", False):
            return None
        # NOTE: the kind is read off the first projection before the C++ kernels are asked for:
        # a model they cannot run (CUDA, weight-only int8/int4) must not trigger their build.
        qkv0 = _unwrap(getattr(getattr(layers[0], "self_attn", None), "qkv_proj", None))
        w0 = _float_weight(qkv0)
        if _linear_tensors(qkv0, True) is not None:
            kind, dtype = "w8a8", None
        elif _group_tensors(qkv0) is not None:
            kind, dtype = "group", None
        elif (w0 is not None and qkv0.weight.device.type == "cpu"
              and w0.dtype in (torch.float32, torch.bfloat16)):
            kind, dtype = "dense", w0.dtype
        else:
            return None
        ops = get_ops()
        if ops is None or not hasattr(ops, f"llama_decode_{kind}") or not fused_decode_enabled():
            return None
        if kind == "group" and _group_gemm_fns()[0] == 0:
            return None
        tensors: list[torch.Tensor] = []
        windows: list[int] = []
        modes: list[int] = []
        packs: set[bool] = set()
        first = layers[0].self_attn
        rotary, eps = first.rotary[0], norm.eps
        shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.attn.scale)
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            n1, n2 = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
            if attn is None or mlp is None or not isinstance(n1, RMSNorm) or not isinstance(n2, RMSNorm):
                return None
            quantized = kind == "w8a8"  # the norms feeding W8A8 projections emit int8 rows
            q1, q2 = getattr(n1, "quantize_output", False), getattr(n2, "quantize_output", False)
            if (n1.gemma or n2.gemma or q1 != quantized or q2 != quantized
                    or n1.eps != eps or n2.eps != eps or type(layer).forward is not _llama_layer_forward()):
                return None
            if (attn.q_norm is not None or attn.rotary[0] is not rotary or attn.attn.logits_soft_cap is not None
                    or getattr(attn, "clip_qkv", None) is not None or rotary.rotary_dim != attn.head_dim
                    or (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale) != shape
                    or getattr(mlp, "act", None) is not F.silu):
                return None
            if kind == "w8a8":
                parts = [_linear_tensors(attn.qkv_proj, True), _linear_tensors(attn.o_proj, True),
                         _linear_tensors(mlp.gate_up_proj, False), _linear_tensors(mlp.down_proj, True)]
                if any(p is None for p in parts):
                    return None
            elif kind == "group":
                groups = [_group_tensors(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                         mlp.down_proj)]
                if any(g is None for g in groups):
                    return None
                parts = [g[0] for g in groups]
                for g in groups:
                    modes += g[1]
            else:
                dense = [_dense_tensors(lin, dtype) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                               mlp.down_proj)]
                if any(d is None for d in dense):
                    return None
                parts = [d[0] for d in dense]
                packs.update(d[1] for d in dense)
            qkv, o, gu, down = parts
            tensors += [n1._effective_weight(), *qkv, *o, n2._effective_weight(), *gu, *down]
            windows.append(int(attn.attn.sliding_window or 0))
        if len(packs) > 1:  # some linears packed, some not: the module path decides per layer
            return None
        per_layer = {"w8a8": FUSED_W8A8_TENSORS_PER_LAYER, "dense": FUSED_DENSE_TENSORS_PER_LAYER,
                     "group": FUSED_GROUP_TENSORS_PER_LAYER}[kind]
        assert len(tensors) == per_layer * len(layers)
        return cls(kind, tensors, windows, norm._effective_weight(), rotary, *shape[:3], float(shape[3]),
                   float(eps), ops, dtype=dtype, packed=bool(packs and packs.pop()), modes=modes)

    def _cache_readable(self, x: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the C++ store and decode attention take this cache for ``x``'s dtype (as the
        module path decides in ``attention.torch_paged``)."""
        key = (x.dtype, kv_cache.dtype)
        ok = self._cache_ok.get(key)
        if ok is None:
            from pagedllm.attention.torch_paged import kernel_reads_cache

            q = torch.empty(1, self.num_heads, self.head_dim, dtype=x.dtype)
            ok = self._cache_ok[key] = kernel_reads_cache(self.ops, q, kv_cache)
        return ok and kv_cache.is_contiguous()

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """The runner's entry: ``model``'s final hidden states ``[T, H]`` for a decode-only step
        (embedding lookup, then ``run``), or None (nothing computed but maybe the lookup) when
        this step is not one the kernel runs; inside ``set_forward_context``."""
        from pagedllm.attention.backend import get_forward_context

        ctx = get_forward_context()
        meta, n = ctx.attn_metadata, input_ids.shape[0]
        if ctx.lora_mapping is not None or ctx.inputs_embeds is not None or meta is None \
                or meta.num_decodes != n or meta.num_reqs != n:
            return None  # NOTE: before the lookup: a prefill step goes straight to the module path
        return self.run(model.model.embed_tokens(input_ids), positions)

    def run(self, x: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """x ``[T, H]`` token embeddings, positions int64 ``[T]`` -> the final norm's output
        ``[T, H]`` (x's dtype), or None (and nothing done) when this step is not a decode-only
        step the kernel runs; must be called inside ``set_forward_context``."""
        from pagedllm.attention.backend import get_forward_context
        from pagedllm.attention.torch_paged import TorchPagedAttention
        from pagedllm.quantization.w8a8 import PACKED_GEMM_MAX_M

        if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2
                or (self.dtype is not None and x.dtype != self.dtype)):
            return None
        ctx = get_forward_context()
        if ctx.lora_mapping is not None:  # NOTE: LoRA deltas are added by the module path only
            return None
        meta, caches = ctx.attn_metadata, ctx.kv_caches
        n = x.shape[0]
        max_rows = PACKED_GEMM_MAX_M if self.kind == "w8a8" else n
        if (meta is None or not caches or len(caches) != len(self.windows) or not 0 < n <= max_rows
                or meta.num_reqs != n or meta.num_decodes != n or not isinstance(ctx.impl, TorchPagedAttention)
                or ctx.impl._ops is None or positions.dtype != torch.int64
                or any(m.dtype != torch.int64 for m in (meta.slot_mapping, meta.block_tables, meta.seq_lens))
                or not self._cache_readable(x, caches[0])):
            return None
        self.rotary._ensure(positions)
        layer_list = self._layer_list
        if layer_list is None:
            layer_list = self._layer_list = self.ops.TensorList(self.layer_tensors)
        args = (x.contiguous(), positions.contiguous(), layer_list, caches, meta.slot_mapping.contiguous(),
                meta.block_tables, meta.seq_lens, self.rotary._cos_half, self.rotary._sin_half, self.final_norm,
                self.windows, self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.eps)
        if self.kind == "w8a8":
            return self.ops.llama_decode_w8a8(*args)
        if self.kind == "group":
            from pagedllm.quantization import group_quant as gq

            group_fn, intdot_fn, isa = _group_gemm_fns()
            return self.ops.llama_decode_group(*args, self.modes, group_fn, intdot_fn, gq.LARGE_M, isa,
                                               gq.INTDOT_MAX_M)
        return self.ops.llama_decode_dense(*args, self.packed)


def _group_gemm_fns() -> tuple[int, int, int]:
    """``(group_gemm address, intdot_gemm address or 0, intdot ISA path)`` for ``llama_decode_group``:
    the entry points of the modules ``group_quant.group_linear`` calls (``get_quant_ops``,
    ``get_intdot_ops``; 0 when not built; intdot 0 also when ``PAGEDLLM_GGUF_INTDOT`` is off)."""
    from pagedllm.kernels.cpu_ops import get_intdot_ops, get_quant_ops
    from pagedllm.quantization import group_quant as gq

    qops = get_quant_ops()
    if qops is None or not hasattr(qops, "group_gemm_fn"):
        return 0, 0, 0
    iops = get_intdot_ops() if gq.INTDOT else None
    if iops is None or not hasattr(iops, "intdot_gemm_fn"):
        return int(qops.group_gemm_fn()), 0, 0
    return int(qops.group_gemm_fn()), int(iops.intdot_gemm_fn()), int(gq.intdot_isa(iops))


def _llama_layer_forward():
    from pagedllm.models.llama import LlamaDecoderLayer

    return LlamaDecoderLayer.forward


def build_decode_accelerator(model: nn.Module, *, sharded: bool = False, batch_invariant: bool = False,
                             name: str = "model") -> Optional[FusedDecode]:
    """The fused decode step for a finished ``model`` (a ``CausalLM``), or None; called once after
    the model is built, the decision logged once (``name`` says which model).

    Not eligible: ``PAGEDLLM_FUSED_DECODE=0``; several ranks (the fused step has no collectives and
    runs every layer); batch-invariant mode (it calls oneDNN's linears); a model whose body is not
    ``LlamaModel``'s forward; layers with forward hooks (EAGLE-3 reads hidden states there, which
    the fused step bypasses); layers, weights or kernels ``FusedDecode.build`` does not take.
    """
    from pagedllm.models.llama import LlamaModel

    inner = getattr(model, "model", None)
    reason = None
    if not fused_decode_enabled():
        reason = "PAGEDLLM_FUSED_DECODE=0"
    elif sharded:
        reason = "tensor/pipeline parallel"
    elif batch_invariant:
        reason = "batch-invariant mode"
    elif not isinstance(inner, LlamaModel) or type(inner).forward is not LlamaModel.forward:
        reason = f"{type(model).__name__} is not a Llama-shaped model"
    elif any(m._forward_pre_hooks or m._forward_hooks for m in inner.layers):
        reason = "hooks on the decoder layers read hidden states"
    plan = FusedDecode.build(inner) if reason is None else None
    if reason is None and plan is None:
        reason = "layers, weights, device or kernels the fused step does not take"
    if plan is not None:
        logger.info("pagedllm: %s: fused CPU decode step on (%s%s)", name, plan.kind,
                    ", oneDNN-packed" if plan.packed else "")
    else:
        logger.info("pagedllm: %s: fused CPU decode step off (%s)", name, reason)
    return plan


def decode_step(accelerator: Any, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One forward of ``model``: through ``accelerator`` (a ``FusedDecode``) when it takes the step,
    else the model's own forward; inside ``set_forward_context``."""
    if accelerator is not None:
        out = accelerator.forward(model, input_ids, positions)
        if out is not None:
            return out
    return model(input_ids, positions)
