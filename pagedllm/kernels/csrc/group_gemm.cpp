// GEMM with group-quantized weights, dequantized in registers (CPU; AVX2 + FMA + F16C where built,
// portable C++ otherwise). One layout serves every weight format pagedllm keeps quantized
// (pagedllm/quantization/group_quant.py builds it):
//
//   w[n, k] = scales[n, k / group] * code(n, k) (+ mins[n, k / group])
//
// kind 0 (int4):  qweight uint8 [N, K/2]; within each chunk of 32 k, byte 16 c + j holds
//                 code(32 c + j) in its low nibble and code(32 c + 16 + j) in its high nibble
//                 (unsigned 0..15), as llama.cpp's Q4_0/Q4_1/Q4_K store their nibbles.
// kind 1 (int8):  qweight int8 [N, K], signed codes.
// kind 2 (fp8):   qweight uint8 [N, K], float8_e4m3fn codes (decoded exactly through the fp16
//                 conversion: (sign << 15 | (code & 0x7F) << 7) is the same value times 2^-8).
//
// scales, mins: float32 or float16 [N, G] (float16 widened per call), G = ceil(K / group); group a multiple of 16; K a multiple of 32.
//
//   group_gemm(x [M, K] f32/bf16, qweight, scales, mins?, bias? [N], kind, group, large_m, out_dtype)
//       -> [M, N] in out_dtype (float32 or bfloat16)
//
// M <= large_m: each output row n is computed for all M rows of x from one pass over the row's
// codes (dequantized 32 at a time into registers, float32 FMA against up to 4 rows of x at once;
// for M > 4 the row is dequantized once into an L1-resident buffer that every 4-row tile reads):
// the weight is read from memory once per call, in its packed size. M > large_m (prefill): tiles
// of rows are dequantized into a float buffer and multiplied by ATen's GEMM (at::mm); in bf16 the
// rows go in chunks of 256, the last padded to a multiple of 16 (a bounded set of GEMM shapes for
// oneDNN's per-shape kernel cache).
//
//   group_dequantize(qweight, scales, mins?, kind, group, K, row0, row1, dtype) -> [row1 - row0, K]
#include "torch_lite.h"
#include "cpu_utils.h"
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLLM_GQ_AVX2 1
#endif

namespace {

enum Kind : int64_t { kInt4 = 0, kInt8 = 1, kFp8 = 2 };

// float8_e4m3fn code -> float (portable path; NaN codes are not expected in weights).
inline float fp8_e4m3_to_float(uint8_t c) {
  const uint16_t h = static_cast<uint16_t>(((c & 0x80) << 8) | ((c & 0x7F) << 7));
  return static_cast<float>(c10::Half(h, c10::Half::from_bits())) * 256.f;
}

// The 32 codes of chunk c of row `row` as floats (unscaled), portable path.
inline void decode_chunk(const uint8_t* row, int64_t kind, int64_t c, float* out) {
  if (kind == kInt4) {
    const uint8_t* b = row + 16 * c;
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(b[j] & 0x0F);
      out[16 + j] = static_cast<float>(b[j] >> 4);
    }
  } else if (kind == kInt8) {
    const int8_t* b = reinterpret_cast<const int8_t*>(row) + 32 * c;
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(b[j]);
  } else {
    const uint8_t* b = row + 32 * c;
    for (int j = 0; j < 32; ++j) out[j] = fp8_e4m3_to_float(b[j]);
  }
}

inline int64_t row_bytes(int64_t kind, int64_t K) { return kind == kInt4 ? K / 2 : K; }

#ifdef PAGEDLLM_GQ_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 u8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// 8 fp8 codes (low 8 bytes of v) -> floats / 256.
inline __m256 fp8_to_ps(__m128i v) {
  const __m128i w = _mm_cvtepu8_epi16(v);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
  return _mm256_cvtph_ps(_mm_or_si128(sign, mag));
}

// 32 one-byte codes at p into 4 vectors of 8 (k 0-7, 8-15, 16-23, 24-31) through cvt (8 codes ->
// 8 floats).
template <typename Cvt>
inline void decode_bytes32(const uint8_t* p, Cvt cvt, __m256 v[4]) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  v[0] = cvt(a);
  v[1] = cvt(_mm_srli_si128(a, 8));
  v[2] = cvt(b);
  v[3] = cvt(_mm_srli_si128(b, 8));
}

