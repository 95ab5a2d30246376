// Integer-dot GEMM for decode-sized M on the group layout's int4 / int8 kinds with groups of 32
// (GGUF Q4_0, Q4_1, Q4_K, Q8_0, Q5_0, Q5_1, Q5_K; see pagedllm/quantization/group_quant.py):
// activations are quantized to int8 per block of 32 k, each block's inner product is an exact
// int32, and block scales are applied in float -- the scheme of llama.cpp's Q8_1 activations and
// its ggml_vec_dot_q4_1_q8_1 / ggml_vec_dot_q8_0_q8_0 (facts of the formulas, not its code).
//
// Weight (group layout, unchanged):  w[n, k] = d[n, g(k)] * q[n, k] (+ m[n, g(k)]),  g(k) = k / group,
//   kind 0 (int4): qweight uint8 [N, K/2], chunk c of 32 k in bytes 16c..16c+15, byte 16c+j holding
//                  q(32c+j) in its low nibble and q(32c+16+j) in its high nibble (codes 0..15);
//   kind 1 (int8): qweight int8 [N, K], signed codes;
//   d, m: float32 [N, ceil(K / group)], group a multiple of 32, K a multiple of 32.
//
// Activations, once per call (intdot_quantize): for row r and block b (32 k),
//   xd[r, b] = max_k |x[r, k]| / 127            (float32 division)
//   a[r, k]  = round_half_even(x[r, k] * (1 / xd[r, b]))  in -127..127 (0 when xd = 0)
//   xs[r, b] = xd[r, b] * sum_k a[r, k]         (Q8_1's "s" field, kept in float32 here)
//
// Output: y[r, n] = sum over blocks b, in increasing b, of
//     d[n, g] * xd[r, b] * sum_{k in b} q[n, k] a[r, k]   (int32, exact)
//   + sum over blocks b, in increasing b, of m[n, g] * xs[r, b]        (when mins are given)
//   + bias[n]
// since sum_k (d q_k + m) xd a_k = d xd sum_k q_k a_k + m xd sum_k a_k.
//
// Fixed arithmetic (batch invariance by construction): the int32 sum of each block is kept as 8
// lanes of 4 consecutive k (lane i: k = 4i..4i+3, exact); per lane, two accumulators (even and
// odd blocks) acc[b % 2]_i = fma(float(lane_i), d * xd, acc[b % 2]_i) over b in increasing
// order, then acc_i = acc[0]_i + acc[1]_i; the min term runs in 8 lanes too (lane j: blocks
// j, j + 8, ..., macc_j = fma(m, xs, macc_j)); each 8-lane sum is ((l0+l4)+(l2+l6)) +
// ((l1+l5)+(l3+l7)); y = sum(acc) + sum(macc) + bias. Every ISA path does exactly these float
// operations (the build uses -ffp-contract=off), so a row's result depends neither on M, on which
// rows share the call, on the tiling or thread split over N, nor on the ISA path.
//
// Tiling: rows of x in tiles of up to 4, each column's codes unpacked once per tile (the even /
// odd accumulators give M = 1 two independent fma chains). NOTE: tiles of several weight rows
// (interleaved column streams) ran 1.5-2.5x slower once 576-byte rows came from DRAM (int8 LM
// head), so columns run one at a time. Threads split the output columns (at::parallel_for).
//
// ISA paths, chosen at run time (__builtin_cpu_supports) from one build without -march flags:
//   0 portable C++; 1 AVX2 (+FMA): vpmaddubsw + vpmaddwd; 2 AVX512-VNNI (+VL/BW): vpdpbusd on
//   256-bit vectors. u8 x s8 products: int4 codes are unsigned already; int8 codes use
//   |q| x sign(a, q) (pairs stay below 2 * 128 * 127 < 2^15, so vpmaddubsw cannot saturate).
//
//   intdot_gemm(x [M, K] f32/bf16, qweight, scales, mins?, bias? [N], kind, group, out_dtype, isa=-1)
//       -> [M, N] out_dtype (float32 / bfloat16); isa -1 = best available.
//   intdot_quantize(x, isa=-1) -> (a int8 [M, K], xd f32 [M, K/32], xs f32 [M, K/32])
//   intdot_isa_supported(isa) -> bool; intdot_best_isa() -> int; intdot_isa_name(isa) -> str
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define PAGEDLLM_ID_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kVnni = 2 };
enum Kind : int64_t { kInt4 = 0, kInt8 = 1 };

