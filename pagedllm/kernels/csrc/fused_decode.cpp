// The decoder layers of a decode-only step of a Llama-shaped model, in one call: W8A8 weights
// (llama_decode_w8a8), float weights (llama_decode_dense: bf16 with oneDNN-packed weights, or
// float32) or group-quantized weights (llama_decode_group: GGUF blocks, GPTQ/AWQ/... through
// group_gemm.cpp, or GGUF's opt-in integer-dot kernel intdot_gemm.cpp).
//
// The Python model runs each layer as ~10 kernel calls (norm+quantize, qkv GEMM, rope, K/V store,
// decode attention, quantize, o GEMM, norm+quantize, gate/up GEMM, SiLU*up+quantize, down GEMM);
// at decode batch sizes each call's Python and dispatcher overhead (~7 us) adds up to 2-3 ms per
// step for SmolLM2's 30 layers (benchmarks/results/performance-history-2026-11.md, step 26).
// This file calls the same kernels
// (the float linears through the same ATen / oneDNN operators), in the same order and on the same
// operands, from one loop, so the result is bit-identical to the Python path (tested in
// tests/kernels/test_fused_decode.py).
#include "torch_lite.h"
#include <ATen/core/dispatch/Dispatcher.h>

#include <tuple>
#include <vector>

// The kernels it strings together (paged_decode.cpp, quant_ops.cpp, layer_ops.cpp, int8_gemm.cpp).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double soft_cap);
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(at::Tensor x);
std::tuple<at::Tensor, at::Tensor> rms_norm_quant(at::Tensor x, c10::optional<at::Tensor> residual,
                                                   at::Tensor weight, double eps);
std::tuple<at::Tensor, at::Tensor> dequant_silu_mul_quant(at::Tensor acc, at::Tensor sx, at::Tensor sw);
void rotary_inplace(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos, at::Tensor sin);
void reshape_and_cache(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slots);
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gu);
at::Tensor int8_gemm_packed(at::Tensor x, at::Tensor packed, at::Tensor comp, int64_t N);
at::Tensor int8_gemm_packed_dequant(at::Tensor x, at::Tensor packed, at::Tensor comp, int64_t N, at::Tensor sx,
                                   at::Tensor sw, c10::optional<at::Tensor> bias, at::ScalarType dtype);

namespace {

// Per layer, in this order (FUSED_W8A8_TENSORS_PER_LAYER in pagedllm/worker/fused_decode.py):
enum LayerTensor {
  kInNorm,                                // float32 [H]: input_layernorm's effective weight
  kQkvPacked, kQkvComp, kQkvScale, kQkvBias,  // qkv_proj: packed int8, comp, w_scales [N], bias or empty
  kOPacked, kOComp, kOScale, kOBias,          // o_proj
  kPostNorm,                              // float32 [H]: post_attention_layernorm's effective weight
  kGuPacked, kGuComp, kGuScale,           // gate_up_proj (no bias)
  kDownPacked, kDownComp, kDownScale, kDownBias,  // down_proj
  kPerLayer
};

c10::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// silu(gate) * up of a fused gate|up output [T, 2I], as GatedMLP.forward computes it: the
// silu_and_mul kernel for float32 / bfloat16, torch's silu and mul otherwise.
at::Tensor act_mul(const at::Tensor& gu) {
  if (gu.scalar_type() == at::kFloat || gu.scalar_type() == at::kBFloat16) return silu_and_mul(gu);
  const int64_t I = gu.size(1) / 2;
  return at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
}

// qkv [T, (Hq + 2 Hkv) * D] -> rope on q/k in place, K/V stored at slot_mapping, decode attention
// over the cache: [T, Hq * D] (SelfAttention.forward + TorchPagedAttention.forward's decode-only
// branch).
at::Tensor attention_block(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& kv_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& cos, const at::Tensor& sin,
                           int64_t window, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           double scale) {
  const int64_t T = qkv.size(0), dq = num_heads * head_dim, dkv = num_kv_heads * head_dim;
  at::Tensor q = qkv.narrow(1, 0, dq).view({T, num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, dq, dkv).view({T, num_kv_heads, head_dim});
  at::Tensor v = qkv.narrow(1, dq + dkv, dkv).view({T, num_kv_heads, head_dim});
  rotary_inplace(q, k, positions, cos, sin);
  reshape_and_cache(k, v, kv_cache, slot_mapping);
  return paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, window, 0.0).reshape({T, dq});
}

// Linear.forward: oneDNN's packed bf16 linear (mkldnn::_linear_pointwise, as the module calls it)
// or F.linear on the dense weight.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool packed) {
  if (packed) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                           c10::string_view, c10::List<std::optional<at::Scalar>>,
                                           std::optional<c10::string_view>)>();
    c10::List<std::optional<at::Scalar>> scalars;
    scalars.push_back(std::nullopt);
    return op.call(x, w, opt(bias), "none", scalars, c10::string_view(""));
  }
  return at::linear(x, w, opt(bias));
}

