// Integer-dot GEMM (any M: decode and prefill) on the group layout's int4 / int8 kinds with groups of 32
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
// Tiling (none of it changes a row's float operations): row tiles of up to mr rows (8 on the
// AVX512-VNNI path, which has 32 vector registers for 2 x 8 accumulators; 4 on AVX2 / portable),
// each column's codes unpacked once per tile, even / odd accumulators (two independent fma chains
// at M = 1). On x86 the activation codes, xd and xs are repacked once per call into row tiles
// (block-major inside a tile) so one pointer walks a tile. Loop order: M <= 16 (decode): per
// column, all rows -- each weight row read once from memory. M > 16 (prefill): column panels of
// ~192 KB (codes + scales, L2), per panel row tiles outer and its columns inner, the tile's
// activations in L1. NOTE: tiles of several weight rows (interleaved column streams) ran
// 1.5-2.5x slower once 576-byte rows came from DRAM (int8 LM head), so a tile has one column.
// Threads split the output columns (at::parallel_for).
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
#include "torch_lite.h"
#include <torch/csrc/utils/pybind.h>
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
  const int8_t* a;   // [M, K] (portable path)
  // x86 paths: the activations packed in row tiles of mr rows (tile t: rows t mr .. t mr + h - 1,
  // h = min(mr, M - t mr)): codes of (row t mr + r, block b) at ap[t mr K + (b h + r) 32 ..],
  // xd at xdp[t mr nb + b h + r]; the codes offset by +128 (unsigned) for VNNI on int8 weights.
  const uint8_t* ap;
  const float* xdp;
  const float* xsp;  // xs packed like xdp but over nbp blocks (zero past nb)
  int64_t mr;
  const float* xd;   // [M, nbp], zero past nb
  const float* xs;   // [M, nbp], zero past nb
  const float* bias; // [N] or nullptr
  float* y;          // [M, N]
};

// Rows [m0, m1) of column n in tiles of up to MR rows (the remainder in tiles of 4, 2, 1 when
// MR = 8). Which tile a row lands in changes no float operation of that row (file comment).
template <template <int, bool, bool> class T, bool INT4, bool MINS, int MR>
inline void column_rows(const Ctx& c, int64_t n, int64_t m0, int64_t m1, float* scr) {
  int64_t m = m0;
  for (; m + MR <= m1; m += MR) T<MR, INT4, MINS>::go(c, n, m, scr);
  if (MR > 4 && m + 4 <= m1) {
    T<4, INT4, MINS>::go(c, n, m, scr);
    m += 4;
  }
  switch (m1 - m) {
    case 3: T<3, INT4, MINS>::go(c, n, m, scr); break;
    case 2: T<2, INT4, MINS>::go(c, n, m, scr); break;
    case 1: T<1, INT4, MINS>::go(c, n, m, scr); break;
    default: break;
  }
}

// Columns [n0, n1) for all M rows.
//   M <= kSmallM (decode): per column, all rows in tiles of 4 -- each weight row is read from
//     memory once, while the few activation rows stay in L1.
//   M > kSmallM (prefill): panels of columns whose codes and scales fit in ~kPanelBytes (L2);
//     per panel, row tiles of MR outer and the panel's columns inner, so the tile's MR * K int8
//     activations stay in L1 and the panel's weights in L2 (the decode order re-read all M
//     activation rows from L2 for every column, ~5 cycles per 32-k block product at M = 512).
// Both orders run the same tile functions, so every row gets the same float operations.
constexpr int64_t kSmallM = 16;
constexpr int64_t kPanelBytes = 192 << 10;

template <template <int, bool, bool> class T, bool INT4, bool MINS, int MR>
void run_range(const Ctx& c, int64_t n0, int64_t n1) {
  std::vector<float> scratch(MR * c.nbp);  // a tile's scale products (x86 tiles)
  float* scr = scratch.data();
  if (c.M <= kSmallM) {
    for (int64_t n = n0; n < n1; ++n) column_rows<T, INT4, MINS, MR>(c, n, 0, c.M, scr);
    return;
  }
  const int64_t col_bytes = c.rb + (MINS ? 8 : 4) * c.nb;
  const int64_t nc = std::max<int64_t>(1, kPanelBytes / col_bytes);
  for (int64_t p0 = n0; p0 < n1; p0 += nc) {
    const int64_t p1 = std::min(n1, p0 + nc);
    for (int64_t m = 0; m < c.M; m += MR) {
      const int64_t m1 = std::min(c.M, m + MR);
      for (int64_t n = p0; n < p1; ++n) column_rows<T, INT4, MINS, MR>(c, n, m, m1, scr);
    }
  }
}

