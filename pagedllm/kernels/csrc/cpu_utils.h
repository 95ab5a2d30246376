// Shared helpers of the CPU kernels (row loads/stores with bf16 conversion, a vectorizable exp,
// RMSNorm of one row, float32/bfloat16 dispatch). Header-only, included by each kernel source.
#pragma once
#include "torch_lite.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace pagedllm_cpu {


inline void load_row(const at::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

inline void load_row(const float* __restrict src, float* __restrict dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// float -> bf16 with round-to-nearest-even (finite inputs), written so it vectorizes.
inline void store_row(const float* __restrict src, at::BFloat16* __restrict dst, int64_t n) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = s[i];
    d[i] = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
}

inline void store_row(const float* __restrict src, float* __restrict dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// exp(x) in float32 that GCC vectorizes (std::exp does not here): 2^(x log2 e) split into an
// integer power (exponent bits) and 2^f, f in [0, 1), by a degree-6 polynomial (rel. error ~2e-7).
inline float exp_approx(float x) {
  x = std::min(88.f, std::max(-87.f, x));
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;
  const float p = 1.f + f * (0.693147182f + f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f +
                  f * (0.00133335581f + f * 0.000154035304f)))));
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Shape and dtype checks shared by the group-quantized GEMMs (group_gemm.cpp, intdot_gemm.cpp):
// qweight a contiguous byte tensor [N, row_bytes], scales float32 or float16 [N, ceil(K / group)]
// (float16: GGUF's own d / m fields, kept as stored), mins (if given) of scales' dtype and shape. Returns N; a mismatch raises (RuntimeError in Python).
inline int64_t check_group_weights(const at::Tensor& qweight, const at::Tensor& scales,
                                   const c10::optional<at::Tensor>& mins, int64_t row_bytes, int64_t K,
                                   int64_t group) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1 &&
              qweight.size(1) == row_bytes, "qweight must be a contiguous byte tensor [N, K/2] (int4) or [N, K] (int8, fp8)");
  const int64_t N = qweight.size(0), G = (K + group - 1) / group;
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
              scales.dim() == 2 && scales.size(0) == N && scales.size(1) == G,
              "scales must be float32 or float16 [N, ceil(K / group)]");
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "mins must be contiguous, of scales' dtype (float32 or float16) and shape");
  }
  return N;
}

inline void rms_norm_row(float* __restrict v, const float* __restrict w, int64_t n, double eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] * r * w[i];
}

// Calls f(T{}) with T = float or at::BFloat16 (no AT_DISPATCH macro: pragmas cannot live in one).
template <typename F>
void dispatch_float_bf16(at::ScalarType t, F&& f) {
  if (t == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK(t == at::kFloat, "expected float32 or bfloat16");
    f(float{});
  }
}

// Checks of the RMSNorm kernels' arguments: x contiguous [M, K]; weight float32 [K]; residual
// (optional) like x.
inline void check_norm_args(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D tensor");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "weight must be float32 [K]");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == x.scalar_type(), "residual must match x");
  }
}