// Per layer for llama_decode_dense (FUSED_DENSE_TENSORS_PER_LAYER in pagedllm/worker/fused_decode.py):
enum DenseTensor {
  dInNorm, dQkvW, dQkvBias, dOW, dOBias, dPostNorm, dGuW, dGuBias, dDownW, dDownBias, dPerLayer
};

// The GEMMs of group-quantized projections live in their own extension modules (group_gemm.cpp,
// intdot_gemm.cpp: built with their own flags, so not linked here); their modules hand out the
// address of their entry point (group_gemm_fn() / intdot_gemm_fn()), called here with the same
// arguments the Python module path passes (group_quant.group_linear), so the result is the same.
using GroupGemmFn = at::Tensor (*)(at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                                   c10::optional<at::Tensor>, int64_t, int64_t, int64_t, at::ScalarType);
using IntdotGemmFn = at::Tensor (*)(at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                                    c10::optional<at::Tensor>, int64_t, int64_t, at::ScalarType, int64_t, int64_t,
                                    c10::optional<at::Tensor>);

// Per layer for llama_decode_group (FUSED_GROUP_TENSORS_PER_LAYER in pagedllm/worker/fused_decode.py):
// each projection as qweight, scales, mins (or empty), bias (or empty), interleaved scales (or empty).
constexpr int kPerProj = 5;
enum GroupTensor {
  gInNorm, gQkv, gO = gQkv + kPerProj, gPostNorm = gO + kPerProj, gGu, gDown = gGu + kPerProj,
  gPerLayer = gDown + kPerProj
};
// Per projection (qkv, o, gate_up, down) in `modes`: kind, group, whether the integer-dot kernel may run it.
constexpr int64_t kModesPerLinear = 3, kModesPerLayer = 4 * kModesPerLinear;

struct GroupGemms {
  GroupGemmFn group;
  IntdotGemmFn intdot;  // nullptr: not built / off
  int64_t large_m, isa, intdot_max_m;

  // group_quant.group_linear for x [T, K]: intdot_gemm when the layer allows it and T is within
  // the integer-dot row limit, else group_gemm; output in x's dtype.
  at::Tensor operator()(const at::Tensor& x, const at::Tensor* p, const int64_t* mode) const {
    const at::Tensor xc = x.contiguous();
    if (mode[2] && intdot != nullptr && xc.size(0) <= intdot_max_m) {
      return intdot(xc, p[0], p[1], opt(p[2]), opt(p[3]), mode[0], mode[1], xc.scalar_type(), isa, 0, opt(p[4]));
    }
    return group(xc, p[0], p[1], opt(p[2]), opt(p[3]), mode[0], mode[1], large_m, xc.scalar_type());
  }
};

}  // namespace