// MR: the row tile of the prefill order (8 where the ISA has 32 vector registers for the 2 x 8
// accumulators and 8 min accumulators, else 4).
template <template <int, bool, bool> class T, int MR>
void dispatch_range(const Ctx& c, bool int4, int64_t n0, int64_t n1) {
  if (int4) {
    c.wm ? run_range<T, true, true, MR>(c, n0, n1) : run_range<T, true, false, MR>(c, n0, n1);
  } else {
    c.wm ? run_range<T, false, true, MR>(c, n0, n1) : run_range<T, false, false, MR>(c, n0, n1);
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
  static void go(const Ctx& c, int64_t n, int64_t m, float* scr) { tile_ref<MT, INT4, MINS>(c, n, m); }
};

void range_ref(const Ctx& c, bool int4, int64_t n0, int64_t n1) { dispatch_range<TileRef, 4>(c, int4, n0, n1); }

// ---------------------------------------------------------------------------------- AVX2 / VNNI
#ifdef PAGEDLLM_ID_X86
// One column n x MT rows, for one ISA. Phase 1: the scale products sc[r][b] = d[n, b] * xd[r, b]
// of the whole K go to the caller's scratch (8 at a time, one vector multiply). Phase 2: blocks in
// pairs -- the codes unpacked once for all MT rows, the even block into acc0, the odd into acc1
// (fixed names, so the 2 * MT accumulators stay in registers: indexing them by a run-time parity
// made GCC keep them in memory), each product's scale a broadcast folded into the fma. Phase 3,
// per row: the min term (lane j: blocks j, j + 8, ...), the 8-lane sums, the bias.
//   DOT4(w, av): 8 int32 lanes of 4 products, unsigned int4 codes x signed activations;
//   PREP8(w): the per-block operand of int8 codes; DOT8(w, wx, av): the same lanes for int8 codes
//   against the activations in ACT8 (c.a or, for VNNI, the offset codes c.au).
#define PAGEDLLM_ID_BLOCK(DOT4, PREP8, DOT8, B, ACC)                                                           \
  do {                                                                                                         \
    const uint8_t* ab = at + (B) * bs;                                                                         \
    const float* sb = scr + (B) * MT;                                                                          \
    if (INT4) {                                                                                                \
      const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * (B)));                     \
      const __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(p, lo4)),                 \
                                                _mm_and_si128(_mm_srli_epi16(p, 4), lo4), 1);                  \
      for (int r = 0; r < MT; ++r) {                                                                           \
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + r * QK));                  \
        ACC[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT4(w, av)), _mm256_set1_ps(sb[r]), ACC[r]);              \
      }                                                                                                        \
    } else {                                                                                                   \
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + QK * (B)));                  \
      const __m256i wx = PREP8(w);                                                                             \
      for (int r = 0; r < MT; ++r) {                                                                           \
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + r * QK));                  \
        ACC[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT8(w, wx, av)), _mm256_set1_ps(sb[r]), ACC[r]);          \
      }                                                                                                        \
    }                                                                                                          \
  } while (0)

