// Fused element-wise kernels around int8 GEMMs (W8A8: int8 weights, int8 activations with one
// dynamic scale per token row). The GEMM itself is torch._int_mm (oneDNN, AVX512-VNNI); these
// kernels replace the chains of small torch ops on either side of it, each in one pass over a row:
//
//   quantize_rows_int8(x [M, K])            -> q int8 [M, K], scale f32 [M]
//   rms_norm_quant(x [M, K], r? [M, K], w f32 [K], eps) -> q int8 [M, K], scale f32 [M]
//       RMSNorm then quantize; with a residual r: r += x in place first and r is normalized.
//   dequant_int32(acc [M, N], sx [M], sw [N], bias?, dtype) -> out [M, N] in dtype
//   dequant_silu_mul_quant(acc [M, 2I], sx, sw) -> q int8 [M, I], scale f32 [M]
//
// Quantization is symmetric: scale = max|v| / 127, q = round-half-even(v / scale) in [-127, 127];
// a row of zeros gets scale 0 and q 0. Built with -ffast-math: NaN/inf inputs are not detected
// (they give finite garbage, not NaN). Dequantization: out = acc * (sx[m] * sw[n]) (+ bias[n]).
// The torch reference for every function is in pagedllm/quantization/w8a8.py.
#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_utils.h"

namespace {

using namespace pagedllm_cpu;

// Quantize one float row in place into q; returns the scale.
inline float quantize_row(const float* __restrict v, int8_t* __restrict q, int64_t n) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
  if (!(amax > 0.f)) {
    std::memset(q, 0, n);
    return 0.f;
  }
  const float inv = 127.f / amax;
  // NOTE: rintf (round-half-even in the default mode) on int32 vectorizes; nearbyint under
  // "omp simd" did not.
  for (int64_t i = 0; i < n; ++i) {
    int32_t r = static_cast<int32_t>(__builtin_rintf(v[i] * inv));
    r = r > 127 ? 127 : (r < -127 ? -127 : r);
    q[i] = static_cast<int8_t>(r);
  }
  return amax / 127.f;
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous 2-D tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(at::Tensor x) {
  check_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto s = at::empty({M}, x.options().dtype(at::kFloat));
  dispatch_float_bf16(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = s.data_ptr<float>();
    at::parallel_for(0, M, row_grain(K), [&](int64_t b, int64_t e) {
      std::vector<float> buf(K);
      for (int64_t m = b; m < e; ++m) {
        load_row(xp + m * K, buf.data(), K);
        sp[m] = quantize_row(buf.data(), qp + m * K, K);
      }
    });
  });
  return {q, s};
}

// residual == None: quantize(rms_norm(x) * w). Otherwise residual += x (in place, in its dtype)
// and the sum is normalized, as in HF's "x = x + attn; h = norm(x)".
std::tuple<at::Tensor, at::Tensor> rms_norm_quant(at::Tensor x, c10::optional<at::Tensor> residual,
                                                   at::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  pagedllm_cpu::check_norm_args(x, residual, weight);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto s = at::empty({M}, x.options().dtype(at::kFloat));
  dispatch_float_bf16(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    const float* wp = weight.data_ptr<float>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = s.data_ptr<float>();
    at::parallel_for(0, M, row_grain(K), [&](int64_t b, int64_t e) {
      std::vector<float> buf(K), rbuf(K);
      for (int64_t m = b; m < e; ++m) {
        load_row(xp + m * K, buf.data(), K);
        if (rp != nullptr) {
          load_row(rp + m * K, rbuf.data(), K);
#pragma omp simd
          for (int64_t i = 0; i < K; ++i) rbuf[i] += buf[i];
          store_row(rbuf.data(), rp + m * K, K);
          load_row(rp + m * K, buf.data(), K);  // normalize the stored (rounded) sum, as the torch path does
        }
        rms_norm_row(buf.data(), wp, K, eps);
        sp[m] = quantize_row(buf.data(), qp + m * K, K);
      }
    });
  });
  return {q, s};
}

at::Tensor dequant_int32(at::Tensor acc, at::Tensor sx, at::Tensor sw, c10::optional<at::Tensor> bias,
                         at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt, "acc must be contiguous int32 [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1);
  const at::Tensor b = pagedllm_cpu::check_dequant_operands(sx, sw, bias, dtype, M, N);
  auto out = at::empty({M, N}, acc.options().dtype(dtype));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sxp = sx.data_ptr<float>();
  const float* swp = sw.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  dispatch_float_bf16(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, row_grain(N), [&](int64_t bgn, int64_t end) {
#ifdef __AVX512F__
      for (int64_t m = bgn; m < end; ++m) {
        const int32_t* a = ap + m * N;
        for (int64_t n = 0; n < N; n += 16) {
          const __mmask16 mk = tail_mask(N - n);
          const __m512 f = dequant16(_mm512_maskz_loadu_epi32(mk, a + n), sxp[m], swp + n,
                                     bp != nullptr ? bp + n : nullptr, mk);
          store16(op + m * N + n, f, mk);
        }
      }
#else
      std::vector<float> buf(N);
      for (int64_t m = bgn; m < end; ++m) {
        const int32_t* a = ap + m * N;
        const float sm = sxp[m];
#pragma omp simd
        for (int64_t n = 0; n < N; ++n) buf[n] = static_cast<float>(a[n]) * (sm * swp[n]);
        if (bp != nullptr) {
#pragma omp simd
          for (int64_t n = 0; n < N; ++n) buf[n] += bp[n];
        }
        store_row(buf.data(), op + m * N, N);
      }
#endif
    });
  });
  return out;
}

// acc [M, 2I] = [gate | up] accumulators of a fused gate/up projection -> quantized silu(gate) * up.
std::tuple<at::Tensor, at::Tensor> dequant_silu_mul_quant(at::Tensor acc, at::Tensor sx, at::Tensor sw) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt && acc.size(1) % 2 == 0,
              "acc must be contiguous int32 [M, 2I]");
  const int64_t M = acc.size(0), N = acc.size(1), I = N / 2;
  TORCH_CHECK(sx.numel() == M && sx.scalar_type() == at::kFloat && sx.is_contiguous(), "sx must be float32 [M]");
  TORCH_CHECK(sw.numel() == N && sw.scalar_type() == at::kFloat && sw.is_contiguous(), "sw must be float32 [2I]");
  auto q = at::empty({M, I}, acc.options().dtype(at::kChar));
  auto s = at::empty({M}, acc.options().dtype(at::kFloat));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sxp = sx.data_ptr<float>();
  const float* swp = sw.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  at::parallel_for(0, M, row_grain(N), [&](int64_t bgn, int64_t end) {
    std::vector<float> h(I);
    for (int64_t m = bgn; m < end; ++m) {
      const int32_t* g = ap + m * N;
      const int32_t* u = g + I;
      const float sm = sxp[m];
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float gv = static_cast<float>(g[i]) * sm * swp[i];
        const float uv = static_cast<float>(u[i]) * sm * swp[I + i];
        h[i] = gv / (1.f + exp_approx(-gv)) * uv;
      }
      sp[m] = quantize_row(h.data(), qp + m * I, I);
    }
  });
  return {q, s};
}