// In-place float32 softmax of s[0..n) (max-subtracted; exp_approx).
inline void softmax_row(float* __restrict s, int64_t n) {
  float m = std::numeric_limits<float>::lowest();
  for (int64_t i = 0; i < n; ++i) m = s[i] > m ? s[i] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float e = exp_approx(s[i] - m);
    s[i] = e;
    sum += e;
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

// ---- 8-bit floating-point KV cache (OCP FP8: E4M3FN with M=3, BIAS=7; E5M2 with M=2, BIAS=15;
// the formats of torch.float8_e4m3fn / torch.float8_e5m2 and of vLLM's --kv-cache-dtype fp8).
// A code is sign | exponent | mantissa; exponent 0 holds the subnormals m * 2^(1 - BIAS - M).
// (Reading them back: paged_decode.cpp's fp8x16_to_f16, through the hardware fp16 conversion.)

// Largest finite value of the format: its bits as float32, and its code.
template <int M> constexpr uint32_t fp8_max_bits() { return M == 3 ? 0x43E00000u : 0x47600000u; }  // 448, 57344
template <int M> constexpr uint32_t fp8_max_code() { return M == 3 ? 0x7Eu : 0x7Bu; }

// float32 -> fp8 code, round to nearest even, saturating to the largest finite value (CUDA's
// __NV_SATFINITE conversion, which vLLM uses; torch's .to() gives NaN / inf there instead).
// Branch-free so that loops over it vectorize.
template <int M, int BIAS>
inline uint8_t fp8_encode(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  const uint32_t sign = (b >> 24) & 0x80u;
  const uint32_t a = b & 0x7FFFFFFFu;
  float ax;
  std::memcpy(&ax, &a, sizeof(ax));
  // normal: drop 23 - M mantissa bits with round-half-even, re-bias the exponent
  const uint32_t r = a + ((1u << (22 - M)) - 1u) + ((a >> (23 - M)) & 1u);
  const uint32_t normal = (r >> (23 - M)) - (static_cast<uint32_t>(127 - BIAS) << M);
  // subnormal: the number of 2^(1 - BIAS - M) steps (2^M rounds up to the smallest normal code)
  // (clamped so that the unused result for large |x| stays a valid conversion)
  const uint32_t sub = static_cast<uint32_t>(__builtin_rintf(std::min(ax, 1.f) * static_cast<float>(1u << (BIAS - 1 + M))));
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - BIAS) << 23;
  const uint32_t code = a >= fp8_max_bits<M>() ? fp8_max_code<M>() : (a < kMinNormalBits ? sub : normal);
  return static_cast<uint8_t>(code | sign);
}

// Rows per parallel task so that each task touches at least ``min_elems`` elements: below that,
// waking the other OpenMP threads costs more than the work (the same rule as ATen's GRAIN_SIZE).
// Checks the operands of W8A8's dequantization (dequant_int32, int8_gemm_packed_dequant) for an
// [M, N] result: sx float32 [M], sw float32 [N], bias [N] or none, dtype float32 / bfloat16.
// Returns the bias as a contiguous float32 tensor (undefined when there is none).
inline at::Tensor check_dequant_operands(const at::Tensor& sx, const at::Tensor& sw, const c10::optional<at::Tensor>& bias,
                                         at::ScalarType dtype, int64_t M, int64_t N) {
  TORCH_CHECK(sx.numel() == M && sx.scalar_type() == at::kFloat && sx.is_contiguous(), "sx must be float32 [M]");
  TORCH_CHECK(sw.numel() == N && sw.scalar_type() == at::kFloat && sw.is_contiguous(), "sw must be float32 [N]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must be [N]");
  }
  return b;
}

#ifdef __AVX512F__
// W8A8 dequantization of 16 int32 GEMM sums of one row (lanes in mk): float(acc) * (sm * sw[n]),
// then + bias[n] when bias is not null. The order is pinned by empty asm barriers, which
// -ffast-math cannot reassociate across, so dequant_int32 (quant_ops.cpp) and the packed GEMM's
// epilogue (int8_gemm.cpp) give the same bits.
inline __m512 dequant16(__m512i acc, float sm, const float* sw, const float* bias, __mmask16 mk) {
  __m512 s = _mm512_mul_ps(_mm512_set1_ps(sm), _mm512_maskz_loadu_ps(mk, sw));
  asm("" : "+v"(s));
  __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), s);
  if (bias != nullptr) {
    asm("" : "+v"(f));
    f = _mm512_add_ps(f, _mm512_maskz_loadu_ps(mk, bias));
  }
  return f;
}

// Stores the lanes mk of f as float32, or as bf16 rounded to nearest even by the same bit
// arithmetic as store_row.
inline void store16(float* dst, __m512 f, __mmask16 mk) { _mm512_mask_storeu_ps(dst, mk, f); }
inline void store16(at::BFloat16* dst, __m512 f, __mmask16 mk) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  _mm512_mask_cvtepi32_storeu_epi16(dst, mk, r);
}

inline __mmask16 tail_mask(int64_t rem) {
  return rem >= 16 ? static_cast<__mmask16>(0xFFFF) : (rem <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << rem) - 1));
}
#endif

inline int64_t row_grain(int64_t row_elems, int64_t min_elems = 32768) {
  return std::max<int64_t>(1, min_elems / std::max<int64_t>(1, row_elems));
}

}  // namespace pagedllm_cpu