#define PAGEDLLM_ID_TILE(NAME, DOT4, PREP8, DOT8, HSUM)                                                         \
  template <int MT, bool INT4, bool MINS>                                                                      \
  void NAME(const Ctx& c, int64_t n, int64_t m0, float* scr) {                                                 \
    const uint8_t* row = c.q + n * c.rb;                                                                       \
    const float* wd = c.wd + n * c.nb;                                                                         \
    const int64_t K = c.nb * QK, t0 = m0 / c.mr * c.mr, h = std::min(c.mr, c.M - t0), r0 = m0 - t0;            \
    const uint8_t* at = c.ap + t0 * K + r0 * QK;                                                               \
    const int64_t bs = h * QK;                                                                                 \
    const float* xt = c.xdp + t0 * c.nb + r0;                                                                  \
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                            \
    if (MT == 1 && h == 1) { /* scr[b] = d[b] * xd[b], 8 blocks at a time */                                            \
      for (int64_t b0 = 0; b0 < c.nb; b0 += 8) {                                                               \
        const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(8, c.nb - b0))), lane); \
        _mm256_maskstore_ps(scr + b0, mk, _mm256_mul_ps(_mm256_maskload_ps(wd + b0, mk), _mm256_maskload_ps(xt + b0 * h, mk))); \
      }                                                                                                        \
    } else if (MT == 8) { /* (h = 8) scr[8 b + r] = d[b] * xd[r, b], 8 rows at a time */                            \
      for (int64_t b = 0; b < c.nb; ++b)                                                                       \
        _mm256_storeu_ps(scr + 8 * b, _mm256_mul_ps(_mm256_set1_ps(wd[b]), _mm256_loadu_ps(xt + b * h)));      \
    } else {                                                                                                   \
      for (int64_t b = 0; b < c.nb; ++b)                                                                       \
        for (int r = 0; r < MT; ++r) scr[b * MT + r] = wd[b] * xt[b * h + r];                                  \
    }                                                                                                          \
    __m256 acc0[MT], acc1[MT];                                                                                 \
    for (int r = 0; r < MT; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();                                      \
    const __m128i lo4 = _mm_set1_epi8(0x0F);                                                                   \
    int64_t b = 0;                                                                                             \
    for (; b + 2 <= c.nb; b += 2) {                                                                            \
      PAGEDLLM_ID_BLOCK(DOT4, PREP8, DOT8, b, acc0);                                                           \
      PAGEDLLM_ID_BLOCK(DOT4, PREP8, DOT8, b + 1, acc1);                                                       \
    }                                                                                                          \
    if (b < c.nb) PAGEDLLM_ID_BLOCK(DOT4, PREP8, DOT8, b, acc0); /* b is even */                               \
    if (MT == 8) { /* the same sums for 8 rows at once (lane r = row r; see hsum8_rows) */                    \
      __m256 v8[8];                                                                                            \
      for (int r = 0; r < 8; ++r) v8[r] = _mm256_add_ps(acc0[r], acc1[r]);                                     \
      __m256 yv = hsum8_rows(v8);                                                                              \
      if (MINS) { /* lane j of row r: fma over blocks j, j + 8, ... < nbp (m = 0 past nb), as per row */     \
        const float* wm = c.wm + n * c.nb;                                                                     \
        const float* xs = c.xsp + t0 * c.nbp;                                                                  \
        __m256 ml[8];                                                                                          \
        for (int j = 0; j < 8; ++j) ml[j] = _mm256_setzero_ps();                                               \
        for (int64_t b0 = 0; b0 < c.nbp; b0 += 8) {                                                            \
          for (int j = 0; j < 8; ++j) {                                                                        \
            const float mv = b0 + j < c.nb ? wm[b0 + j] : 0.f;                                                 \
            ml[j] = _mm256_fmadd_ps(_mm256_set1_ps(mv), _mm256_loadu_ps(xs + (b0 + j) * 8), ml[j]);           \
          }                                                                                                    \
        }                                                                                                      \
        yv = _mm256_add_ps(yv, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(ml[0], ml[4]), _mm256_add_ps(ml[2], ml[6])), \
                                             _mm256_add_ps(_mm256_add_ps(ml[1], ml[5]), _mm256_add_ps(ml[3], ml[7])))); \
      }                                                                                                        \
      if (c.bias) yv = _mm256_add_ps(yv, _mm256_set1_ps(c.bias[n]));                                           \
      alignas(32) float o[8];                                                                                  \
      _mm256_store_ps(o, yv);                                                                                  \
      for (int r = 0; r < 8; ++r) c.y[(m0 + r) * c.N + n] = o[r];                                              \
      return;                                                                                                  \
    }                                                                                                          \
    for (int r = 0; r < MT; ++r) {                                                                             \
      float v = HSUM(_mm256_add_ps(acc0[r], acc1[r]));                                                         \
      if (MINS) {                                                                                              \
        const float* wm = c.wm + n * c.nb;                                                                     \
        const float* xs = c.xs + (m0 + r) * c.nbp;                                                             \
        __m256 macc = _mm256_setzero_ps();                                                                     \
        for (int64_t b0 = 0; b0 < c.nb; b0 += 8) {                                                             \
          const int nbc = static_cast<int>(std::min<int64_t>(8, c.nb - b0));                                   \
          const __m256 wmv = _mm256_maskload_ps(wm + b0, _mm256_cmpgt_epi32(_mm256_set1_epi32(nbc), lane));    \
          macc = _mm256_fmadd_ps(wmv, _mm256_loadu_ps(xs + b0), macc);                                         \
        }                                                                                                      \
        v += HSUM(macc);                                                                                       \
      }                                                                                                        \
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

// Eight 8-lane sums at once: lane r of the result = ((v_r0 + v_r4) + (v_r2 + v_r6)) + ((v_r1 + v_r5) +
// (v_r3 + v_r7)), exactly the additions of HSUM on v[r] alone (hsum8_ref).
inline __m256 hsum8_rows(const __m256* v) {
  __m256 u[4];  // u[i] = [v[i] lo + hi | v[i + 4] lo + hi]: lanes l0+l4, l1+l5, l2+l6, l3+l7 per row
  for (int i = 0; i < 4; ++i)
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20), _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
  // z = [(l0+l4)+(l2+l6), (l1+l5)+(l3+l7)] of rows (i, j) per 128-bit half
  const __m256 z01 = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x44), _mm256_shuffle_ps(u[0], u[1], 0xEE));
  const __m256 z23 = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], 0x44), _mm256_shuffle_ps(u[2], u[3], 0xEE));
  // lanes: rows 0, 1, 2, 3 (low half) and 4, 5, 6, 7 (high half)
  return _mm256_add_ps(_mm256_shuffle_ps(z01, z23, 0x88), _mm256_shuffle_ps(z01, z23, 0xDD));
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