// x: [T, H] float32/bf16 token embeddings (becomes the residual stream; updated in place).
// positions: int64 [T]; layers: kPerLayer tensors per layer; kv_caches: one [NB, 2, BS, Hkv, D]
// per layer; slot_mapping int64 [T]; block_tables int64 [T, max_blocks]; seq_lens int64 [T];
// cos/sin: float32 [P, D/2] rope tables; windows: per-layer sliding window (0 = none).
// Returns the final norm's output [T, H] in x's dtype.
at::Tensor llama_decode_w8a8(at::Tensor x, at::Tensor positions, const TensorList& layer_list,
                             std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor cos, at::Tensor sin, at::Tensor final_norm,
                             std::vector<int64_t> windows, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, double scale, double eps) {
  const std::vector<at::Tensor>& layers = layer_list.tensors;
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == L * kPerLayer, "llama_decode_w8a8: expected ", kPerLayer,
              " tensors per layer for ", L, " layers, got ", layers.size());
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == L, "llama_decode_w8a8: one window per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "llama_decode_w8a8: x must be a contiguous [T, H] tensor");
  const int64_t H = x.size(1);
  const at::ScalarType dtype = x.scalar_type();
  at::Tensor residual = x, h;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = layers.data() + l * kPerLayer;
    // input_layernorm (+ the previous layer's residual add) -> int8 rows
    auto [q8, s8] = l == 0 ? rms_norm_quant(x, c10::nullopt, w[kInNorm], eps)
                           : rms_norm_quant(h, residual, w[kInNorm], eps);
    at::Tensor qkv = int8_gemm_packed_dequant(q8, w[kQkvPacked], w[kQkvComp], w[kQkvScale].numel(), s8,
                                              w[kQkvScale], opt(w[kQkvBias]), dtype);
    at::Tensor attn = attention_block(qkv, positions, kv_caches[l], slot_mapping, block_tables, seq_lens, cos, sin,
                                      windows[l], num_heads, num_kv_heads, head_dim, scale);
    auto [qa, sa] = quantize_rows_int8(attn.contiguous());
    h = int8_gemm_packed_dequant(qa, w[kOPacked], w[kOComp], w[kOScale].numel(), sa, w[kOScale], opt(w[kOBias]),
                                 dtype);
    // post_attention_layernorm (+ residual add) -> gate|up -> silu(gate) * up -> down
    auto [q2, s2] = rms_norm_quant(h, residual, w[kPostNorm], eps);
    at::Tensor acc = int8_gemm_packed(q2, w[kGuPacked], w[kGuComp], w[kGuScale].numel());
    auto [q3, s3] = dequant_silu_mul_quant(acc, s2, w[kGuScale]);
    h = int8_gemm_packed_dequant(q3, w[kDownPacked], w[kDownComp], w[kDownScale].numel(), s3, w[kDownScale],
                                 opt(w[kDownBias]), dtype);
  }
  TORCH_CHECK(h.defined(), "llama_decode_w8a8: no layers");
  TORCH_CHECK(h.size(1) == H, "llama_decode_w8a8: hidden size mismatch");
  return rms_norm(h, residual, final_norm, eps);
}

// The same loop for a float model (module path: RMSNorm -> Linear, no quantization): x [T, H]
// float32/bf16; layers: dPerLayer tensors per layer (weights oneDNN-packed when `packed`, as
// prepack_cpu_linears leaves a bf16 model, else dense [N, K]; empty tensors for absent biases);
// the other arguments as for llama_decode_w8a8. Returns the final norm's output [T, H].
at::Tensor llama_decode_dense(at::Tensor x, at::Tensor positions, const TensorList& layer_list,
                              std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor block_tables,
                              at::Tensor seq_lens, at::Tensor cos, at::Tensor sin, at::Tensor final_norm,
                              std::vector<int64_t> windows, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, double scale, double eps, bool packed) {
  const std::vector<at::Tensor>& layers = layer_list.tensors;
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == L * dPerLayer, "llama_decode_dense: expected ", dPerLayer,
              " tensors per layer for ", L, " layers, got ", layers.size());
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == L, "llama_decode_dense: one window per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "llama_decode_dense: x must be a contiguous [T, H] tensor");
  at::Tensor residual = x, h;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = layers.data() + l * dPerLayer;
    at::Tensor n1 = l == 0 ? rms_norm(x, c10::nullopt, w[dInNorm], eps) : rms_norm(h, residual, w[dInNorm], eps);
    at::Tensor qkv = linear(n1, w[dQkvW], w[dQkvBias], packed);
    at::Tensor attn = attention_block(qkv, positions, kv_caches[l], slot_mapping, block_tables, seq_lens, cos, sin,
                                      windows[l], num_heads, num_kv_heads, head_dim, scale);
    h = linear(attn, w[dOW], w[dOBias], packed);
    at::Tensor n2 = rms_norm(h, residual, w[dPostNorm], eps);
    at::Tensor gu = linear(n2, w[dGuW], w[dGuBias], packed);
    h = linear(act_mul(gu), w[dDownW], w[dDownBias], packed);
  }
  TORCH_CHECK(h.defined(), "llama_decode_dense: no layers");
  return rms_norm(h, residual, final_norm, eps);
}

