"""The engine's own low-bit weight layout: codes with one scale (and optional min) per group of K.

    w[n, k] = scales[n, k // group] * code[n, k]  (+ mins[n, k // group])

Every format kept quantized maps onto it exactly (no re-quantization): GGUF Q8_0 / Q5_0 / Q6_K
(int8 codes), Q4_0 / Q4_1 / Q4_K / Q3_K (int4 codes), Q5_1 / Q5_K (int8 codes with mins); GPTQ /
AWQ / compressed-tensors int4 and int8 (zero points folded into ``mins = -scale * zero``); FP8
(e4m3 codes, per-tensor / per-channel / block scales). Float32 holds every ``scale * code`` and
``+ min`` of those formats' own dequantization, so ``dequantize`` reproduces their reference
dequantizers bit for bit (tests/quantization/test_gguf_blocks.py).

Storage (``install``): ``qweight`` — int4: uint8 ``[N, K/2]``, each 32-k chunk ``c`` of a row in
16 bytes, byte ``16 c + j`` = ``code[32 c + j] | code[32 c + 16 + j] << 4`` (llama.cpp's nibble
order); int8: int8 ``[N, K]``; fp8: uint8 ``[N, K]`` float8_e4m3fn codes. ``scales`` / ``mins``:
float32 ``[N, ceil(K / group)]``.

Kernel: ``group_gemm`` (``kernels/csrc/group_gemm.cpp``): dequantization in registers and float32
FMA for decode-sized M (the weight read once, in its packed size), dequantized tiles + ATen GEMM
above ``LARGE_M`` rows. Without the C++ kernels, on CUDA, or for shapes it does not take (K not a
multiple of 32, group not a multiple of 16) the torch path dequantizes and calls ``F.linear``.

Integer-dot path (methods with ``intdot = True``: GGUF's), the default for
int4 / int8 codes with groups of 32 (Q4_0, Q4_1, Q4_K, Q8_0, Q5_0, Q5_1, Q5_K) at every M: ``intdot_gemm``
(``kernels/csrc/intdot_gemm.cpp``) quantizes the activations to int8 per 32-block (llama.cpp's
Q8_1 scheme) and sums exact int32 block dots with the block scales in float, as llama.cpp's CPU
backend does, in a fixed order: a row's result is independent of M and of the other rows. Its ISA
path (AVX512-VNNI, AVX2, portable) is chosen from the CPU at run time (``PAGEDLLM_ISA`` forces one)
and logged once. ``PAGEDLLM_GGUF_INTDOT=0`` turns it off (``group_gemm`` runs those layers with
float activations). Group-16 kinds (Q2_K, Q3_K, Q6_K) always take ``group_gemm``.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.quantization.base import EmbeddingMethodBase, LinearMethodBase
from pagedllm import envs

logger = logging.getLogger("pagedllm")

KIND_INT4, KIND_INT8, KIND_FP8 = 0, 1, 2
KIND_NAMES = {KIND_INT4: "int4", KIND_INT8: "int8", KIND_FP8: "fp8"}
#: rows above which the C++ kernel dequantizes tiles for ATen's GEMM instead of its register path
LARGE_M = int(envs.get("PAGEDLLM_GROUP_GEMM_LARGE_M"))
#: the integer-dot kernel for GGUF's int4 / int8 group-32 layers, at every M (decode, verify,
#: prefill) and for the tied LM head (float32 logits): the default (``PAGEDLLM_GGUF_INTDOT=0`` runs
#: ``group_gemm`` with float activations instead). It is the fastest GGUF mode measured here
#: (docs/performance.md "Integer-dot GGUF path") and its perplexity is within +1% of the dequantized
#: float32 model on SmolLM2 Q4_1 (measured +0.55%, tests/quantization/test_gguf_blocks.py). int8 activations are a different
#: rounding of the same model, so greedy answers at a near tie (top-1 / top-2 logprob margin of a
#: few hundredths of a nat) can differ from float activations; tests comparing GGUF blocks token
#: for token with a float32 reference check agreement where the reference's margin is clear, or
#: pin float activations when they test something else (e.g. scheduling invariance).
#: NOTE: re-validated as the default (2026-12-02): the real-model checks that changed with it
#: (pooled vectors vs transformers, examples/openai_tools.py, capital-of-France chat answers, the
#: fp8-KV and mmproj bounds) were near ties, float-tolerance comparisons or a fragile example,
#: each handled from a measurement (docs/performance.md "Integer-dot GGUF path"). The tied LM
#: head stays on it: a float-activation head changed perplexity by 0.1% (31.28 vs 31.31, bf16) and
#: left the tool-call near tie as it was (the model's own tie at the end of the JSON array).
#: NOTE: int8 activations turn last-bit differences of the engine's scheduling-dependent float
#: steps (attention sum order under chunked prefill / prefix hits) into whole code steps, so
#: greedy tokens can differ between schedules at near ties where float activations happened not to
#: (tests that pin scheduling invariance by token equality run with it off; see
#: tests/engine/test_prefix_caching_real.py)
INTDOT = bool(envs.get("PAGEDLLM_GGUF_INTDOT"))
#: rows above which the integer-dot kernel is not used (default: none)
INTDOT_MAX_M = int(envs.get("PAGEDLLM_GGUF_INTDOT_MAX_M"))
#: ``PAGEDLLM_ISA`` values: force one ISA path of the integer-dot kernel (default ``auto``: the
#: best this CPU has, AVX512-VNNI > AVX2 > portable)
ISA_PATHS = {"portable": 0, "avx2": 1, "avx512vnni": 2}
_intdot_isa: Optional[int] = None
_intdot_logged = False
#: rows of weight dequantized at a time on the torch path (bounds its temporary)
_TORCH_TILE_ELEMS = 1 << 22


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` in 0..15 (K a multiple of 32) -> packed uint8 ``[N, K/2]`` (layout above)."""
    n, k = codes.shape
    if k % 32:
        raise ValueError(f"pack_int4: K={k} is not a multiple of 32")
    c = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 ``[N, K/2]`` -> uint8 codes ``[N, K]``."""
    n, half = packed.shape
    p = packed.reshape(n, half // 16, 1, 16)
    return torch.cat((p & 0x0F, p >> 4), dim=2).reshape(n, half * 2)


def codes_as_float(qweight: torch.Tensor, kind: int) -> torch.Tensor:
    """The codes of a stored ``qweight`` as float32 ``[N, K]`` (int4 unpacked, fp8 decoded)."""
    if kind == KIND_INT4:
        return unpack_int4(qweight).float()
    if kind == KIND_FP8:
        return qweight.view(torch.float8_e4m3fn).float()
    return qweight.float()


def expand_groups(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Per-group values ``[N, G]`` -> per-element ``[N, K]``."""
    return t.repeat_interleave(group, dim=1)[:, :k]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], kind: int, group: int,
               k: int) -> torch.Tensor:
    """float32 ``[N, K]``: ``scale * code`` then ``+ min`` (two float32 roundings, as the reference
    dequantizers of GGUF / GPTQ / AWQ compute it). ``scales`` / ``mins``: float32 or float16 (GGUF's
    own fields; widened exactly)."""
    codes = codes_as_float(qweight, kind)
    n, g = scales.shape
    if g * group == k and codes.shape == (n, k):  # NOTE: the same products and sums, broadcast per group
        w = codes.reshape(n, g, group) * scales.float().unsqueeze(-1)
        if mins is not None:
            w = w + mins.float().unsqueeze(-1)
        return w.view(n, k)
    w = codes * expand_groups(scales.float(), group, k)
    if mins is not None:
        w = w + expand_groups(mins.float(), group, k)
    return w