// Decode the 32 codes of chunk c into 4 vectors (k 0-7, 8-15, 16-23, 24-31), unscaled (fp8: / 256).
inline void decode_chunk_avx2(const uint8_t* row, int64_t kind, int64_t c, __m256 v[4]) {
  if (kind == kInt4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, m);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    v[0] = u8_to_ps(lo);
    v[1] = u8_to_ps(_mm_srli_si128(lo, 8));
    v[2] = u8_to_ps(hi);
    v[3] = u8_to_ps(_mm_srli_si128(hi, 8));
  } else if (kind == kInt8) {
    decode_bytes32(row + 32 * c, i8_to_ps, v);
  } else {
    decode_bytes32(row + 32 * c, fp8_to_ps, v);
  }
}

// acc[r] (r < MT) = sum over k of x[r, k] * w[n, k] for one weight row, x rows at xs[r] (float32).
template <int MT>
inline void row_dot_avx2(const uint8_t* row, const float* sc, const float* mn, int64_t kind, const int32_t* gidx,
                         int64_t K, const float* const* xs, float* out) {
  __m256 acc[MT][2];
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float fscale = kind == kFp8 ? 256.f : 1.f;
  const int64_t nchunks = K / 32;
  for (int64_t c = 0; c < nchunks; ++c) {
    __m256 v[4];
    decode_chunk_avx2(row, kind, c, v);
    const int64_t k0 = 32 * c;
    const __m256 s0 = _mm256_set1_ps(sc[gidx[2 * c]] * fscale);
    const __m256 s1 = _mm256_set1_ps(sc[gidx[2 * c + 1]] * fscale);
    if (mn != nullptr) {
      const __m256 m0 = _mm256_set1_ps(mn[gidx[2 * c]]);
      const __m256 m1 = _mm256_set1_ps(mn[gidx[2 * c + 1]]);
      v[0] = _mm256_fmadd_ps(v[0], s0, m0);
      v[1] = _mm256_fmadd_ps(v[1], s0, m0);
      v[2] = _mm256_fmadd_ps(v[2], s1, m1);
      v[3] = _mm256_fmadd_ps(v[3], s1, m1);
    } else {
      v[0] = _mm256_mul_ps(v[0], s0);
      v[1] = _mm256_mul_ps(v[1], s0);
      v[2] = _mm256_mul_ps(v[2], s1);
      v[3] = _mm256_mul_ps(v[3], s1);
    }
    for (int r = 0; r < MT; ++r) {
      const float* x = xs[r] + k0;
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x), v[0], acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), v[1], acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), v[2], acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), v[3], acc[r][1]);
    }
  }
  for (int r = 0; r < MT; ++r) out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// One weight row dequantized into w[0..K) (float32, scale applied, min added).
inline void dequant_row_avx2(const uint8_t* row, const float* sc, const float* mn, int64_t kind, const int32_t* gidx,
                             int64_t K, float* w) {
  const float fscale = kind == kFp8 ? 256.f : 1.f;
  for (int64_t c = 0; c < K / 32; ++c) {
    __m256 v[4];
    decode_chunk_avx2(row, kind, c, v);
    const int64_t k0 = 32 * c;
    const __m256 s0 = _mm256_set1_ps(sc[gidx[2 * c]] * fscale);
    const __m256 s1 = _mm256_set1_ps(sc[gidx[2 * c + 1]] * fscale);
    const __m256 m0 = _mm256_set1_ps(mn ? mn[gidx[2 * c]] : 0.f);
    const __m256 m1 = _mm256_set1_ps(mn ? mn[gidx[2 * c + 1]] : 0.f);
    _mm256_storeu_ps(w + k0, _mm256_fmadd_ps(v[0], s0, m0));
    _mm256_storeu_ps(w + k0 + 8, _mm256_fmadd_ps(v[1], s0, m0));
    _mm256_storeu_ps(w + k0 + 16, _mm256_fmadd_ps(v[2], s1, m1));
    _mm256_storeu_ps(w + k0 + 24, _mm256_fmadd_ps(v[3], s1, m1));
  }
}

// out[r] = dot(x rows xs[r], w) for 4 rows at once over a dequantized weight row.
inline void dot4_avx2(const float* w, int64_t K, const float* const* xs, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xs[0] + k), w0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xs[1] + k), w0, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xs[2] + k), w0, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xs[3] + k), w0, a3);
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(xs[0] + k + 8), w1, b0);
    b1 = _mm256_fmadd_ps(_mm256_loadu_ps(xs[1] + k + 8), w1, b1);
    b2 = _mm256_fmadd_ps(_mm256_loadu_ps(xs[2] + k + 8), w1, b2);
    b3 = _mm256_fmadd_ps(_mm256_loadu_ps(xs[3] + k + 8), w1, b3);
  }
  out[0] = hsum(_mm256_add_ps(a0, b0));
  out[1] = hsum(_mm256_add_ps(a1, b1));
  out[2] = hsum(_mm256_add_ps(a2, b2));
  out[3] = hsum(_mm256_add_ps(a3, b3));
}
#endif

