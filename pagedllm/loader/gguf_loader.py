"""GGUF file -> HF config + HF-named, dequantized weights.

Sources:
- Block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ*, F16, BF16, F32) are llama.cpp's ggml quant types;
  dequantization is `gguf.quants.dequantize` (the gguf-py reference, bit-exact with what transformers loads).
- Tensor names are llama.cpp's (gguf-py `constants.TENSOR_NAMES`), mapped to HF names by `_NAME_MAP`.
- Config keys follow transformers' own GGUF config mapping (`integrations/ggml.py`), so `hf_config` equals
  `AutoConfig.from_pretrained(dir, gguf_file=name)` on the fields a model needs.

Per-architecture fixes (see docs/hardware-and-models.md, "GGUF tensor names",
"Norm offsets" and "llama.cpp Q/K un-permutation"):
- llama (and Mixtral, which llama.cpp writes as "llama" with experts), granite: llama.cpp's convert script
  permutes q/k rows for its rope layout; `_unpermute` undoes it (n_head for Q, n_head_kv for K), after which HF
  rope (rotate_half) applies.
- gemma2, gemma3: llama.cpp stores RMSNorm weights as `1 + w`; HF Gemma RMSNorm computes `x * (1 + w)`, so 1 is
  subtracted from every `*norm.weight`.
- phi3: `attn_qkv` / `ffn_up` are HF's fused `qkv_proj` / `gate_up_proj`; partial rotary from
  `rope.dimension_count`; longrope factors from the `rope_factors_long` / `rope_factors_short` tensors.
- MoE (llama.cpp's `ffn_{gate,up,down}_exps` `[E, out, in]`, router `ffn_gate_inp`, shared expert `*_shexp`):
  the stacked tensors are yielded per expert under HF's names (`mlp.experts.N.{gate,up,down}_proj.weight`).
Architectures beyond the four `TextConfig` covers get transformers' own config class
(`AutoConfig.for_model`).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from .gguf_file import GGUFFile
from .text_config import SUPPORTED_MODEL_TYPES, TextConfig

logger = logging.getLogger(__name__)

# GGUF general.architecture -> (transformers model_type, HF architectures entry)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
_MIXTRAL = ("mixtral", "MixtralForCausalLM")  # llama.cpp writes Mixtral as "llama" with llama.expert_count > 0
_PERMUTED_QK = ("llama", "granite")  # llama.cpp permutes q/k rows for these
_NORM_PLUS_ONE = ("gemma2", "gemma3")  # llama.cpp stores Gemma's (1 + w) norm weights

# Per-architecture GGUF metadata suffixes -> HF config fields (llama.cpp's writer keys; gguf-py Keys.LLM).
_ARCH_CONFIG_KEYS = {
    "gemma2": {"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "phi3": {"attention.sliding_window": "sliding_window"},
    "granite": {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"},
    "olmoe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
              "attention.clamp_kqv": "clip_qkv"},
    "qwen2moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size"},
    "mixtral": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
}
# Top-k renormalisation llama.cpp applies per architecture (HF's norm_topk_prob; Mixtral always renormalises).
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "olmoe": False}

# GGUF metadata suffix (after "<arch>.") -> HF config field. Mirrors transformers integrations/ggml.py.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

_COMMON_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_MOE_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_ARCH_LAYER_NAMES = {
    "gemma3": _GEMMA3_LAYER_NAMES,
    "gemma2": _GEMMA3_LAYER_NAMES,
    "phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "olmo2": {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
    "olmoe": _MOE_LAYER_NAMES, "qwen2moe": _MOE_LAYER_NAMES, "qwen3moe": _MOE_LAYER_NAMES, "llama": _MOE_LAYER_NAMES,
}
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Tensors llama.cpp adds that HF recomputes from the config (e.g. llama 3 rope scaling frequencies; Phi-3's
# longrope factors, read into the config by gguf_config_kwargs).
_IGNORED = {"rope_freqs.weight", *_ROPE_FACTORS}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")

SUPPORTED_QTYPES = frozenset(GGMLQuantizationType)  # whatever gguf.quants.dequantize implements


def hf_name(gguf_name: str, arch: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None if it has no HF counterpart.
    E.g. ("blk.3.ffn_norm.weight", "gemma3") -> "model.layers.3.pre_feedforward_layernorm.weight"."""
    if gguf_name in _COMMON_NAMES:
        return _COMMON_NAMES[gguf_name]
    m = _BLK.match(gguf_name)
    if not m:
        return None
    table = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    part = table.get(m.group(2))
    return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py LlamaModel.permute).
    w: [n_head * head_dim, ...] (weight [out, in] or bias [out]); returns the same shape."""
    # llama.cpp's forward permute is reshape(n_head, 2, d/2, ...).swapaxes(1, 2); this is its inverse.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_Q8_0_BLOCK = np.dtype([("d", "<f2"), ("q", "i1", (32,))])
_CHUNK_ELEMS = 1 << 22  # dequantize ~4M values (16 MB of float32) at a time
# Block formats through gguf-py: its temporaries are several float32 copies of the chunk, so a smaller chunk
# (1 MB of float32) stays in cache.
_BLOCK_CHUNK_ELEMS = 1 << 18
_ROW_DEQUANTIZERS: dict = {}


def _rows_dequantizer(qt: GGMLQuantizationType):
    """A function `rows (uint8 [n, row_bytes]) -> float32 [n, ne0]` for block format `qt`.

    `gguf.quants.dequantize(data, qt)` runs its block class's `dequantize_rows` over groups of 16 rows, which
    for these small models means thousands of tiny numpy calls (~0.7 s for SmolLM2's Q4_1 weights). We call the
    same `dequantize_rows` once per chunk of rows instead: identical element-wise float32 ops, so bit-exact,
    ~2x (Q4_1) to ~4x (Gemma 3's Q5_0 / Q4_K / Q6_K) faster. Falls back to `dequantize` if gguf-py has no
    such class."""
    fn = _ROW_DEQUANTIZERS.get(qt)
    if fn is None:
        import gguf.quants

        cls = getattr(gguf.quants, qt.name, None)
        if getattr(cls, "qtype", None) == qt and hasattr(cls, "dequantize_rows"):
            if hasattr(cls, "init_grid"):
                cls.init_grid()  # IQ* lookup grids (what gguf-py's dequantize does first)
            fn = cls.dequantize_rows
        else:
            def fn(rows, qt=qt):
                return dequantize(rows, qt)
        _ROW_DEQUANTIZERS[qt] = fn
    return fn


def _dequant_q8_0(raw: np.ndarray, out: np.ndarray) -> None:
    """Q8_0 (llama.cpp ggml-common.h block_q8_0: fp16 scale d, then 32 int8 q; value = q * d) into float32
    `out` [rows, ne0]. Same float32 ops as gguf.quants (f16 -> f32, then int8 * f32), hence bit-exact, but it
    writes in place: ~4x faster on the 168M-value Gemma 3 embedding."""
    blocks = raw.reshape(-1).view(_Q8_0_BLOCK)
    np.multiply(blocks["q"], blocks["d"].astype(np.float32)[:, None], out=out.reshape(-1, 32), dtype=np.float32)


def dequantize_tensor(f: GGUFFile, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize GGUF tensor `name` into a new torch tensor of `dtype` and row-major shape `info.shape`.

    Works in row chunks so the only large allocation is the output; results are bit-identical to
    `gguf.quants.dequantize` (what transformers uses). Quant formats: anything `gguf.quants.dequantize`
    supports (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ*, BF16), F16 and F32.
    Raises NotImplementedError (from gguf-py) for an unsupported type."""
    info = f.tensors[name]
    raw = f.raw(name)
    rows, ne0 = raw.shape[0], (info.shape[-1] if info.shape else 1)
    out = torch.empty((rows, ne0), dtype=dtype)
    direct = dtype == torch.float32
    qt = info.ggml_type
    simple = qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0)
    step = max(1, (_CHUNK_ELEMS if simple else _BLOCK_CHUNK_ELEMS) // ne0)
    rows_fn = None if simple else _rows_dequantizer(qt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # from_numpy on the read-only mmap: we only read it
        for r0 in range(0, rows, step):
            r = raw[r0:r0 + step]
            dst = out[r0:r0 + step]
            if qt == GGMLQuantizationType.F32:
                dst.copy_(torch.from_numpy(r.view(np.float32)))
            elif qt == GGMLQuantizationType.F16:
                dst.copy_(torch.from_numpy(r.view(np.float16)))
            elif qt == GGMLQuantizationType.Q8_0:
                if direct:
                    _dequant_q8_0(r, dst.numpy())
                else:
                    tmp = np.empty((r.shape[0], ne0), dtype=np.float32)
                    _dequant_q8_0(r, tmp)
                    dst.copy_(torch.from_numpy(tmp))
            else:
                dst.copy_(torch.from_numpy(rows_fn(r)))
    return out.reshape(info.shape)


def gguf_config_kwargs(f: GGUFFile) -> tuple[str, str, dict]:
    """`(model_type, HF architecture, config kwargs)` from GGUF metadata: the arguments of
    `AutoConfig.for_model(model_type, **kwargs)` (plain Python ints / floats / bools), e.g.
    `("llama", "LlamaForCausalLM", {"hidden_size": 576, "rope_theta": 100000.0, ...})`.
    Raises ValueError for an unsupported architecture."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: GGUF architecture {arch!r} not supported (supported: {sorted(ARCHITECTURES)})")
    model_type, hf_arch = ARCHITECTURES[arch]
    keys_arch = arch
    if arch == "llama" and (f.arch_get("expert_count") or 0) > 0:
        model_type, hf_arch = _MIXTRAL
        keys_arch = "mixtral"
    d: dict = {}
    for suffix, field in {**_CONFIG_KEYS, **_ARCH_CONFIG_KEYS.get(keys_arch, {})}.items():
        v = f.arch_get(suffix)
        if v is not None:
            d[field] = v
    # head_dim: llama.cpp writes rope.dimension_count for llama (== head_dim there, as transformers assumes);
    # for the others attention.key_length is the head size.
    if arch in ("llama", "granite") and f.arch_get("rope.dimension_count") is not None:
        d["head_dim"] = f.arch_get("rope.dimension_count")
    elif f.arch_get("attention.key_length") is not None:
        d["head_dim"] = f.arch_get("attention.key_length")
    if arch == "gemma3" and f.arch_get("attention.sliding_window") is not None:
        d["sliding_window"] = f.arch_get("attention.sliding_window")
    if arch == "gemma2" and "head_dim" in d:
        d["query_pre_attn_scalar"] = d["head_dim"]  # NOTE: llama.cpp scales Gemma 2 by 1/sqrt(head_dim)
    if arch == "phi3":
        _phi3_rope(f, d)
    if arch in _NORM_TOPK:
        d["norm_topk_prob"] = _NORM_TOPK[arch]
    if arch in ("qwen2moe", "qwen3moe"):  # a layer without a router is dense (HF's mlp_only_layers)
        d["decoder_sparse_step"] = 1
        d["mlp_only_layers"] = [i for i in range(int(d["num_hidden_layers"]))
                                if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors]
    for key, field in _TOKEN_ID_KEYS.items():
        if key in f.metadata:
            d[field] = int(f.metadata[key])
    if "vocab_size" not in d and "tokenizer.ggml.tokens" in f.metadata:
        d["vocab_size"] = len(f.metadata["tokenizer.ggml.tokens"])
    d["tie_word_embeddings"] = "output.weight" not in f.tensors
    for k, v in list(d.items()):
        if isinstance(v, (np.integer, np.floating, np.bool_)):
            d[k] = v.item()
    return model_type, hf_arch, d


def _phi3_rope(f: GGUFFile, d: dict) -> None:
    """Phi-3's rope from llama.cpp's metadata: partial rotary (`rope.dimension_count` of head_dim) and,
    with the `rope_factors_*` tensors, longrope (`rope.scaling.original_context_length`)."""
    head_dim = d["hidden_size"] // d["num_attention_heads"]
    rot = f.arch_get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        d["partial_rotary_factor"] = int(rot) / head_dim
    if all(n in f.tensors for n in _ROPE_FACTORS):
        orig = int(f.arch_get("rope.scaling.original_context_length") or d.get("max_position_embeddings"))
        d["original_max_position_embeddings"] = orig
        d["rope_scaling"] = {
            "rope_type": "longrope", "rope_theta": d.pop("rope_theta", 10000.0),
            "long_factor": dequantize_tensor(f, "rope_factors_long.weight").reshape(-1).tolist(),
            "short_factor": dequantize_tensor(f, "rope_factors_short.weight").reshape(-1).tolist(),
            "original_max_position_embeddings": orig}


def gguf_config(f: GGUFFile) -> TextConfig:
    """The model config from GGUF metadata, with `.architectures` set (e.g. ["LlamaForCausalLM"]).

    A `TextConfig`: the attributes (names, values, defaults, derived fields) of the transformers config
    `AutoConfig.for_model(model_type, **kwargs)` would build (LlamaConfig / Gemma3TextConfig / Qwen2Config /
    Qwen3Config), without importing transformers (~1-1.5 s of start-up); `.to_transformers()` gives the real one.
    Raises ValueError for an unsupported architecture.

    Gemma3: local rope base 10000, sliding pattern 6 (layer_types) and query_pre_attn_scalar 256 are not in the
    file; Gemma3TextConfig's defaults supply them, as in transformers' own GGUF loading."""
    model_type, hf_arch, kwargs = gguf_config_kwargs(f)
    if model_type in SUPPORTED_MODEL_TYPES:
        cfg = TextConfig(model_type, **kwargs)
    else:
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg.architectures = [hf_arch]
    return cfg


def iter_gguf_weights(f: GGUFFile, config, dtype: torch.dtype = torch.float32,
                      keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every GGUF tensor that has an HF counterpart, in file order, one at a time.

    Each tensor is dequantized (`dequantize_tensor`; float32 when a fix-up follows), fixed up per architecture (llama
    Q/K un-permute, gemma3 norm - 1), then converted to `dtype`; shape is the HF shape (`[out, in]` for linear
    weights, `[vocab, hidden]` for embeddings, `[n]` for norms). `lm_head.weight` is yielded only if the file has
    `output.weight` (otherwise embeddings are tied). Raises NotImplementedError for a quant type gguf-py cannot
    dequantize.

    keep_quantized: yield every block-quantized tensor as a `pagedllm.quantization.gguf.GGUFRawTensor` (its
    blocks, rows un-permuted for llama q/k: a block never spans rows) for `GGUFConfig`'s methods to repack.
    When the iteration ends the file's pages are dropped from this process (`GGUFFile.drop_pages`), so the
    mapped file does not stay resident beside the model."""
    arch = f.architecture
    n_head = config.num_attention_heads
    n_kv = config.num_key_value_heads
    if keep_quantized:
        from pagedllm.quantization.gguf import GGUFRawTensor, is_block_type
    for name in f.tensors:
        experts = _EXPERTS.match(name)
        if experts:  # stacked [E, out, in] -> one HF tensor per expert
            stacked = dequantize_tensor(f, name, dtype)
            layer, part = experts.group(1), experts.group(2)
            for e in range(stacked.shape[0]):
                yield f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight", stacked[e]
            continue
        target = hf_name(name, arch)
        if target is None:
            if name not in _IGNORED:
                logger.warning("GGUF tensor %s has no HF name for arch %s; skipped", name, arch)
            continue
        permute = arch in _PERMUTED_QK and (".attn_q." in name or ".attn_k." in name)
        info = f.tensors[name]
        if keep_quantized and is_block_type(info.ggml_type):
            raw = f.raw(name)
            if permute:
                raw = _unpermute(torch.from_numpy(raw.copy()), n_head if ".attn_q." in name else n_kv).numpy()
            yield target, GGUFRawTensor(raw, info.ggml_type, info.shape, name)
            continue
        fix = permute or (arch in _NORM_PLUS_ONE and name.endswith("norm.weight"))
        # NOTE: fix-ups run in float32 before the cast, as transformers does (norm - 1 in bf16 would round).
        t = dequantize_tensor(f, name, torch.float32 if fix else dtype)
        if fix:
            if arch in _PERMUTED_QK:
                t = _unpermute(t, n_head if ".attn_q." in name else n_kv)
            else:
                t = t - 1.0
            t = t.to(dtype)
        if name.endswith("ffn_gate_inp_shexp.weight") and t.dim() == 1:
            t = t.unsqueeze(0)  # llama.cpp stores the [1, H] shared-expert gate as [H]
        yield target, t
    f.drop_pages()