class GroupWeight:
    """One shard's weight in the group layout before packing (what converters return).

    Attributes:
        codes: ``[rows, K]`` — int8 for kinds int8 (-128..127) and int4 (0..15), uint8 fp8 codes.
        scales: float32 ``[rows, G]``; mins: float32 ``[rows, G]`` or None. Both float16 instead where
            the values are exactly the checkpoint's float16 fields (GGUF Q4_0/Q4_1/Q5_x/Q8_0: half
            the bytes; the CPU kernels widen them exactly on load, so every result keeps its bits).
        kind: KIND_INT4 / KIND_INT8 / KIND_FP8; group: elements per scale along K.
    """

    __slots__ = ("codes", "scales", "mins", "kind", "group")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], kind: int,
                 group: int) -> None:
        self.codes, self.scales, self.mins, self.kind, self.group = codes, scales, mins, kind, group

    @property
    def k(self) -> int:
        return self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, K]``."""
        w = (self.codes.view(torch.float8_e4m3fn).float() if self.kind == KIND_FP8 else self.codes.float())
        w = w * expand_groups(self.scales.float(), self.group, self.k)
        if self.mins is not None:
            w = w + expand_groups(self.mins.float(), self.group, self.k)
        return w

    def regroup(self, kind: int, group: int, with_mins: bool) -> "GroupWeight":
        """The same values in a wider layout: int4 codes as int8, groups split into ``group``-sized
        ones (``self.group`` a multiple of it), zero mins added. Exact."""
        if kind != self.kind and not (self.kind == KIND_INT4 and kind == KIND_INT8):
            raise ValueError(f"cannot express {KIND_NAMES[self.kind]} codes as {KIND_NAMES[kind]}")
        if self.group % group:
            raise ValueError(f"group {self.group} is not a multiple of {group}")
        r = self.group // group
        g_new = -(-self.k // group)
        scales = self.scales.repeat_interleave(r, dim=1)[:, :g_new].contiguous()
        mins = None
        if with_mins:
            mins = (self.mins.repeat_interleave(r, dim=1)[:, :g_new].contiguous() if self.mins is not None
                    else torch.zeros_like(scales))
        codes = self.codes.to(torch.int8) if kind == KIND_INT8 else self.codes
        return GroupWeight(codes, scales, mins, kind, group)


def merge(parts: list[GroupWeight]) -> GroupWeight:
    """Stack shards along N in one common layout (the widest kind, the smallest group, mins if
    any has them). Raises ValueError when they cannot share one (fp8 beside integer codes, or
    groups that do not divide each other)."""
    if len(parts) == 1:
        return parts[0]
    kinds = {p.kind for p in parts}
    if KIND_FP8 in kinds and len(kinds) > 1:
        raise ValueError("fp8 and integer shards cannot share one layout")
    kind = KIND_INT8 if KIND_INT8 in kinds else kinds.pop()
    group = min(p.group for p in parts)
    with_mins = any(p.mins is not None for p in parts)
    same = all(p.kind == kind and p.group == group and (p.mins is not None) == with_mins for p in parts)
    parts = parts if same else [p.regroup(kind, group, with_mins) for p in parts]
    return GroupWeight(torch.cat([p.codes.to(torch.int8) if kind == KIND_INT8 else p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                       torch.cat([p.mins for p in parts]) if with_mins else None, kind, group)


def install(layer: nn.Module, gw: GroupWeight) -> None:
    """Store ``gw`` on ``layer`` as ``qweight`` / ``scales`` / ``mins`` parameters (packing int4)
    and record ``gq_kind``, ``gq_group``; the float ``weight`` becomes an empty tensor."""
    if gw.kind == KIND_INT4 and gw.k % 32 == 0:
        q = pack_int4(gw.codes.to(torch.uint8))
        kind = KIND_INT4
    elif gw.kind == KIND_INT4:  # NOTE: int4 packing needs whole 32-k chunks; int8 codes hold the same values
        q, kind = gw.codes.to(torch.int8).contiguous(), KIND_INT8
    else:
        q, kind = gw.codes.contiguous(), gw.kind
    layer.qweight = _param(q)
    # float16 scales (and mins) stay float16 (exact; see GroupWeight); anything else is float32
    half = gw.scales.dtype == torch.float16 and (gw.mins is None or gw.mins.dtype == torch.float16)
    sdt = torch.float16 if half else torch.float32
    layer.scales = _param(gw.scales.to(sdt).contiguous())
    layer.mins = None if gw.mins is None else _param(gw.mins.to(sdt).contiguous())
    layer.gq_kind, layer.gq_group = kind, gw.group
    # the integer-dot columns kernel's interleaved copy of float16 32-group scales (x86 paths)
    layer.scales_il = (_param(interleave_scales(layer.scales, layer.mins))
                       if half and gw.group == 32 and kind in (KIND_INT4, KIND_INT8) and interleave_wanted()
                       else None)
    w = getattr(layer, "weight", None)
    dtype = w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else torch.float32
    layer.weight = _param(torch.empty(0, dtype=dtype))


def interleave_wanted() -> bool:
    """Whether ``install`` adds ``scales_il`` (the interleaved scales the integer-dot kernel's x86
    columns kernel reads in place of transposing the scales of 8 columns each call; one SmolLM2
    Q4_1 layer's four M = 1 GEMMs on one Zen 4 core: 124 -> 107 us on the VNNI path, 170 -> 144 us
    on the AVX2 path forced there; for 1/5 more bytes beside a Q4_1 layer's codes and scales): the
    kernel is on (``PAGEDLLM_GGUF_INTDOT``) and the CPU is x86-64."""
    import platform

    return INTDOT and platform.machine().lower() in ("x86_64", "amd64")


def interleave_scales(scales: torch.Tensor, mins: Optional[torch.Tensor]) -> torch.Tensor:
    """The integer-dot columns kernel's copy of a layer's float16 scales (and mins), interleaved per
    group of 8 output columns so that one 16-byte load gives a block's 8 scales
    (``kernels/csrc/intdot_gemm.cpp``, ``smt``).

    Args:
        scales: float16 ``[N, nb]`` (one per 32-block). mins: float16 ``[N, nb]`` or None.
    Returns:
        float16 ``[ceil(N / 8), nb, 8]`` (``[..., 16]`` with mins: the 8 columns' scales, then their
        mins); ``out[g, b, j] = scales[8 g + j, b]``, columns past N repeat the last one.
    """
    n, nb = scales.shape
    parts = [scales] if mins is None else [scales, mins]
    pad = (-n) % 8
    out = []
    for t in parts:
        if pad:
            t = torch.cat([t, t[-1:].expand(pad, nb)])
        out.append(t.reshape(-1, 8, nb).transpose(1, 2))
    return torch.cat(out, dim=2).contiguous()


def layer_dequantize(layer: nn.Module) -> torch.Tensor:
    """float32 ``[N, K]`` of a layer holding the group layout."""
    return dequantize(layer.qweight, layer.scales, layer.mins, layer.gq_kind, layer.gq_group, _in_features(layer))


def _in_features(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.embedding_dim


def _kernel_ok(x: torch.Tensor, layer: nn.Module, k: int) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and k % 32 == 0
            and layer.gq_group % 16 == 0)


def intdot_isa(ops) -> int:
    """The ISA path (0 portable, 1 avx2, 2 avx512vnni) the integer-dot kernel takes: ``PAGEDLLM_ISA``
    (``auto`` / unset: the best the CPU has), resolved once.

    Raises:
        ValueError: ``PAGEDLLM_ISA`` names no path, or one this CPU lacks."""
    global _intdot_isa
    if _intdot_isa is None:
        want = envs.get("PAGEDLLM_ISA")
        if want == "auto":
            _intdot_isa = int(ops.intdot_best_isa())
        elif want not in ISA_PATHS:
            raise ValueError(f"PAGEDLLM_ISA={want!r}: expected one of auto, {', '.join(ISA_PATHS)}")
        elif not ops.intdot_isa_supported(ISA_PATHS[want]):
            raise ValueError(f"PAGEDLLM_ISA={want}: this CPU lacks that ISA path (best here: "
                             f"{ops.intdot_isa_name(ops.intdot_best_isa())})")
        else:
            _intdot_isa = ISA_PATHS[want]
    return _intdot_isa


def intdot_path() -> Optional[str]:
    """The ISA path the integer-dot kernel takes on this CPU ("avx512vnni", "avx2", "portable";
    ``PAGEDLLM_ISA`` forces one), or None when it is off (``PAGEDLLM_GGUF_INTDOT=0``) or not built."""
    from pagedllm.kernels.cpu_ops import get_intdot_ops

    ops = get_intdot_ops() if INTDOT else None
    return None if ops is None else ops.intdot_isa_name(intdot_isa(ops))


def _intdot_ops_for(layer: nn.Module, x2: torch.Tensor, k: int, dtype: torch.dtype):
    """The integer-dot extension when it takes this call (else None); logs its ISA path once."""
    global _intdot_logged
    if not (INTDOT and x2.shape[0] <= INTDOT_MAX_M and layer.gq_kind in (KIND_INT4, KIND_INT8)
            and layer.gq_group % 32 == 0 and dtype in (torch.float32, torch.bfloat16)):
        return None
    from pagedllm.kernels.cpu_ops import get_intdot_ops

    ops = get_intdot_ops()
    if ops is not None and not _intdot_logged:
        _intdot_logged = True
        logger.info("pagedllm: GGUF integer-dot GEMM (int8 activations per 32-block, every M): %s path%s",
                    ops.intdot_isa_name(intdot_isa(ops)),
                    "" if envs.get("PAGEDLLM_ISA") == "auto" else " (PAGEDLLM_ISA)")
    return ops


def group_linear(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                 out_dtype: Optional[torch.dtype] = None, intdot: bool = False) -> torch.Tensor:
    """``x [..., K] @ dequant(w).T (+ bias)`` -> ``[..., N]`` in ``out_dtype`` (default x's dtype).

    ``intdot``: the caller allows the integer-dot kernel (int8-quantized activations; module
    docstring) for the shapes it takes."""
    from pagedllm.kernels.cpu_ops import get_quant_ops

    k, n = layer.in_features, layer.out_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    dtype = out_dtype or x.dtype
    kernel_ok = _kernel_ok(x2, layer, k)
    iops = _intdot_ops_for(layer, x2, k, dtype) if intdot and kernel_ok else None
    if iops is not None:
        return iops.intdot_gemm(x2.contiguous(), layer.qweight, layer.scales, layer.mins, bias, layer.gq_kind,
                                layer.gq_group, dtype, intdot_isa(iops), 0,
                                getattr(layer, "scales_il", None)).reshape(*lead, n)
    ops = get_quant_ops() if kernel_ok else None
    if ops is not None and dtype in (torch.float32, torch.bfloat16):
        y = ops.group_gemm(x2.contiguous(), layer.qweight, layer.scales, layer.mins, bias, layer.gq_kind,
                           layer.gq_group, LARGE_M, dtype)
    else:
        y = _torch_group_linear(layer, x2, bias, dtype)
    return y.reshape(*lead, n)


def _torch_group_linear(layer: nn.Module, x2: torch.Tensor, bias: Optional[torch.Tensor],
                        dtype: torch.dtype) -> torch.Tensor:
    """Reference path: dequantize tiles of rows (float32 math) and ``F.linear``."""
    k, n = layer.in_features, layer.out_features
    rows = max(1, _TORCH_TILE_ELEMS // k)
    xf = x2.float()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x2.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        mins = None if layer.mins is None else layer.mins[r0:r1]
        w = dequantize(layer.qweight[r0:r1], layer.scales[r0:r1], mins, layer.gq_kind, layer.gq_group, k)
        out[:, r0:r1] = F.linear(xf, w.to(xf.device))
    if bias is not None:
        out += bias.float()
    return out.to(dtype)


class GroupQuantLinearMethod(LinearMethodBase):
    """``apply`` / ``dequantize`` of a layer holding the group layout (``install``). Format
    methods (GGUF, GPTQ, ...) subclass it and implement loading and processing.

    Args:
        out_dtype: fixed output dtype (float32 for an LM head) or None (the activation's).

    Attributes:
        intdot: whether decode-sized calls may take the integer-dot kernel (int8 activations, as
            llama.cpp runs GGUF); False here (GPTQ / AWQ / ... keep float activations), True for GGUF.
    """

    intdot = False

    def __init__(self, out_dtype: Optional[torch.dtype] = None) -> None:
        self.out_dtype = out_dtype

    def apply(self, layer, x, bias=None):
        return group_linear(layer, x, bias, self.out_dtype, intdot=self.intdot)

    def dequantize(self, layer):
        return layer_dequantize(layer)


class GroupQuantEmbeddingMethod(EmbeddingMethodBase):
    """Lookups in a table held in the group layout: the selected rows are dequantized (float32,
    bit-identical to the dequantized table) and cast to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def embedding(self, layer, ids):
        ids = ids.reshape(-1)
        mins = None if layer.mins is None else layer.mins.index_select(0, ids)
        w = dequantize(layer.qweight.index_select(0, ids), layer.scales.index_select(0, ids), mins, layer.gq_kind,
                       layer.gq_group, layer.embedding_dim)
        return w.to(self.dtype)

    def dequantize(self, layer):
        return layer_dequantize(layer)