// Portable version of row_dot_avx2.
template <int MT>
inline void row_dot_ref(const uint8_t* row, const float* sc, const float* mn, int64_t kind, const int32_t* gidx,
                        int64_t K, const float* const* xs, float* out) {
  float acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = 0.f;
  float w[32];
  for (int64_t c = 0; c < K / 32; ++c) {
    decode_chunk(row, kind, c, w);
    const int64_t k0 = 32 * c;
    for (int j = 0; j < 32; ++j) {
      const int64_t g = gidx[2 * c + j / 16];
      w[j] = mn != nullptr ? w[j] * sc[g] + mn[g] : w[j] * sc[g];
    }
    for (int r = 0; r < MT; ++r) {
      const float* x = xs[r] + k0;
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += x[j] * w[j];
      acc[r] += s;
    }
  }
  for (int r = 0; r < MT; ++r) out[r] = acc[r];
}

template <int MT>
inline void row_dot(const uint8_t* row, const float* sc, const float* mn, int64_t kind, const int32_t* gidx, int64_t K,
                    const float* const* xs, float* out) {
#ifdef PAGEDLLM_GQ_AVX2
  row_dot_avx2<MT>(row, sc, mn, kind, gidx, K, xs, out);
#else
  row_dot_ref<MT>(row, sc, mn, kind, gidx, K, xs, out);
#endif
}

struct Operands {
  const uint8_t* q;
  const float* scales;
  const float* mins;  // nullptr when none
  int64_t kind, group, K, G;
  const int32_t* gidx;  // group of each run of 16 k (group_table)
};

// The group of each run of 16 k: one table lookup instead of an integer division per chunk.
std::vector<int32_t> group_table(int64_t K, int64_t group) {
  std::vector<int32_t> t(K / 16);
  for (int64_t h = 0; h < K / 16; ++h) t[h] = static_cast<int32_t>(16 * h / group);
  return t;
}

void check_operands(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                    int64_t kind, int64_t group, int64_t K) {
  TORCH_CHECK(kind == kInt4 || kind == kInt8 || kind == kFp8, "kind must be 0 (int4), 1 (int8) or 2 (fp8)");
  TORCH_CHECK(K > 0 && K % 32 == 0, "K must be a positive multiple of 32");
  TORCH_CHECK(group > 0 && group % 16 == 0, "group must be a positive multiple of 16");
  pagedllm_cpu::check_group_weights(qweight, scales, mins, row_bytes(kind, K), K, group);
}

// Dequantize rows [r0, r1) into dst (float32 or bf16, row stride K).
template <typename T>
void dequant_rows(const Operands& o, int64_t r0, int64_t r1, T* dst) {
  const int64_t rb = row_bytes(o.kind, o.K);
  at::parallel_for(r0, r1, std::max<int64_t>(1, 16384 / o.K), [&](int64_t a, int64_t b) {
    std::vector<float> buf(o.K);
    const int32_t* gidx = o.gidx;
    for (int64_t n = a; n < b; ++n) {
      const uint8_t* row = o.q + n * rb;
      const float* sc = o.scales + n * o.G;
      const float* mn = o.mins ? o.mins + n * o.G : nullptr;
      T* out = dst + (n - r0) * o.K;
      float* w = std::is_same<T, float>::value ? reinterpret_cast<float*>(out) : buf.data();
#ifdef PAGEDLLM_GQ_AVX2
      dequant_row_avx2(row, sc, mn, o.kind, gidx, o.K, w);
#else
      for (int64_t c = 0; c < o.K / 32; ++c) {
        decode_chunk(row, o.kind, c, w + 32 * c);
        for (int j = 0; j < 32; ++j) {
          const int64_t g = gidx[2 * c + j / 16];
          const float v = w[32 * c + j] * sc[g];
          w[32 * c + j] = mn ? v + mn[g] : v;
        }
      }
#endif
      if (!std::is_same<T, float>::value) {
        for (int64_t k = 0; k < o.K; ++k) out[k] = static_cast<T>(w[k]);
      }
    }
  });
}