// int8 codes: |q| x sign(a, q) (pairs below 2 * 128 * 127 < 2^15: vpmaddubsw cannot saturate)
#define PAGEDLLM_ID_AVX2_DOT4(w, av) _mm256_madd_epi16(_mm256_maddubs_epi16(w, av), _mm256_set1_epi16(1))
#define PAGEDLLM_ID_AVX2_PREP8(w) _mm256_abs_epi8(w)
#define PAGEDLLM_ID_AVX2_DOT8(w, wx, av) \
  _mm256_madd_epi16(_mm256_maddubs_epi16(wx, _mm256_sign_epi8(av, w)), _mm256_set1_epi16(1))
PAGEDLLM_ID_TILE(tile_avx2, PAGEDLLM_ID_AVX2_DOT4, PAGEDLLM_ID_AVX2_PREP8, PAGEDLLM_ID_AVX2_DOT8, hsum8_avx2)

template <int MT, bool INT4, bool MINS>
struct TileAvx2 {
  static void go(const Ctx& c, int64_t n, int64_t m, float* scr) { tile_avx2<MT, INT4, MINS>(c, n, m, scr); }
};

void range_avx2(const Ctx& c, bool int4, int64_t n0, int64_t n1) { dispatch_range<TileAvx2, 4>(c, int4, n0, n1); }

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")

inline float hsum8_vnni(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// int8 codes: offset activations u = a + 128 (packed as such, unsigned) against the signed codes, the
// accumulator starting at -128 * sum q of each lane: sum (a + 128) q - 128 sum q = sum a q, exact
// (|terms| < 4 * 255 * 128 < 2^31), one vpdpbusd per product and no per-row sign.
// Eight 8-lane sums at once: lane r of the result = ((v_r0 + v_r4) + (v_r2 + v_r6)) + ((v_r1 + v_r5) +
// (v_r3 + v_r7)), exactly the additions of HSUM on v[r] alone (hsum8_ref).
inline __m256 hsum8_rows_v(const __m256* v) {
  __m256 u[4];  // u[i] = [v[i] lo + hi | v[i + 4] lo + hi]: lanes l0+l4, l1+l5, l2+l6, l3+l7 per row
  for (int i = 0; i < 4; ++i)
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20), _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
  // z = [(l0+l4)+(l2+l6), (l1+l5)+(l3+l7)] of rows (i, j) per 128-bit half
  const __m256 z01 = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x44), _mm256_shuffle_ps(u[0], u[1], 0xEE));
  const __m256 z23 = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], 0x44), _mm256_shuffle_ps(u[2], u[3], 0xEE));
  // lanes: rows 0, 1, 2, 3 (low half) and 4, 5, 6, 7 (high half)
  return _mm256_add_ps(_mm256_shuffle_ps(z01, z23, 0x88), _mm256_shuffle_ps(z01, z23, 0xDD));
}