// The same loop for group-quantized projections (module path: RMSNorm -> Linear whose
// GroupQuantLinearMethod runs group_linear): layers: gPerLayer tensors per layer (per projection
// qweight, scales, mins or empty, bias or empty, interleaved scales or empty; the group layout of
// group_quant.install); modes:
// kModesPerLayer ints per layer (kind, group, intdot allowed, per projection); group_fn /
// intdot_fn: addresses of group_gemm / intdot_gemm (intdot_fn 0: never); large_m: group_gemm's
// register-path row limit (group_quant.LARGE_M); isa: the integer-dot ISA path; intdot_max_m:
// its row limit (group_quant.INTDOT_MAX_M). The other arguments as for llama_decode_w8a8.
// Returns the final norm's output [T, H] in x's dtype.
at::Tensor llama_decode_group(at::Tensor x, at::Tensor positions, const TensorList& layer_list,
                              std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor block_tables,
                              at::Tensor seq_lens, at::Tensor cos, at::Tensor sin, at::Tensor final_norm,
                              std::vector<int64_t> windows, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, double scale, double eps, std::vector<int64_t> modes,
                              int64_t group_fn, int64_t intdot_fn, int64_t large_m, int64_t isa,
                              int64_t intdot_max_m) {
  const std::vector<at::Tensor>& layers = layer_list.tensors;
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == L * gPerLayer, "llama_decode_group: expected ", gPerLayer,
              " tensors per layer for ", L, " layers, got ", layers.size());
  TORCH_CHECK(static_cast<int64_t>(modes.size()) == L * kModesPerLayer, "llama_decode_group: expected ",
              kModesPerLayer, " modes per layer");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == L, "llama_decode_group: one window per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "llama_decode_group: x must be a contiguous [T, H] tensor");
  TORCH_CHECK(group_fn != 0, "llama_decode_group: group_gemm's address is required");
  const GroupGemms gemm{reinterpret_cast<GroupGemmFn>(group_fn), reinterpret_cast<IntdotGemmFn>(intdot_fn), large_m,
                        isa, intdot_max_m};
  at::Tensor residual = x, h;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = layers.data() + l * gPerLayer;
    const int64_t* md = modes.data() + l * kModesPerLayer;
    at::Tensor n1 = l == 0 ? rms_norm(x, c10::nullopt, w[gInNorm], eps) : rms_norm(h, residual, w[gInNorm], eps);
    at::Tensor qkv = gemm(n1, w + gQkv, md);
    at::Tensor attn = attention_block(qkv, positions, kv_caches[l], slot_mapping, block_tables, seq_lens, cos, sin,
                                      windows[l], num_heads, num_kv_heads, head_dim, scale);
    h = gemm(attn, w + gO, md + kModesPerLinear);
    at::Tensor n2 = rms_norm(h, residual, w[gPostNorm], eps);
    at::Tensor gu = gemm(n2, w + gGu, md + 2 * kModesPerLinear);
    h = gemm(act_mul(gu), w + gDown, md + 3 * kModesPerLinear);
  }
  TORCH_CHECK(h.defined(), "llama_decode_group: no layers");
  return rms_norm(h, residual, final_norm, eps);
}
