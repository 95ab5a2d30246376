// Per-token element-wise kernels of the attention block, each one pass with no temporaries:
//
//   rotary_inplace(q [T, Hq, D], k [T, Hkv, D], positions [T], cos [P, D/2], sin [P, D/2])
//       HF / GPT-NeoX rope ("rotate_half"): for i < D/2, with x1 = x[i], x2 = x[i + D/2]:
//       x[i] = x1 * cos - x2 * sin;  x[i + D/2] = x2 * cos + x1 * sin   (float32 math, in place).
//   reshape_and_cache(k [T, Hkv, D], v [T, Hkv, D], kv_cache [NB, 2, BS, Hkv, D], slots [T])
//       kv_cache[s / BS, 0, s % BS] = k[t]; kv_cache[s / BS, 1, s % BS] = v[t]; slot -1 = skip.
//       An fp8 cache (float8_e4m3fn / float8_e5m2) takes float32/bf16 k, v, encoded with
//       round-to-nearest-even and saturation (cpu_utils.h fp8_encode). A bf16/fp16 cache takes
//       float32 k, v, rounded to nearest even.
//   rms_norm(x [T, K], residual? [T, K], w f32 [K], eps) -> out [T, K] in x's dtype
//       with a residual: residual += x in place (rounded to its dtype), then out = RMSNorm(residual) * w.
//   silu_and_mul(gu float32 / bfloat16 [T, 2I]) -> [T, I] in gu's dtype
//       gate = gu[:, :I], up = gu[:, I:]: out = gate / (1 + exp(-gate)) * up, exp from exp_silu
//       (bfloat16: computed in float32 with torch's two roundings, silu(gate) then the product;
//       F.silu + mul took ~12 us for I = 1536 on Zen 4, this ~1 us)
//       (Cody-Waite reduction with FMAs and Cephes' expf polynomial: within ~2e-7 relative of
//       exp, as torch's Sleef exp; cpu_utils.h exp_approx is ~1e-5). The MLP's
//       act(gate) * up for SiLU on CPU float32 (GatedMLP.forward, fused_decode.cpp): torch's
//       silu + mul took ~12 us for I = 1536 on Zen 1, this ~1.5 us.
//
// q/k/v may be strided views (e.g. slices of a fused qkv output) as long as the last dim is
// contiguous. Torch references: RotaryEmbedding.forward, attention.torch_paged.write_kv,
// RMSNorm.forward.
#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_utils.h"

namespace {

template <typename T>
inline float ld(const T v) { return static_cast<float>(v); }

template <typename T>
void rope_rows(T* base, int64_t t, int64_t H, int64_t D, int64_t s0, int64_t s1, const float* c, const float* s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H; ++h) {
    T* x = base + t * s0 + h * s1;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = ld(x[i]), x2 = ld(x[i + half]);
      x[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
      x[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
    }
  }
}

// bfloat16: the same arithmetic on the bits (widening by a shift, rounding to nearest even as
// c10::BFloat16 does for finite values: cpu_utils.h store_row), which vectorizes; through
// c10::BFloat16 the loop stayed scalar (2% of the default offline run's samples on Zen 4).
template <>
void rope_rows<at::BFloat16>(at::BFloat16* base, int64_t t, int64_t H, int64_t D, int64_t s0, int64_t s1,
                             const float* c, const float* s) {
  const int64_t half = D / 2;
  auto widen = [](uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  };
  auto round = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  };
  for (int64_t h = 0; h < H; ++h) {
    uint16_t* x = reinterpret_cast<uint16_t*>(base + t * s0 + h * s1);
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = widen(x[i]), x2 = widen(x[i + half]);
      x[i] = round(x1 * c[i] - x2 * s[i]);
      x[i + half] = round(x2 * c[i] + x1 * s[i]);
    }
  }
}

}  // namespace

void rotary_inplace(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "q/k shapes");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q/k last dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q/k dtypes differ");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0), "positions");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(1) == D / 2 && cos.sizes() == sin.sizes() &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "cos/sin must be float32 [P, D/2]");
  const int64_t P = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position out of the rope table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t half = D / 2;
  auto run = [&](auto* qp, auto* kp) {
    at::parallel_for(0, T, pagedllm_cpu::row_grain((q.size(1) + k.size(1)) * D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* c = cp + pos[t] * half;
        const float* s = sp + pos[t] * half;
        rope_rows(qp, t, q.size(1), D, q.stride(0), q.stride(1), c, s);
        rope_rows(kp, t, k.size(1), D, k.stride(0), k.stride(1), c, s);
      }
    });
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "q/k must be float32 or bfloat16");
    run(q.data_ptr<float>(), k.data_ptr<float>());
  }
}