#define PAGEDLLM_ID_VNNI_DOT4(w, av) _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, av)
#define PAGEDLLM_ID_VNNI_PREP8(w) \
  _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(-128), w))
#define PAGEDLLM_ID_VNNI_DOT8(w, wx, av) _mm256_dpbusd_epi32(wx, av, w)
#define hsum8_rows hsum8_rows_v
PAGEDLLM_ID_TILE(tile_vnni, PAGEDLLM_ID_VNNI_DOT4, PAGEDLLM_ID_VNNI_PREP8, PAGEDLLM_ID_VNNI_DOT8, hsum8_vnni)

template <int MT, bool INT4, bool MINS>
struct TileVnni {
  static void go(const Ctx& c, int64_t n, int64_t m, float* scr) { tile_vnni<MT, INT4, MINS>(c, n, m, scr); }
};

void range_vnni(const Ctx& c, bool int4, int64_t n0, int64_t n1) { dispatch_range<TileVnni, 8>(c, int4, n0, n1); }

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
  // x86 paths: pack the activation codes and scales in row tiles of mr rows (Ctx), the codes offset
  // to unsigned (a + 128 = a ^ 0x80) for VNNI on int8 weights; once per call, O(M K) bytes
  const int64_t mr = isa == kVnni ? 8 : 4;
  at::Tensor ap, xdp, xsp;
  if (isa != kPortable) {
    ap = at::empty({M * K}, xf.options().dtype(at::kByte));
    xdp = at::empty({(M + mr - 1) / mr * mr * nb}, xf.options());
    xsp = at::zeros({(M + mr - 1) / mr * mr * nbp}, xf.options());
    const uint8_t flip = (isa == kVnni && kind == kInt8) ? 0x80u : 0u;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(a.data_ptr<int8_t>());
    const float* xsrc = xd.data_ptr<float>();
    uint8_t* dst = ap.data_ptr<uint8_t>();
    float* xdst = xdp.data_ptr<float>();
    float* sdst = xsp.data_ptr<float>();
    for (int64_t t0 = 0; t0 < M; t0 += mr) {
      const int64_t h = std::min(mr, M - t0);
      for (int64_t r = 0; r < h; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* s0 = src + (t0 + r) * K + b * QK;
          uint8_t* d0 = dst + t0 * K + (b * h + r) * QK;
          for (int j = 0; j < QK; ++j) d0[j] = s0[j] ^ flip;
          xdst[t0 * nb + b * h + r] = xsrc[(t0 + r) * nbp + b];
        }
        for (int64_t b = 0; b < nbp; ++b) sdst[t0 * nbp + b * h + r] = xs.data_ptr<float>()[(t0 + r) * nbp + b];
      }
    }
  }
  // groups wider than 32: one scale (and min) per 32-block, expanded for this call
  at::Tensor wd = scales, wm = mins.has_value() ? *mins : at::Tensor();
  if (group != QK) {
    wd = scales.repeat_interleave(group / QK, 1).narrow(1, 0, nb).contiguous();
    if (wm.defined()) wm = wm.repeat_interleave(group / QK, 1).narrow(1, 0, nb).contiguous();
  }

  Ctx c{static_cast<const uint8_t*>(qweight.data_ptr()), wd.data_ptr<float>(),
        wm.defined() ? wm.data_ptr<float>() : nullptr, rb, nb, nbp, N, M,
        a.data_ptr<int8_t>(), ap.defined() ? ap.data_ptr<uint8_t>() : nullptr,
        xdp.defined() ? xdp.data_ptr<float>() : nullptr, xsp.defined() ? xsp.data_ptr<float>() : nullptr, mr, xd.data_ptr<float>(), xs.data_ptr<float>(),
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