// float16 scales / mins (GGUF's own fields): widened to float32 for this call (exact), so the
// dequantization below reads float32 as before and every result keeps its bits.
void widen_scales(at::Tensor& scales, c10::optional<at::Tensor>& mins) {
  if (scales.scalar_type() != at::kHalf) return;
  scales = scales.to(at::kFloat);
  if (mins.has_value()) mins = mins->to(at::kFloat);
}

}  // namespace

at::Tensor group_dequantize(at::Tensor qweight, at::Tensor scales, c10::optional<at::Tensor> mins, int64_t kind,
                            int64_t group, int64_t K, int64_t row0, int64_t row1, at::ScalarType dtype) {
  check_operands(qweight, scales, mins, kind, group, K);
  widen_scales(scales, mins);
  TORCH_CHECK(0 <= row0 && row0 <= row1 && row1 <= qweight.size(0), "bad row range");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  const std::vector<int32_t> table = group_table(K, group);
  Operands o{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
             mins.has_value() ? mins->data_ptr<float>() : nullptr, kind, group, K, scales.size(1), table.data()};
  at::Tensor out = at::empty({row1 - row0, K}, qweight.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequant_rows<float>(o, row0, row1, out.data_ptr<float>());
  } else {
    dequant_rows<at::BFloat16>(o, row0, row1, out.data_ptr<at::BFloat16>());
  }
  return out;
}