// The slot loop of the converting stores: for each token with a slot (>= 0), its K and V rows
// of every head handed to store(src, dst, D, buf) (src: D src_t values; dst: D dst_t in the
// cache block; buf: D floats of scratch, one per thread chunk).
template <typename src_t, typename dst_t, typename Store>
static void store_slots(const at::Tensor& k, const at::Tensor& v, dst_t* cache, const int64_t* sl, int64_t T,
                        int64_t H, int64_t D, int64_t BS, Store store) {
  const src_t* kp = k.data_ptr<src_t>();
  const src_t* vp = v.data_ptr<src_t>();
  const int64_t tok = H * D;
  at::parallel_for(0, T, pagedllm_cpu::row_grain(2 * H * D), [&](int64_t b, int64_t e) {
    std::vector<float> buf(D);
    for (int64_t t = b; t < e; ++t) {
      const int64_t s = sl[t];
      if (s < 0) continue;
      dst_t* kdst = cache + (((s / BS) * 2 * BS) + (s % BS)) * tok;
      dst_t* vdst = kdst + BS * tok;
      for (int64_t h = 0; h < H; ++h) {
        store(kp + t * k.stride(0) + h * k.stride(1), kdst + h * D, D, buf.data());
        store(vp + t * v.stride(0) + h * v.stride(1), vdst + h * D, D, buf.data());
      }
    }
  });
}

// The store into an fp8 cache: every element encoded (round to nearest even, saturating).
template <typename src_t, int M, int BIAS>
static void store_fp8(const at::Tensor& k, const at::Tensor& v, uint8_t* cache, const int64_t* sl, int64_t T,
                      int64_t H, int64_t D, int64_t BS) {
  store_slots<src_t>(k, v, cache, sl, T, H, D, BS, [](const src_t* src, uint8_t* dst, int64_t n, float* buf) {
    pagedllm_cpu::load_row(src, buf, n);
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = pagedllm_cpu::fp8_encode<M, BIAS>(buf[d]);
  });
}

static void reshape_and_cache_fp8(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const int64_t* sl,
                                  int64_t T, int64_t H, int64_t D, int64_t BS) {
  uint8_t* cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  const bool e4m3 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  pagedllm_cpu::dispatch_float_bf16(k.scalar_type(), [&](auto tag) {
    using src_t = decltype(tag);
    if (e4m3) store_fp8<src_t, 3, 7>(k, v, cache, sl, T, H, D, BS);
    else store_fp8<src_t, 2, 15>(k, v, cache, sl, T, H, D, BS);
  });
}

// float32 k/v rows stored into a 16-bit cache (c10::BFloat16 / c10::Half from float: round to
// nearest even).
template <typename dst_t>
static void store_rounded(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const int64_t* sl,
                          int64_t T, int64_t H, int64_t D, int64_t BS) {
  store_slots<float>(k, v, static_cast<dst_t*>(kv_cache.data_ptr()), sl, T, H, D, BS,
                     [](const float* src, dst_t* dst, int64_t n, float*) {
                       for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<dst_t>(src[d]);
                     });
}

void reshape_and_cache(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous [NB, 2, BS, Hkv, D]");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == kv_cache.size(3) && k.size(2) == kv_cache.size(4),
              "k/v must be [T, Hkv, D] matching the cache");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k/v dtypes differ");
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn || kv_cache.scalar_type() == at::kFloat8_e5m2;
  const bool f32_to_half = k.scalar_type() == at::kFloat &&
                           (kv_cache.scalar_type() == at::kBFloat16 || kv_cache.scalar_type() == at::kHalf);
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() || f32_to_half ||
              (fp8 && (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat)),
              "k/v must have the cache's dtype (or be float32/bfloat16 for an fp8 cache, float32 for bf16/fp16)");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v last dim must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0), "slots");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2), BS = kv_cache.size(2), NB = kv_cache.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] < NB * BS, "slot out of the cache");
  if (fp8) {
    reshape_and_cache_fp8(k, v, kv_cache, sl, T, H, D, BS);
    return;
  }
  if (f32_to_half) {  // round to nearest even, as torch's .to(bfloat16 / float16)
    if (kv_cache.scalar_type() == at::kBFloat16) store_rounded<c10::BFloat16>(k, v, kv_cache, sl, T, H, D, BS);
    else store_rounded<c10::Half>(k, v, kv_cache, sl, T, H, D, BS);
    return;
  }
  const int64_t es = kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t tok = H * D;  // elements per token in one K or V block row
  at::parallel_for(0, T, pagedllm_cpu::row_grain(2 * H * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t s = sl[t];
      if (s < 0) continue;
      char* kdst = cache + (((s / BS) * 2 * BS) + (s % BS)) * tok * es;
      char* vdst = kdst + BS * tok * es;
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(kdst + h * D * es, kp + (t * k.stride(0) + h * k.stride(1)) * es, D * es);
        std::memcpy(vdst + h * D * es, vp + (t * v.stride(0) + h * v.stride(1)) * es, D * es);
      }
    }
  });
}