// One call's operands, shared by the ISA paths.
struct Ctx {
  const uint8_t* q;     // weight codes, row stride rb bytes
  const float* wd;      // [N, nb]: the scale of each 32-block (groups > 32 expanded)
  const float* wm;      // [N, nb] or nullptr
  int64_t rb, nb, nbp, N, M;
  const int8_t* a;   // [M, K]
  const float* xd;   // [M, nbp], zero past nb
  const float* xs;   // [M, nbp], zero past nb
  const float* bias; // [N] or nullptr
  float* y;          // [M, N]
};

// Columns [n0, n1) for all M rows: per column, tiles of up to 4 rows of x (the column's codes
// unpacked once per tile, from L1 after the first).
template <template <int, bool, bool> class T, bool INT4, bool MINS>
void run_range(const Ctx& c, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= c.M; m += 4) T<4, INT4, MINS>::go(c, n, m);
    switch (c.M - m) {
      case 3: T<3, INT4, MINS>::go(c, n, m); break;
      case 2: T<2, INT4, MINS>::go(c, n, m); break;
      case 1: T<1, INT4, MINS>::go(c, n, m); break;
      default: break;
    }
  }
}

template <template <int, bool, bool> class T>
void dispatch_range(const Ctx& c, bool int4, int64_t n0, int64_t n1) {
  if (int4) {
    c.wm ? run_range<T, true, true>(c, n0, n1) : run_range<T, true, false>(c, n0, n1);
  } else {
    c.wm ? run_range<T, false, true>(c, n0, n1) : run_range<T, false, false>(c, n0, n1);
  }
}

// ---------------------------------------------------------------------------------- portable
void quantize_rows_ref(const float* x, int64_t M, int64_t K, int64_t nbp, int8_t* a, float* xd, float* xs) {
  const int64_t nb = K / QK;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * K + b * QK;
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int j = 0; j < QK; ++j) {
        const int32_t c = static_cast<int32_t>(std::nearbyint(v[j] * id));
        a[r * K + b * QK + j] = static_cast<int8_t>(c);
        sum += c;
      }
      xd[r * nbp + b] = d;
      xs[r * nbp + b] = d * static_cast<float>(sum);
    }
  }
}

inline float hsum8_ref(const float* l) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }

// One column n, rows [m0, m0 + MT): the arithmetic every path reproduces (file comment).
template <int MT, bool INT4, bool MINS>
void tile_ref(const Ctx& c, int64_t n, int64_t m0) {
  const uint8_t* row = c.q + n * c.rb;
  const float* wd = c.wd + n * c.nb;
  const float* wm = MINS ? c.wm + n * c.nb : nullptr;
  const int64_t K = c.nb * QK;
  float acc[MT][2][8], macc[MT][8];
  for (int r = 0; r < MT; ++r) {
    for (int i = 0; i < 8; ++i) acc[r][0][i] = acc[r][1][i] = macc[r][i] = 0.f;
  }
  int32_t w[QK];
  for (int64_t b = 0; b < c.nb; ++b) {
    if (INT4) {
      const uint8_t* p = row + 16 * b;
      for (int j = 0; j < 16; ++j) {
        w[j] = p[j] & 0x0F;
        w[16 + j] = p[j] >> 4;
      }
    } else {
      const int8_t* p = reinterpret_cast<const int8_t*>(row) + QK * b;
      for (int j = 0; j < QK; ++j) w[j] = p[j];
    }
    for (int r = 0; r < MT; ++r) {
      const int8_t* av = c.a + (m0 + r) * K + b * QK;
      const float s = wd[b] * c.xd[(m0 + r) * c.nbp + b];
      for (int i = 0; i < 8; ++i) {
        int32_t l = 0;
        for (int j = 0; j < 4; ++j) l += w[4 * i + j] * av[4 * i + j];
        acc[r][b & 1][i] = std::fma(static_cast<float>(l), s, acc[r][b & 1][i]);
      }
    }
  }
  if (MINS) {  // lane j holds blocks j, j + 8, ... (the padding past nb adds 0 * 0)
    for (int64_t b = 0; b < c.nbp; ++b) {
      const float mv = b < c.nb ? wm[b] : 0.f;
      for (int r = 0; r < MT; ++r) macc[r][b % 8] = std::fma(mv, c.xs[(m0 + r) * c.nbp + b], macc[r][b % 8]);
    }
  }
  for (int r = 0; r < MT; ++r) {
    float l[8];
    for (int i = 0; i < 8; ++i) l[i] = acc[r][0][i] + acc[r][1][i];
    float v = hsum8_ref(l);
    if (MINS) v += hsum8_ref(macc[r]);
    if (c.bias) v += c.bias[n];
    c.y[(m0 + r) * c.N + n] = v;
  }
}