at::Tensor group_gemm(at::Tensor x, at::Tensor qweight, at::Tensor scales, c10::optional<at::Tensor> mins,
                      c10::optional<at::Tensor> bias, int64_t kind, int64_t group, int64_t large_m,
                      at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  check_operands(qweight, scales, mins, kind, group, K);
  widen_scales(scales, mins);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  const int64_t N = qweight.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must be [N]");
  }
  const std::vector<int32_t> table = group_table(K, group);
  const int32_t* gidx = table.data();
  Operands o{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
             mins.has_value() ? mins->data_ptr<float>() : nullptr, kind, group, K, scales.size(1), gidx};
  if (M == 0) return at::empty({0, N}, x.options().dtype(out_dtype));

  if (M > large_m) {
    // Prefill: dequantize tiles of rows (<= ~8 MB each) and let ATen's GEMM run them.
    const auto cdt = x.scalar_type();
    at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({M, N}, x.options().dtype(out_dtype));
    const int64_t elt = cdt == at::kFloat ? 4 : 2;
    int64_t tile = std::max<int64_t>(64, (8 << 20) / (K * elt));
    tile = std::min<int64_t>(N, tile / 64 * 64);
    at::Tensor buf = at::empty({tile, K}, x.options().dtype(cdt));
    for (int64_t n0 = 0; n0 < N; n0 += tile) {
      const int64_t n1 = std::min(N, n0 + tile);
      at::Tensor w = buf.narrow(0, 0, n1 - n0);
      if (cdt == at::kFloat) {
        dequant_rows<float>(o, n0, n1, w.data_ptr<float>());
      } else {
        dequant_rows<at::BFloat16>(o, n0, n1, w.data_ptr<at::BFloat16>());
      }
      if (cdt == at::kFloat) {
        at::Tensor part = b.defined() ? at::addmm(b.narrow(0, n0, n1 - n0).to(cdt), xc, w.t()) : at::mm(xc, w.t());
        y.narrow(1, n0, n1 - n0).copy_(part);
        continue;
      }
      // bf16: oneDNN JIT-compiles and caches a kernel per GEMM shape (its primitive cache holds
      // 1,024), so every new prefill length grew the server's resident memory (~0.4 MiB per new
      // length: +177 MiB over a 240-request mixed soak). Rows go in chunks of kRowChunk with the
      // last one padded to a multiple of kRowPad: at most kRowChunk / kRowPad shapes per tile.
      constexpr int64_t kRowChunk = 256, kRowPad = 16;
      for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
        const int64_t m = std::min(kRowChunk, M - m0);
        const int64_t mp = (m + kRowPad - 1) / kRowPad * kRowPad;
        at::Tensor xs = xc.narrow(0, m0, m);
        if (mp != m) {
          at::Tensor xp = at::zeros({mp, K}, xc.options());
          xp.narrow(0, 0, m).copy_(xs);
          xs = xp;
        }
        at::Tensor part = b.defined() ? at::addmm(b.narrow(0, n0, n1 - n0).to(cdt), xs, w.t()) : at::mm(xs, w.t());
        y.narrow(0, m0, m).narrow(1, n0, n1 - n0).copy_(part.narrow(0, 0, m));
      }
    }
    return y;
  }

  // Decode-sized M: float32 rows of x, then each weight row once against all rows. NOTE: bf16 x is
  // widened here and bf16 outputs rounded in the loop (round-to-nearest-even, the same bits as
  // ATen's .to()), not by ATen copies: at decode sizes those cost more than the conversion itself
  // (two ops per projection and step, ~240 per SmolLM2 token).
  at::Tensor xc = x.contiguous();
  std::vector<float> xbuf;
  const float* xp;
  if (xc.scalar_type() == at::kFloat) {
    xp = xc.data_ptr<float>();
  } else {
    xbuf.resize(M * K);
    const uint16_t* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < M * K; ++i) {  // bfloat16 -> float32 is exact: the high half of the bits
      const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&xbuf[i], &u, 4);
    }
    xp = xbuf.data();
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_dtype));
  float* yp = out_dtype == at::kFloat ? y.data_ptr<float>() : nullptr;
  at::BFloat16* yb = out_dtype == at::kFloat ? nullptr : y.data_ptr<at::BFloat16>();
  auto store = [&](int64_t i, float v) {
    if (yp) {
      yp[i] = v;
    } else {
      yb[i] = static_cast<at::BFloat16>(v);
    }
  };
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t rb = row_bytes(kind, K);
  // NOTE: grain ~64 KB of weight bytes per task: smaller tasks cost more to wake than they save.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / rb);
  at::parallel_for(0, N, grain, [&](int64_t a, int64_t e) {
    const float* xs[4];
    float out[4];
    std::vector<float> wbuf(M > 4 ? K : 0);
    for (int64_t n = a; n < e; ++n) {
      const uint8_t* row = o.q + n * rb;
      const float* sc = o.scales + n * o.G;
      const float* mn = o.mins ? o.mins + n * o.G : nullptr;
      const float bn = bp ? bp[n] : 0.f;
      int64_t m = 0;
#ifdef PAGEDLLM_GQ_AVX2
      if (M > 4) {
        // NOTE: more than one 4-row tile: dequantize the row once (L1-resident) instead of per tile
        dequant_row_avx2(row, sc, mn, kind, gidx, K, wbuf.data());
        for (; m + 4 <= M; m += 4) {
          for (int r = 0; r < 4; ++r) xs[r] = xp + (m + r) * K;
          dot4_avx2(wbuf.data(), K, xs, out);
          for (int r = 0; r < 4; ++r) store((m + r) * N + n, out[r] + bn);
        }
      }
#endif
      for (; m + 4 <= M; m += 4) {
        for (int r = 0; r < 4; ++r) xs[r] = xp + (m + r) * K;
        row_dot<4>(row, sc, mn, kind, gidx, K, xs, out);
        for (int r = 0; r < 4; ++r) store((m + r) * N + n, out[r] + bn);
      }
      const int64_t rest = M - m;
      for (int r = 0; r < rest; ++r) xs[r] = xp + (m + r) * K;
      if (rest == 3) row_dot<3>(row, sc, mn, kind, gidx, K, xs, out);
      if (rest == 2) row_dot<2>(row, sc, mn, kind, gidx, K, xs, out);
      if (rest == 1) row_dot<1>(row, sc, mn, kind, gidx, K, xs, out);
      for (int r = 0; r < rest; ++r) store((m + r) * N + n, out[r] + bn);
    }
  });
  return y;
}

bool group_gemm_avx2() {
#ifdef PAGEDLLM_GQ_AVX2
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("group_gemm", &group_gemm, "x @ dequant(group-quantized w).T (+ bias)", py::call_guard<py::gil_scoped_release>(),
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("kind"),
        py::arg("group"), py::arg("large_m"), py::arg("out_dtype"));
  m.def("group_dequantize", &group_dequantize, "dequantize rows of a group-quantized weight",
        py::call_guard<py::gil_scoped_release>(), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
        py::arg("kind"), py::arg("group"), py::arg("K"), py::arg("row0"), py::arg("row1"), py::arg("dtype"));
  m.def("group_gemm_avx2", &group_gemm_avx2, "whether the AVX2/FMA/F16C path was built");
  // NOTE: for the fused decode step (fused_decode.cpp, another module): the same function, called there
  m.def("group_gemm_fn", []() { return reinterpret_cast<int64_t>(&group_gemm); }, "group_gemm's address");
}