at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  pagedllm_cpu::check_norm_args(x, residual, weight);
  const int64_t M = x.size(0), K = x.size(1);
  auto out = at::empty_like(x);
  pagedllm_cpu::dispatch_float_bf16(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const float* wp = weight.data_ptr<float>();
    at::parallel_for(0, M, pagedllm_cpu::row_grain(K), [&](int64_t b, int64_t e) {
      std::vector<float> buf(K), rbuf(K);
      for (int64_t m = b; m < e; ++m) {
        pagedllm_cpu::load_row(xp + m * K, buf.data(), K);
        if (rp != nullptr) {
          pagedllm_cpu::load_row(rp + m * K, rbuf.data(), K);
#pragma omp simd
          for (int64_t i = 0; i < K; ++i) rbuf[i] += buf[i];
          pagedllm_cpu::store_row(rbuf.data(), rp + m * K, K);
          pagedllm_cpu::load_row(rp + m * K, buf.data(), K);  // normalize the rounded sum, as torch does
        }
        pagedllm_cpu::rms_norm_row(buf.data(), wp, K, eps);
        pagedllm_cpu::store_row(buf.data(), op + m * K, K);
      }
    });
  });
  return out;
}

namespace {

// exp(x) for float32 x, clamped to [-87.3, 88] so that 2^n and the result stay finite (under
// -ffast-math a division may be a reciprocal estimate plus a Newton step, which turns an infinite
// divisor into NaN): n = round(x / ln 2), r = x - n ln 2 in two FMA steps (ln 2 = C1 + C2, C1
// exact in 9 bits), e^r by Cephes' expf minimax polynomial on |r| <= ln 2 / 2, times 2^n built in
// the exponent bits. The FMAs keep the reduction exact under -ffast-math's reassociation.
inline float exp_silu(float x) {
  x = std::min(88.f, std::max(-87.3f, x));
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace

at::Tensor silu_and_mul(at::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && (gu.scalar_type() == at::kFloat || gu.scalar_type() == at::kBFloat16) &&
                  gu.size(1) % 2 == 0,
              "silu_and_mul: gu must be a float32 or bfloat16 [T, 2I] tensor");
  gu = gu.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({T, I}, gu.options());
  if (gu.scalar_type() == at::kBFloat16) {
    // torch's two roundings: silu(gate) rounded to bfloat16, then its product with up rounded
    // (F.silu(g) * u on bfloat16 tensors); bfloat16 <-> float32 as c10::BFloat16 (nearest even)
    using BF = at::BFloat16;
    const BF* gp = gu.data_ptr<BF>();
    BF* op = out.data_ptr<BF>();
    at::parallel_for(0, T, pagedllm_cpu::row_grain(2 * I), [&](int64_t b, int64_t e) {
      constexpr int64_t kChunk = 256;
      float gf[kChunk], uf[kChunk];
      for (int64_t t = b; t < e; ++t) {
        const BF* g = gp + t * 2 * I;
        const BF* u = g + I;
        BF* o = op + t * I;
        for (int64_t i0 = 0; i0 < I; i0 += kChunk) {
          const int64_t n = std::min(kChunk, I - i0);
          pagedllm_cpu::load_row(g + i0, gf, n);
          pagedllm_cpu::load_row(u + i0, uf, n);
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) gf[i] = gf[i] / (1.f + exp_silu(-gf[i]));
          // silu(gate) rounded to bfloat16 and back (nearest even, on the bits: vectorizes, where
          // c10::BFloat16's conversions kept these loops scalar), times up; store_row rounds again
          uint32_t* gb = reinterpret_cast<uint32_t*>(gf);
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) gb[i] = (gb[i] + 0x7FFFu + ((gb[i] >> 16) & 1u)) & 0xFFFF0000u;
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) gf[i] *= uf[i];
          pagedllm_cpu::store_row(gf, o + i0, n);
        }
      }
    });
    return out;
  }
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, pagedllm_cpu::row_grain(2 * I), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + exp_silu(-g[i])) * u[i];
    }
  });
  return out;
}