template <int MT, bool INT4, bool MINS>
struct TileRef {
  static void go(const Ctx& c, int64_t n, int64_t m) { tile_ref<MT, INT4, MINS>(c, n, m); }
};

void range_ref(const Ctx& c, bool int4, int64_t n0, int64_t n1) { dispatch_range<TileRef>(c, int4, n0, n1); }

// ---------------------------------------------------------------------------------- AVX2 / VNNI
#ifdef PAGEDLLM_ID_X86
// One column n x MT rows, for one ISA (PRODUCT(u8 x 32, s8 x 32) -> 8 int32 lanes of 4
// consecutive products each). Per chunk of 8 blocks: the scale products d * xd of every (row,
// block) go to a small stack array (read back as broadcasts) and the min term advances one vector
// fma; per block: the codes are unpacked once for all MT rows, and even / odd blocks feed two
// accumulators (two independent fma chains even at M = 1).
#define PAGEDLLM_ID_TILE(NAME, PRODUCT, HSUM)                                                                   \
  template <int MT, bool INT4, bool MINS>                                                                      \
  void NAME(const Ctx& c, int64_t n, int64_t m0) {                                                             \
    const int64_t K = c.nb * QK;                                                                               \
    const uint8_t* row = c.q + n * c.rb;                                                                       \
    const float* wd = c.wd + n * c.nb;                                                                         \
    const float* wm = MINS ? c.wm + n * c.nb : nullptr;                                                        \
    const int8_t* ap[MT];                                                                                      \
    const float* xdp[MT];                                                                                      \
    const float* xsp[MT];                                                                                      \
    __m256 acc[MT][2], macc[MT];                                                                               \
    for (int r = 0; r < MT; ++r) {                                                                             \
      ap[r] = c.a + (m0 + r) * K;                                                                              \
      xdp[r] = c.xd + (m0 + r) * c.nbp;                                                                        \
      xsp[r] = c.xs + (m0 + r) * c.nbp;                                                                        \
      acc[r][0] = acc[r][1] = macc[r] = _mm256_setzero_ps();                                                   \
    }                                                                                                          \
    alignas(32) float sc[MT][8];                                                                               \
    const __m128i lo4 = _mm_set1_epi8(0x0F);                                                                   \
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                            \
    for (int64_t b0 = 0; b0 < c.nb; b0 += 8) {                                                                 \
      const int nbc = static_cast<int>(std::min<int64_t>(8, c.nb - b0));                                       \
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nbc), lane);                                   \
      const __m256 wdv = _mm256_maskload_ps(wd + b0, mask);                                                    \
      const __m256 wmv = MINS ? _mm256_maskload_ps(wm + b0, mask) : _mm256_setzero_ps();                       \
      for (int r = 0; r < MT; ++r) {                                                                           \
        _mm256_store_ps(sc[r], _mm256_mul_ps(wdv, _mm256_loadu_ps(xdp[r] + b0)));                              \
        if (MINS) macc[r] = _mm256_fmadd_ps(wmv, _mm256_loadu_ps(xsp[r] + b0), macc[r]);                      \
      }                                                                                                        \
      for (int j = 0; j < nbc; ++j) {                                                                          \
        const int64_t b = b0 + j;                                                                              \
        __m256i w, wu;                                                                                         \
        if (INT4) {                                                                                            \
          const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));                   \
          w = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(p, lo4)),                           \
                                      _mm_and_si128(_mm_srli_epi16(p, 4), lo4), 1);                            \
          wu = w;                                                                                              \
        } else {                                                                                               \
          w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + QK * b));                              \
          wu = _mm256_abs_epi8(w);                                                                             \
        }                                                                                                      \
        for (int r = 0; r < MT; ++r) {                                                                         \
          const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ap[r] + QK * b));             \
          const __m256i l = PRODUCT(wu, INT4 ? av : _mm256_sign_epi8(av, w));                                  \
          acc[r][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), _mm256_broadcast_ss(&sc[r][j]), acc[r][j & 1]); \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
    for (int r = 0; r < MT; ++r) {                                                                             \
      float v = HSUM(_mm256_add_ps(acc[r][0], acc[r][1]));                                                     \
      if (MINS) v += HSUM(macc[r]);                                                                            \
      if (c.bias) v += c.bias[n];                                                                              \
      c.y[(m0 + r) * c.N + n] = v;                                                                             \
    }                                                                                                          \
  }

#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline float hsum8_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l_i + l_{i+4}
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                         // (0+4)+(2+6), (1+5)+(3+7)
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// AVX2 quantizer: the same float operations as quantize_rows_ref (vcvtps2dq rounds half to even
// under the default MXCSR, as nearbyint does under the default rounding mode).
void quantize_rows_avx2(const float* x, int64_t M, int64_t K, int64_t nbp, int8_t* a, float* xd, float* xs) {
  const int64_t nb = K / QK;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * K + b * QK;
      __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
             v3 = _mm256_loadu_ps(v + 24);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      const __m256 vid = _mm256_set1_ps(id);
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid));
      const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
      const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid));
      const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
      const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      // int32 -> int8 (values in -127..127, no saturation); packs interleave 128-bit lanes, the
      // permute puts the 32 codes back in k order
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + r * K + b * QK), _mm256_permutevar8x32_epi32(p, perm));
      xd[r * nbp + b] = d;
      xs[r * nbp + b] = d * static_cast<float>(_mm_cvtsi128_si32(s));
    }
  }
}

#define PAGEDLLM_ID_AVX2_PRODUCT(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
PAGEDLLM_ID_TILE(tile_avx2, PAGEDLLM_ID_AVX2_PRODUCT, hsum8_avx2)

template <int MT, bool INT4, bool MINS>
struct TileAvx2 {
  static void go(const Ctx& c, int64_t n, int64_t m) { tile_avx2<MT, INT4, MINS>(c, n, m); }
};

void range_avx2(const Ctx& c, bool int4, int64_t n0, int64_t n1) { dispatch_range<TileAvx2>(c, int4, n0, n1); }

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")

inline float hsum8_vnni(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#define PAGEDLLM_ID_VNNI_PRODUCT(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
PAGEDLLM_ID_TILE(tile_vnni, PAGEDLLM_ID_VNNI_PRODUCT, hsum8_vnni)

template <int MT, bool INT4, bool MINS>
struct TileVnni {
  static void go(const Ctx& c, int64_t n, int64_t m) { tile_vnni<MT, INT4, MINS>(c, n, m); }
};

void range_vnni(const Ctx& c, bool int4, int64_t n0, int64_t n1) { dispatch_range<TileVnni>(c, int4, n0, n1); }

#pragma GCC pop_options
#endif  // PAGEDLLM_ID_X86

bool isa_supported(int64_t isa) {
  if (isa == kPortable) return true;
#ifdef PAGEDLLM_ID_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == kAvx2) return avx2;
  if (isa == kVnni)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

int64_t best_isa() {
  static const int64_t best = isa_supported(kVnni) ? kVnni : isa_supported(kAvx2) ? kAvx2 : kPortable;
  return best;
}

int64_t resolve_isa(int64_t isa) {
  if (isa < 0) return best_isa();
  TORCH_CHECK(isa <= kVnni, "isa must be -1 (best), 0 (portable), 1 (avx2) or 2 (avx512vnni)");
  TORCH_CHECK(isa_supported(isa), "intdot: ISA path ", isa, " is not supported by this CPU");
  return isa;
}

// a [M, K]; xd, xs [M, nbp] (the caller zeroes them past K / 32).
void quantize_rows(int64_t isa, const float* x, int64_t M, int64_t K, int64_t nbp, int8_t* a, float* xd, float* xs) {
#ifdef PAGEDLLM_ID_X86
  if (isa >= kAvx2) return quantize_rows_avx2(x, M, K, nbp, a, xd, xs);
#endif
  quantize_rows_ref(x, M, K, nbp, a, xd, xs);
}

inline int64_t padded_blocks(int64_t nb) { return (nb + 7) / 8 * 8; }

at::Tensor as_float_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(x.size(1) % QK == 0, "K must be a multiple of 32");
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> intdot_quantize(at::Tensor x, int64_t isa) {
  isa = resolve_isa(isa);
  const at::Tensor xf = as_float_rows(x);
  const int64_t M = xf.size(0), K = xf.size(1);
  at::Tensor a = at::empty({M, K}, xf.options().dtype(at::kChar));
  at::Tensor xd = at::empty({M, K / QK}, xf.options());
  at::Tensor xs = at::empty({M, K / QK}, xf.options());
  quantize_rows(isa, xf.data_ptr<float>(), M, K, K / QK, a.data_ptr<int8_t>(), xd.data_ptr<float>(),
                xs.data_ptr<float>());
  return {a, xd, xs};
}

at::Tensor intdot_gemm(at::Tensor x, at::Tensor qweight, at::Tensor scales, c10::optional<at::Tensor> mins,
                       c10::optional<at::Tensor> bias, int64_t kind, int64_t group, at::ScalarType out_dtype,
                       int64_t isa) {
  isa = resolve_isa(isa);
  const at::Tensor xf = as_float_rows(x);
  const int64_t M = xf.size(0), K = xf.size(1), nb = K / QK;
  TORCH_CHECK(K > 0, "K must be positive");
  TORCH_CHECK(kind == kInt4 || kind == kInt8, "intdot: kind must be 0 (int4) or 1 (int8)");
  TORCH_CHECK(group > 0 && group % QK == 0, "intdot: group must be a positive multiple of 32");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  const int64_t rb = kind == kInt4 ? K / 2 : K;
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1 && qweight.size(1) == rb,
              "qweight must be a contiguous byte tensor [N, K/2] (int4) or [N, K] (int8)");
  const int64_t N = qweight.size(0), G = (K + group - 1) / group;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == N && scales.size(1) == G, "scales must be float32 [N, ceil(K / group)]");
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "mins must be float32 like scales");
  }
  at::Tensor bf;
  if (bias.has_value()) {
    bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == N, "bias must be [N]");
  }
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0 || N == 0) return y.to(out_dtype);

  const int64_t nbp = padded_blocks(nb);
  at::Tensor a = at::empty({M, K}, xf.options().dtype(at::kChar));
  at::Tensor xd = at::zeros({M, nbp}, xf.options());
  at::Tensor xs = at::zeros({M, nbp}, xf.options());
  quantize_rows(isa, xf.data_ptr<float>(), M, K, nbp, a.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>());
  // groups wider than 32: one scale (and min) per 32-block, expanded for this call
  at::Tensor wd = scales, wm = mins.has_value() ? *mins : at::Tensor();
  if (group != QK) {
    wd = scales.repeat_interleave(group / QK, 1).narrow(1, 0, nb).contiguous();
    if (wm.defined()) wm = wm.repeat_interleave(group / QK, 1).narrow(1, 0, nb).contiguous();
  }

  Ctx c{static_cast<const uint8_t*>(qweight.data_ptr()), wd.data_ptr<float>(),
        wm.defined() ? wm.data_ptr<float>() : nullptr, rb, nb, nbp, N, M,
        a.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(),
        bf.defined() ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>()};
  void (*range)(const Ctx&, bool, int64_t, int64_t) = range_ref;
#ifdef PAGEDLLM_ID_X86
  if (isa == kAvx2) range = range_avx2;
  if (isa == kVnni) range = range_vnni;
#endif
  const bool int4 = kind == kInt4;
  // NOTE: grain ~64 KB of weight bytes per task (as group_gemm): smaller tasks cost more to wake than they save
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / rb);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { range(c, int4, n0, n1); });
  return out_dtype == at::kFloat ? y : y.to(out_dtype);
}

bool intdot_isa_supported(int64_t isa) { return isa >= 0 && isa <= kVnni && isa_supported(isa); }

int64_t intdot_best_isa() { return best_isa(); }

std::string intdot_isa_name(int64_t isa) {
  switch (isa) {
    case kPortable: return "portable";
    case kAvx2: return "avx2";
    case kVnni: return "avx512vnni";
    default: return "unknown";
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("intdot_gemm", &intdot_gemm, "x @ dequant(w).T via int8 activations and integer block dots",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("qweight"), py::arg("scales"),
        py::arg("mins"), py::arg("bias"), py::arg("kind"), py::arg("group"), py::arg("out_dtype"),
        py::arg("isa") = -1);
  m.def("intdot_quantize", &intdot_quantize, "per-32-block int8 quantization of x (codes, scales, scaled sums)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("isa") = -1);
  m.def("intdot_isa_supported", &intdot_isa_supported, "whether this CPU runs ISA path isa");
  m.def("intdot_best_isa", &intdot_best_isa, "the ISA path intdot_gemm takes by default");
  m.def("intdot_isa_name", &intdot_isa_name, "name of an ISA path");
}
