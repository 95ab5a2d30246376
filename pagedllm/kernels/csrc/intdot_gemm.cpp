// Integer-dot GEMM (any M: decode, speculative verify, prefill) on the group layout's int4 / int8
// kinds with groups of 32 (GGUF Q4_0, Q4_1, Q4_K, Q8_0, Q5_0, Q5_1, Q5_K; see
// pagedllm/quantization/group_quant.py): activations are quantized to int8 per block of 32 k, each
// block's inner product is an exact int32, and block scales are applied in float -- the scheme of
// llama.cpp's Q8_1 activations and its ggml_vec_dot_q4_1_q8_1 / ggml_vec_dot_q8_0_q8_0 (facts of
// the formulas, not its code).
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
// Output, the fixed float arithmetic of every path (batch invariance by construction):
//   i[r, n, b] = sum_{k in b} q[n, k] a[r, k]                     (int32, exact: |i| < 2^20, so
//                                                                  float(i) is exact too)
//   acc = 0;  for b = 0 .. nb-1:  acc  = fma(float(i[r, n, b]), d[n, b] * xd[r, b], acc)
//   macc = 0; for b = 0 .. nb-1:  macc = fma(m[n, b], xs[r, b], macc)        (when mins are given)
//   y[r, n] = (acc (+ macc)) (+ bias[n])
// since sum_k (d q_k + m) xd a_k = d xd sum_k q_k a_k + m xd sum_k a_k. One sequential chain per
// output in increasing b; the build uses -ffp-contract=off, so a row's result depends neither on
// M, on which rows share the call, on the kernel or tiling chosen, on the thread split over N,
// nor on the ISA path.
//
// Two kernels compute exactly that, both vectorized over 8 float lanes:
//   columns kernel (M < kRowsMinM = 8: decode and verify): lanes = 8 output columns of a group of 1-4
//     rows (VNNI; AVX2 1-2). Per block (int4: per pair of blocks, 32 packed bytes unpacked with one
//     and / shift / and against activations stored in block-pair order) one integer dot per column
//     and row gives 8 lanes of 4-k partial sums (vpdpbusd, or vpmaddubsw + vpmaddwd; int8 weights
//     on VNNI as q + 128 against signed activations, -128 sum a added per row and block), a
//     tree of unpacks and adds folds the 8 columns' vectors into one vector of their block sums, then
//     one cvt + mul + fma per 8 outputs. Each weight row is read once per call and its codes are
//     unpacked once per block for up to 4 rows (5-7 rows: two groups, the second reading the 8
//     columns' codes from L1), so a verify step of up to 7 rows streams the weights from memory once.
//     The codes and scales of a later column group are software-prefetched a few lines per block
//     (AVX2: the next group; VNNI: 3 groups ahead).
//   rows kernel (M >= kRowsMinM: verify and prefill): lanes = 8 activation rows ("row tile"), the
//     activation codes repacked once per call as [tile][block][4-k group][row][4 codes], the
//     weight codes of a column panel (~kPanelBytes) prepared once per call into unsigned bytes (int4:
//     unpacked nibbles; int8 on VNNI: q + 128 with -128 sum_k a as the integer accumulator's start,
//     on AVX2 |q| next to q for vpsign); the activations are quantized straight from float32 /
//     bfloat16 into the tiles. A register tile of NC columns x RT 8-row tiles (VNNI: 6 x 2, i.e.
//     16 rows; AVX2: 2 x 1): per 4-k group RT activation loads and, per column, one broadcast of
//     4 weight codes feeding RT vpdpbusd, so the 32-k block sum of 8 rows lands in one int32 vector
//     with no horizontal adds and the 12 chains keep the vpdpbusd port busy; per block and column
//     one cvt + mul + fma for 8 rows (the mins' fma chains in a pass of their own, which frees the
//     registers). The panel stays in L2 and a tile's activations in L1 while all row tiles pass
//     over it, so cost grows far slower than M. A row tile's outputs of the panel are written out
//     row by row (8 x 8 register transposes, store_rows), rounded to bfloat16 on the way when the
//     output is bfloat16 (the columns kernel fills a float32 scratch that is rounded afterwards).
//
// ISA paths, chosen at run time (__builtin_cpu_supports) from one build without -march flags:
//   0 portable C++; 1 AVX2 (+FMA): vpmaddubsw + vpmaddwd; 2 AVX512-VNNI (+VL/BW): vpdpbusd on
//   256-bit vectors (32 registers: 6 columns x 16 rows; AVX2 2 x 8). The isa argument forces a path.
//
//   intdot_gemm(x [M, K] f32/bf16, qweight, scales, mins?, bias? [N], kind, group, out_dtype, isa=-1,
//               rows_min_m=0, smt=None)
//       -> [M, N] out_dtype (float32 / bfloat16); isa -1 = best available. scales / mins float32
//       or float16 [N, ceil(K / group)] (float16: read as stored, widened exactly on load, so the
//       result is bit-identical to the same values in float32). smt (float16 scales, group 32):
//       the same scales (and mins) interleaved per 8 columns, float16 [ceil(N / 8), K / 32, 8 or 16]
//       (group_quant.interleave_scales), read by the columns kernel instead of transposing them;
//       the result is bit-identical with or without it.
//   intdot_quantize(x, isa=-1) -> (a int8 [M, K], xd f32 [M, K/32], xs f32 [M, K/32])
//   intdot_isa_supported(isa) -> bool; intdot_best_isa() -> int; intdot_isa_name(isa) -> str
#ifndef PAGEDLLM_ID_BODY
#include "torch_lite.h"
#include "cpu_utils.h"
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>
#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(__i386__)
#define PAGEDLLM_ID_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kVnni = 2 };
enum Kind : int64_t { kInt4 = 0, kInt8 = 1 };
// rows from which the rows kernel runs (below: the columns kernel); set by measurement on Zen 4
// (benchmarks/intdot_kernel_ab.py --with-rows --with-cols): the columns kernel's cost grows by about
// a third of a one-row call per extra row, the rows kernel's is flat up to 8 rows (one padded 8-row
// tile); they tie at 8 rows for int4 and int8 weights
constexpr int64_t kRowsMinM = 8;
// bytes of prepared weight codes per column panel of the rows kernel (per thread, L2)
constexpr int64_t kPanelBytes = 96 << 10;

// One call's operands, shared by the ISA paths.
struct Ctx {
  const uint8_t* q;     // weight codes, row stride rb bytes
  const float* wd;      // [N, nb]: the scale of each 32-block (groups > 32 expanded); nullptr when float16
  const float* wm;      // [N, nb] or nullptr
  const uint16_t* wdh;  // float16 scales [N, nb] (IEEE half bits) in place of wd, else nullptr
  const uint16_t* wmh;  // float16 mins [N, nb] in place of wm, else nullptr
  // the same float16 scales (and mins) interleaved per group of 8 columns, [ceil(N / 8)][nb][ss]
  // (ss = 8: d of the 8 columns; ss = 16: their d, then their m): the columns kernel reads them as
  // they lie (no transposes); nullptr when not given
  const uint16_t* smt;
  int64_t ss;
  int64_t rb, nb, N, M;
  bool int4;
  const int8_t* a;      // [M, K] signed codes
  const int8_t* a2;     // columns kernel on int4 weights: a in block-pair order [M][ceil(nb/2)][64] or nullptr
  const int32_t* cs;    // [M, nb]: -128 sum_k a (VNNI columns kernel on int8 weights) or nullptr
  const float* xd;      // [M, nb]
  const float* xs;      // [M, nb]
  // rows kernel: T = ceil(M / 8) row tiles (rows past M zero)
  const int8_t* ap;     // [T][nb][8 groups][8 rows][4]
  const float* xdp;     // [T][nb][8]
  const float* xsp;     // [T][nb][8]
  const int32_t* cp;    // [T][nb][8]: -128 sum_k a (VNNI on int8 weights) or nullptr
  const float* bias;    // [N] or nullptr
  float* y;             // [M, N] float32 (the output, or scratch for a bfloat16 one)
  uint16_t* yh;         // [M, N] bfloat16 output (bits) that the rows kernel writes directly, or nullptr
};

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


// IEEE half bits -> float (exact).
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// The scale (or min) of column n's 32-block b: float32 f or float16 h, whichever is given.
inline float scale_at(const float* f, const uint16_t* h, int64_t i) { return f ? f[i] : half_to_float(h[i]); }

// The arithmetic of the file comment, one output at a time.
template <bool MINS>
void range_ref(const Ctx& c, int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
  const int64_t K = c.nb * QK;
  thread_local std::vector<int32_t> w;
  if (static_cast<int64_t>(w.size()) < K) w.resize(K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = c.q + n * c.rb;
    for (int64_t b = 0; b < c.nb; ++b) {
      for (int j = 0; j < QK; ++j) {
        if (c.int4) {
          const uint8_t v = row[16 * b + (j & 15)];
          w[b * QK + j] = j < 16 ? (v & 0x0F) : (v >> 4);
        } else {
          w[b * QK + j] = reinterpret_cast<const int8_t*>(row)[b * QK + j];
        }
      }
    }
    const int64_t wo = n * c.nb;
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* ar = c.a + r * K;
      float acc = 0.f, macc = 0.f;
      for (int64_t b = 0; b < c.nb; ++b) {
        int32_t i = 0;
        for (int j = 0; j < QK; ++j) i += w[b * QK + j] * ar[b * QK + j];
        const float s = scale_at(c.wd, c.wdh, wo + b) * c.xd[r * c.nb + b];
        acc = std::fma(static_cast<float>(i), s, acc);
      }
      if (MINS) {
        for (int64_t b = 0; b < c.nb; ++b) macc = std::fma(scale_at(c.wm, c.wmh, wo + b), c.xs[r * c.nb + b], macc);
      }
      float v = MINS ? acc + macc : acc;
      if (c.bias) v += c.bias[n];
      c.y[r * c.N + n] = v;
    }
  }
}

void range_portable(const Ctx& c, int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
  (c.wm || c.wmh) ? range_ref<true>(c, n0, n1, r0, r1) : range_ref<false>(c, n0, n1, r0, r1);
}

#ifdef PAGEDLLM_ID_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
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

// The codes of 8 rows a8[rr * K + k] (one row tile) into the rows kernel's tile layout
// dst[b * 256 + 32 g + 4 rr + i] = a8[rr * K + 32 b + 4 g + i]: per block an 8 x 8 transpose of
// 4-byte groups in registers (the scalar scatter of 4-byte copies was ~3% of the default offline
// run's samples on Zen 4).
void tile_transpose_avx2(const int8_t* a8, int64_t K, int64_t nb, int8_t* dst) {
  for (int64_t b = 0; b < nb; ++b) {
    __m256i r[8];
    for (int rr = 0; rr < 8; ++rr) r[rr] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a8 + rr * K + QK * b));
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    // s0: groups 0 | 4 of rows 0-3, s1: 1 | 5, s2: 2 | 6, s3: 3 | 7; s4-s7 the same of rows 4-7
    const __m256i s0 = _mm256_unpacklo_epi64(t0, t2), s1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i s2 = _mm256_unpacklo_epi64(t1, t3), s3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i s4 = _mm256_unpacklo_epi64(t4, t6), s5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i s6 = _mm256_unpacklo_epi64(t5, t7), s7 = _mm256_unpackhi_epi64(t5, t7);
    const __m256i g[8] = {_mm256_permute2x128_si256(s0, s4, 0x20), _mm256_permute2x128_si256(s1, s5, 0x20),
                          _mm256_permute2x128_si256(s2, s6, 0x20), _mm256_permute2x128_si256(s3, s7, 0x20),
                          _mm256_permute2x128_si256(s0, s4, 0x31), _mm256_permute2x128_si256(s1, s5, 0x31),
                          _mm256_permute2x128_si256(s2, s6, 0x31), _mm256_permute2x128_si256(s3, s7, 0x31)};
    for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 256 * b + 32 * j), g[j]);
  }
}

namespace id_avx2 {
#define PAGEDLLM_ID_BODY 1
#include "intdot_gemm.cpp"
#undef PAGEDLLM_ID_BODY
}  // namespace id_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace id_vnni {
#define PAGEDLLM_ID_BODY 2
#include "intdot_gemm.cpp"
#undef PAGEDLLM_ID_BODY
}  // namespace id_vnni
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

// a [M, K]; xd, xs [M, K / 32].
void quantize_rows(int64_t isa, const float* x, int64_t M, int64_t K, int8_t* a, float* xd, float* xs) {
#ifdef PAGEDLLM_ID_X86
  if (isa >= kAvx2) return quantize_rows_avx2(x, M, K, K / QK, a, xd, xs);
#endif
  quantize_rows_ref(x, M, K, K / QK, a, xd, xs);
}

at::Tensor as_float_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(x.size(1) % QK == 0, "K must be a multiple of 32");
  if (x.scalar_type() == at::kFloat) return x.contiguous();
  // NOTE: widened here, not by an ATen copy (at decode sizes the op costs more than the work)
  const at::Tensor xc = x.contiguous();
  at::Tensor xf = at::empty(xc.sizes(), xc.options().dtype(at::kFloat));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  float* dst = xf.data_ptr<float>();
  for (int64_t i = 0; i < xc.numel(); ++i) {  // bfloat16 -> float32 is exact: the high half of the bits
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
  return xf;
}

// One activation row as float32: x's own row (float32) or the row widened into buf (bfloat16 ->
// float32 is exact: the high half of the float's bits).
inline const float* float_row(const float* xf, const uint16_t* xb, int64_t r, int64_t K, float* buf) {
  if (xf) return xf + r * K;
  const uint16_t* src = xb + r * K;
  for (int64_t k = 0; k < K; ++k) {
    const uint32_t u = static_cast<uint32_t>(src[k]) << 16;
    std::memcpy(buf + k, &u, 4);
  }
  return buf;
}

// The rows kernel's activation operands for row tiles t0 .. t1-1, straight from x [M, K] (float32
// xf or bfloat16 xb): each row quantized by quantize_rows (the same codes and scales as
// intdot_quantize) and its codes scattered into the tile layout of Ctx::ap (4 codes at a time),
// xd / xs into xdp / xsp, and on VNNI with int8 weights -128 sum a into cp; the lanes of rows past
// M are zeroed here (the buffers are reused scratch). Tiles are disjoint, so threads run ranges of
// them side by side.
void quantize_tiles(int64_t isa, const float* xf, const uint16_t* xb, int64_t M, int64_t K, int64_t t0, int64_t t1,
                    int8_t* ap, float* xdp, float* xsp, int32_t* cp) {
  const int64_t nb = K / QK;
  thread_local std::vector<float> buf;
  thread_local std::vector<int8_t> a8;  // the tile's 8 rows of codes, [8][K]
  thread_local std::vector<float> xd, xs;
  if (static_cast<int64_t>(buf.size()) < K) {
    buf.resize(K);
    a8.resize(8 * K);
    xd.resize(nb);
    xs.resize(nb);
  }
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t rr = 0; rr < 8; ++rr) {
      const int64_t r = 8 * t + rr;
      int8_t* ar = a8.data() + rr * K;
      if (r >= M) {  // lanes of rows past M: zero codes and scales
        std::memset(ar, 0, K);
        for (int64_t b = 0; b < nb; ++b) {
          xdp[(t * nb + b) * 8 + rr] = 0.f;
          xsp[(t * nb + b) * 8 + rr] = 0.f;
          if (cp) cp[(t * nb + b) * 8 + rr] = 0;
        }
        continue;
      }
      quantize_rows(isa, float_row(xf, xb, r, K, buf.data()), 1, K, ar, xd.data(), xs.data());
      for (int64_t b = 0; b < nb; ++b) {
        xdp[(t * nb + b) * 8 + rr] = xd[b];
        xsp[(t * nb + b) * 8 + rr] = xs[b];
        if (cp) {
          int32_t sum = 0;
          for (int j = 0; j < QK; ++j) sum += ar[b * QK + j];
          cp[(t * nb + b) * 8 + rr] = -128 * sum;
        }
      }
    }
    int8_t* dst = ap + t * nb * 256;
#ifdef PAGEDLLM_ID_X86
    if (isa >= kAvx2) {
      tile_transpose_avx2(a8.data(), K, nb, dst);
      continue;
    }
#endif
    for (int64_t rr = 0; rr < 8; ++rr)
      for (int64_t b = 0; b < nb; ++b)
        for (int g = 0; g < 8; ++g) std::memcpy(dst + b * 256 + 32 * g + 4 * rr, a8.data() + rr * K + b * QK + 4 * g, 4);
  }
}

// The columns kernel's activation operands for rows r0 .. r1-1: codes a [M, K], scales xd / xs
// [M, nb]; with a2 (int4 weights) the codes again in block-pair order [M][ceil(nb / 2)][64]: pair p
// (blocks 2p, 2p+1) as a(64p + 0..15), a(64p + 32..47), a(64p + 16..31), a(64p + 48..63), the order
// of the low and then the high nibbles of the 32 packed bytes of two int4 blocks (an odd last
// block's partner: zeros); with cs (VNNI on int8 weights) -128 sum_k a per block.
void quantize_plain(int64_t isa, const float* xf, const uint16_t* xb, int64_t K, int64_t r0, int64_t r1, int8_t* a,
                    float* xd, float* xs, int8_t* a2, int32_t* cs) {
  const int64_t nb = K / QK, np = (nb + 1) / 2;
  thread_local std::vector<float> buf;
  if (!xf && static_cast<int64_t>(buf.size()) < K) buf.resize(K);
  for (int64_t r = r0; r < r1; ++r) {
    const int8_t* ar = a + r * K;
    quantize_rows(isa, float_row(xf, xb, r, K, buf.data()), 1, K, a + r * K, xd + r * nb, xs + r * nb);
    if (a2) {
      int8_t* d = a2 + r * np * 64;
      for (int64_t p = 0; p < np; ++p, d += 64) {
        const int8_t* s0 = ar + 64 * p;
        std::memcpy(d, s0, 16);
        std::memcpy(d + 32, s0 + 16, 16);
        if (2 * p + 1 < nb) {
          std::memcpy(d + 16, s0 + 32, 16);
          std::memcpy(d + 48, s0 + 48, 16);
        } else {
          std::memset(d + 16, 0, 16);
          std::memset(d + 48, 0, 16);
        }
      }
    }
    if (cs) {
      for (int64_t b = 0; b < nb; ++b) {
        int32_t sum = 0;
        for (int j = 0; j < QK; ++j) sum += ar[b * QK + j];
        cs[r * nb + b] = -128 * sum;
      }
    }
  }
}

// Scratch of one calling thread, reused by its calls (no allocation per call once grown): the
// activation operands and, with a bfloat16 output, the float32 result before rounding. Bound: a
// buffer above kScratchKeepBytes is released after the call that needed it, so what stays between
// calls is at most ~6 x kScratchKeepBytes per calling thread.
constexpr size_t kScratchKeepBytes = 8u << 20;
struct Scratch {
  std::vector<int8_t> a, ap, a2;
  std::vector<float> xd, xs, xdp, xsp, y;
  std::vector<int32_t> cp, cs;
};

template <typename T>
T* grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

template <typename T>
void trim(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > kScratchKeepBytes) std::vector<T>().swap(v);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> intdot_quantize(at::Tensor x, int64_t isa) {
  isa = resolve_isa(isa);
  const at::Tensor xf = as_float_rows(x);
  const int64_t M = xf.size(0), K = xf.size(1);
  at::Tensor a = at::empty({M, K}, xf.options().dtype(at::kChar));
  at::Tensor xd = at::empty({M, K / QK}, xf.options());
  at::Tensor xs = at::empty({M, K / QK}, xf.options());
  quantize_rows(isa, xf.data_ptr<float>(), M, K, a.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>());
  return {a, xd, xs};
}

at::Tensor intdot_gemm(at::Tensor x, at::Tensor qweight, at::Tensor scales, c10::optional<at::Tensor> mins,
                       c10::optional<at::Tensor> bias, int64_t kind, int64_t group, at::ScalarType out_dtype,
                       int64_t isa, int64_t rows_min_m, c10::optional<at::Tensor> smt) {
  isa = resolve_isa(isa);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(x.size(1) % QK == 0, "K must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  const auto fopt = x.options().dtype(at::kFloat);
  TORCH_CHECK(K > 0, "K must be positive");
  TORCH_CHECK(kind == kInt4 || kind == kInt8, "intdot: kind must be 0 (int4) or 1 (int8)");
  TORCH_CHECK(group > 0 && group % QK == 0, "intdot: group must be a positive multiple of 32");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  const int64_t rb = kind == kInt4 ? K / 2 : K;
  const int64_t N = pagedllm_cpu::check_group_weights(qweight, scales, mins, rb, K, group);
  at::Tensor bf;
  if (bias.has_value()) {
    bf = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == N, "bias must be [N]");
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_dtype));
  if (M == 0 || N == 0) return out;

  const bool int4 = kind == kInt4;
  const bool rows = isa != kPortable && M >= (rows_min_m > 0 ? rows_min_m : kRowsMinM);
  const bool corr = rows && isa == kVnni && !int4;
  const bool offs = !rows && isa == kVnni && !int4;
  const bool pairs = !rows && isa != kPortable && int4;
  const bool obf16 = out_dtype == at::kBFloat16;
  const at::Tensor xc = x.contiguous();
  const bool ibf16 = xc.scalar_type() == at::kBFloat16;
  const float* xf = ibf16 ? nullptr : xc.data_ptr<float>();
  const uint16_t* xb = ibf16 ? reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()) : nullptr;
  const int64_t T = (M + 7) / 8;
  // x86 paths, once per call, O(M K) bytes of this thread's reused scratch: the rows kernel's row
  // tiles (codes [tile][block][group][row][4], xd / xs [tile][block][row], VNNI on int8 weights
  // -128 sum a [tile][block][row]) quantized straight from x; the columns kernel's codes a, scales
  // xd / xs, their block-pair order (int4) and -128 sum a (VNNI on int8 weights)
  thread_local Scratch S;
  int8_t *a = nullptr, *ap = nullptr, *a2 = nullptr;
  int32_t* cs = nullptr;
  float *xd = nullptr, *xs = nullptr, *xdp = nullptr, *xsp = nullptr;
  int32_t* cp = nullptr;
  if (rows) {
    ap = grow(S.ap, T * nb * 256);
    xdp = grow(S.xdp, T * nb * 8);
    xsp = grow(S.xsp, T * nb * 8);
    if (corr) cp = grow(S.cp, T * nb * 8);
  } else {
    a = grow(S.a, M * K);
    xd = grow(S.xd, M * nb);
    xs = grow(S.xs, M * nb);
    if (offs) cs = grow(S.cs, M * nb);
    if (pairs) a2 = grow(S.a2, M * ((nb + 1) / 2) * 64);
  }
  // a bfloat16 output: the rows kernel rounds its rows as it writes them; the others fill a float32
  // scratch that each thread rounds afterwards
  uint16_t* yh = obf16 && rows ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  float* y = !obf16 ? out.data_ptr<float>() : yh ? nullptr : grow(S.y, M * N);
  // groups wider than 32: one scale (and min) per 32-block, expanded for this call
  at::Tensor wd = scales, wm = mins.has_value() ? *mins : at::Tensor();
  if (group != QK) {
    wd = scales.repeat_interleave(group / QK, 1).narrow(1, 0, nb).contiguous();
    if (wm.defined()) wm = wm.repeat_interleave(group / QK, 1).narrow(1, 0, nb).contiguous();
  }
  // float16 scales / mins (GGUF's own fields) are read as stored and widened in registers (exact)
  const bool wh = scales.scalar_type() == at::kHalf;
  auto ptr_f = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  auto ptr_h = [](const at::Tensor& t) {
    return t.defined() ? reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()) : nullptr;
  };
  // smt: the same float16 scales (and mins) interleaved per 8 columns (group_quant.interleave_scales),
  // which the columns kernel reads in place of transposing them
  const uint16_t* smp = nullptr;
  int64_t ss = 0;
  if (smt.has_value() && smt->defined()) {
    ss = mins.has_value() ? 16 : 8;
    TORCH_CHECK(wh && group == QK, "intdot: interleaved scales are for float16 scales of 32-groups");
    TORCH_CHECK(smt->scalar_type() == at::kHalf && smt->is_contiguous() && smt->dim() == 3 &&
                    smt->size(0) == (N + 7) / 8 && smt->size(1) == nb && smt->size(2) == ss,
                "intdot: interleaved scales must be a contiguous float16 [ceil(N/8), K/32, ", ss, "] tensor");
    smp = reinterpret_cast<const uint16_t*>(smt->data_ptr<at::Half>());
  }
  Ctx c{static_cast<const uint8_t*>(qweight.data_ptr()), wh ? nullptr : ptr_f(wd), wh ? nullptr : ptr_f(wm),
        wh ? ptr_h(wd) : nullptr, wh ? ptr_h(wm) : nullptr, smp, ss, rb, nb, N, M, int4,
        a, a2, cs, xd, xs, ap, xdp, xsp, cp, ptr_f(bf), y, yh};

  // Threads: one parallel region per call. The activations are quantized first (split over row
  // tiles / rows; on the calling thread alone when that is a few microseconds), then, after a
  // barrier, each thread computes its block of the output: a range of columns in units of 24 (a
  // multiple of both kernels' column groups), or, when the columns are too few to keep every
  // thread busy and there are row tiles enough, a range of row tiles of all columns; a bfloat16
  // output is rounded by the thread that computed the block. Every output's arithmetic is the
  // same whichever block it falls in (file comment), so the split changes no bit. Threads: as many
  // as torch's (at::get_num_threads), fewer when the work is small (~64 KB of weight bytes per
  // thread and M row, as group_gemm's grain: smaller shares cost more to wake than they save).
  constexpr int64_t kUnit = 24;
  const int64_t units = (N + kUnit - 1) / kUnit;
  const int64_t work = N * rb * (rows ? std::max<int64_t>(1, M / 4) : M);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work / (64 << 10)));
  const bool split_m = rows && units < 4 * nt && T >= 2 * nt;
  const bool quant_inside = nt > 1 && M * K >= (1 << 15);
  auto quantize = [&](int64_t part, int64_t parts) {
    if (rows) {
      quantize_tiles(isa, xf, xb, M, K, T * part / parts, T * (part + 1) / parts, ap, xdp, xsp, cp);
    } else {
      quantize_plain(isa, xf, xb, K, M * part / parts, M * (part + 1) / parts, a, xd, xs, a2, cs);
    }
  };
  auto compute = [&](int64_t part, int64_t parts) {
    int64_t n0 = 0, n1 = N, r0 = 0, r1 = M;
    if (split_m) {
      r0 = std::min(M, 8 * (T * part / parts));
      r1 = std::min(M, 8 * (T * (part + 1) / parts));
    } else {
      n0 = std::min(N, kUnit * (units * part / parts));
      n1 = std::min(N, kUnit * (units * (part + 1) / parts));
    }
    if (n0 >= n1 || r0 >= r1) return;
#ifdef PAGEDLLM_ID_X86
    if (isa == kAvx2) id_avx2::range(c, rows, n0, n1, r0, r1);
    else if (isa == kVnni) id_vnni::range(c, rows, n0, n1, r0, r1);
    else range_portable(c, n0, n1, r0, r1);
#else
    range_portable(c, n0, n1, r0, r1);
#endif
    if (obf16 && !yh) {  // round-to-nearest-even, NaN -> 0x7FC0: the bits of ATen's .to(), on the bits
      uint16_t* yd = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      for (int64_t r = r0; r < r1; ++r) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(y + r * N);
        uint16_t* dst = yd + r * N;
#pragma omp simd
        for (int64_t n = n0; n < n1; ++n) {
          const uint32_t u = src[n];
          const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
          dst[n] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
        }
      }
    }
  };
  if (!quant_inside) quantize(0, 1);
  if (nt == 1) {
    compute(0, 1);
  } else {
#pragma omp parallel num_threads(static_cast<int>(nt))
    {
      const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
      if (quant_inside) {
        quantize(tid, nth);
#pragma omp barrier
      }
      compute(tid, nth);
    }
  }
  trim(S.a), trim(S.ap), trim(S.a2), trim(S.cs), trim(S.xd), trim(S.xs), trim(S.xdp), trim(S.xsp), trim(S.y), trim(S.cp);
  return out;
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
        py::arg("isa") = -1, py::arg("rows_min_m") = 0, py::arg("smt") = py::none());
  m.def("intdot_quantize", &intdot_quantize, "per-32-block int8 quantization of x (codes, scales, scaled sums)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("isa") = -1);
  m.def("intdot_isa_supported", &intdot_isa_supported, "whether this CPU runs ISA path isa");
  m.def("intdot_best_isa", &intdot_best_isa, "the ISA path intdot_gemm takes by default");
  m.def("intdot_isa_name", &intdot_isa_name, "name of an ISA path");
  // NOTE: for the fused decode step (fused_decode.cpp, another module): the same function, called there
  m.def("intdot_gemm_fn", []() { return reinterpret_cast<int64_t>(&intdot_gemm); }, "intdot_gemm's address");
  m.def("intdot_rows_min_m", []() { return kRowsMinM; }, "rows from which the rows kernel runs by default");
}

#else  // PAGEDLLM_ID_BODY: the x86 kernels, compiled once per ISA path (1 AVX2, 2 AVX512-VNNI) inside
       // its target region and namespace (this file includes itself; see the end of the x86 part)

constexpr bool kV = PAGEDLLM_ID_BODY == 2;  // vpdpbusd (else vpmaddubsw + vpmaddwd)
// column groups of 8 between the columns kernel's software prefetch and its use. AVX2: the next
// group (measured on Zen 1). VNNI: 3 groups ahead, spread over the blocks as on AVX2 -- on Zen 4
// (1 thread, bf16 activations, SmolLM2 Q4_1 decode) ~117 -> ~147 tok/s against one burst of the
// group 2 ahead, whose prefetcht1 instructions stalled on the full miss queue (7% of decode time
// in perf); 2 groups ahead ~139, 4 ~147, 6 ~145; 2 threads 160 -> 178 tok/s.
constexpr int64_t kPrefetchAhead = kV ? 3 : 1;

// 16 packed bytes (int4 layout) -> 32 codes 0..15 in k order
inline __m256i unpack4(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, lo4)),
                                 _mm_and_si128(_mm_srli_epi16(v, 4), lo4), 1);
}

inline int32_t load4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The first level of 4-lane sums of two vectors, per 128-bit lane: [v0 l0+l2, v1 l0+l2, v0 l1+l3,
// v1 l1+l3] (unpack + add: on Zen 4 vphaddd costs ~2 cycles, these three ~1).
inline __m256i fold2(__m256i v0, __m256i v1) {
  return _mm256_add_epi32(_mm256_unpacklo_epi32(v0, v1), _mm256_unpackhi_epi32(v0, v1));
}

// From fold2(v0, v1) and fold2(v2, v3): per 128-bit lane [sum v0, sum v1, sum v2, sum v3] over that
// lane's 4 int32 lanes (exact; integer adds in any order).
inline __m256i fold4(__m256i t01, __m256i t23) {
  return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return _cvtsh_ss(*p); }

// dst[i] = float(src[i]) for i < n (float16 -> float32 with vcvtph2ps: exact).
inline void widen(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = load1(src + i);
}

// dst[8 b + j] = src[n[j] * nb + b] for b < nb: 8 x 8 transposes; when nb >= 8 a tail of nb % 8
// blocks is one more transpose of the last 8 blocks (rewriting a few with the same values), not
// scalar loads. float16 sources (how a GGUF file's scales and mins are held): the 16-bit values are
// transposed in 128-bit registers (three rounds of 8 unpacks, one uop each) and stored as float16
// (D = uint16_t) or widened to float32 (D = float: one vcvtph2ps per block, exact). float32
// sources: 256-bit unpack / shuffle / permute. On Zen 1 a 256-bit lane-crossing permute is 8 uops:
// the float16 forms took a SmolLM2 layer's four one-row GEMMs from 320 to 296 us on one thread and
// two rows from 488 to 453 (benchmarks/intdot_kernel_ab.py --copies 30 --x-dtype float32; these
// transposes run once per 8 columns per call; with no transposes at all it would be ~255 us).
inline void store_block(uint16_t* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }
inline void store_block(float* p, __m128i v) { _mm256_storeu_ps(p, _mm256_cvtph_ps(v)); }
inline void widen_to(uint16_t* p, uint16_t v) { *p = v; }
inline void widen_to(float* p, uint16_t v) { *p = load1(&v); }

template <typename D>
inline void transpose_scales_f16(const uint16_t* src, const int64_t* n, int64_t nb, D* dst) {
  auto block8 = [&](int64_t b) {
    __m128i r[8], t[8];
    for (int j = 0; j < 8; ++j) r[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + n[j] * nb + b));
    for (int j = 0; j < 8; j += 2) {  // t[j]: columns j, j+1 interleaved, blocks 0-3; t[j+1]: blocks 4-7
      t[j] = _mm_unpacklo_epi16(r[j], r[j + 1]);
      t[j + 1] = _mm_unpackhi_epi16(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {  // columns j..j+3 of blocks (0, 1), (2, 3), (4, 5), (6, 7)
      r[j] = _mm_unpacklo_epi32(t[j], t[j + 2]);
      r[j + 1] = _mm_unpackhi_epi32(t[j], t[j + 2]);
      r[j + 2] = _mm_unpacklo_epi32(t[j + 1], t[j + 3]);
      r[j + 3] = _mm_unpackhi_epi32(t[j + 1], t[j + 3]);
    }
    for (int i = 0; i < 4; ++i) {  // r[i]: columns 0-3, r[4 + i]: columns 4-7, of blocks 2i and 2i+1
      store_block(dst + 8 * (b + 2 * i), _mm_unpacklo_epi64(r[i], r[4 + i]));
      store_block(dst + 8 * (b + 2 * i + 1), _mm_unpackhi_epi64(r[i], r[4 + i]));
    }
  };
  if (nb >= 8) {
    for (int64_t b = 0; b < nb; b += 8) block8(std::min(b, nb - 8));
    return;
  }
  for (int64_t b = 0; b < nb; ++b)
    for (int j = 0; j < 8; ++j) widen_to(dst + 8 * b + j, src[n[j] * nb + b]);
}

template <typename S>
inline void transpose_scales(const S* src, const int64_t* n, int64_t nb, float* dst) {
  auto block8 = [&](int64_t b) {
    __m256 r[8], t[8];
    for (int j = 0; j < 8; ++j) r[j] = load8(src + n[j] * nb + b);
    for (int j = 0; j < 8; j += 2) {
      t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
      t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    // t0: 0,1 (blocks 0,1 | 4,5) ... now 4-column groups
    for (int j = 0; j < 8; j += 4) {
      r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
      r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
      r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
      r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
    }
    // r[0..3]: columns 0-3, blocks (0|4), (1|5), (2|6), (3|7); r[4..7]: columns 4-7
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(dst + 8 * (b + i), _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
      _mm256_storeu_ps(dst + 8 * (b + i + 4), _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
  };
  if (nb >= 8) {
    for (int64_t b = 0; b < nb; b += 8) block8(std::min(b, nb - 8));
    return;
  }
  for (int64_t b = 0; b < nb; ++b)
    for (int j = 0; j < 8; ++j) dst[8 * b + j] = load1(src + n[j] * nb + b);
}

// A later column group's codes and scales (kPrefetchAhead), prefetched a few lines per block (pair)
// of this group's loop instead of in one burst at its start (both paths). A burst of a group's 36-96 code lines
// overruns the core's outstanding-miss queue: on Zen 1 a loads-only pass over the Q8_0 LM head's
// codes in the kernel's order reads 9.8 GB/s with the burst, 10.4 without prefetch and 13.5 with
// 4 lines per block into L1 (plain sequential loads: 10.6). The codes go to L2 (T1): in the kernel
// T0 and T1 measured the same on SmolLM2's shapes, and a group of a large model (K = 4096: 16 KiB of
// int4 codes) would not fit L1 beside the group being read. In the kernel, the LM head 5.3 -> 3.2 ms
// and a SmolLM2 layer's GEMMs 425 -> 317 us on one thread (benchmarks/intdot_kernel_ab.py --copies 30).
// NOTE: `at` must stay always_inline: out of line, GCC 12's IPA mod/ref analysis sees a function
// whose only statements are prefetches as having no effect and deletes every call to it (measured:
// no prefetch instruction left in the AVX2 kernels).
struct GroupPrefetch {
  const char* q = nullptr;  // codes of the group prefetched, ql lines
  const char* s = nullptr;  // its scales (then mins), sl and ml lines
  const char* m = nullptr;
  int64_t ql = 0, sl = 0, ml = 0, per = 0;  // per: code lines per iteration
  __attribute__((always_inline)) inline void at(int64_t i) const {
    if (!q) return;
    for (int64_t l = i * per, e = std::min(ql, l + per); l < e; ++l) _mm_prefetch(q + 64 * l, _MM_HINT_T1);
    if (i < sl) _mm_prefetch(s + 64 * i, _MM_HINT_T0);
    if (i < ml) _mm_prefetch(m + 64 * i, _MM_HINT_T0);
  }
};

// ---- columns kernel: 8 columns (row pointers cols[j], scales transposed to wdT / wmT [nb][8]) x MT
// rows from r0; out[r] lane j = y[r0 + r, column j] before the bias. Per block (int4: per pair of
// blocks, whose 32 packed bytes unpack with one and / shift / and into the low nibbles of both
// blocks and their high nibbles, against the activations in block-pair order) one integer dot per
// column and row; the codes are unpacked once for all MT rows. The 8 columns' dot vectors are
// folded by an unpack + add tree two columns at a time (so few are live at once), to one vector
// of 8 block sums per row and block, then one cvt + mul + fma per row and block.
template <bool INT4, bool MINS, int MT, int SS, typename ST>
#if PAGEDLLM_ID_BODY == 1
// AVX2: kept out of line. Inlined into cols_range (as GCC 12 chose once the scale stride became a
// template parameter), one SmolLM2 layer's GEMMs at M = 1-2 took ~20% longer on Zen 4 (forced AVX2
// path, float32 scales; benchmarks/intdot_kernel_ab.py --isa 1 --scale-dtype float32)
__attribute__((noinline))
#endif
void cols8(const Ctx& c, const uint8_t* const* cols, const ST* wdT, const ST* wmT, int64_t r0, __m256* out,
           const GroupPrefetch& pf) {
  constexpr int64_t ss = SS;  // scale elements per block (8 columns; 16: their scales, then mins)
  const int64_t K = c.nb * QK, nb = c.nb;
  __m256 f[MT], m[MT];
  for (int r = 0; r < MT; ++r) f[r] = m[r] = _mm256_setzero_ps();
  const __m256i ones16 = _mm256_set1_epi16(1);
  auto step = [&](int r, int64_t b, __m256i sum) {
    const __m256 s = _mm256_mul_ps(load8(wdT + ss * b), _mm256_set1_ps(c.xd[(r0 + r) * nb + b]));
    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, f[r]);
    if (MINS) m[r] = _mm256_fmadd_ps(load8(wmT + ss * b), _mm256_set1_ps(c.xs[(r0 + r) * nb + b]), m[r]);
  };
  if constexpr (INT4) {
    const int64_t np = (nb + 1) / 2;
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    auto pair = [&](int64_t p, auto full_c) {
      constexpr bool FULL = decltype(full_c)::value;
      pf.at(p);
      __m256i al[MT], ah[MT];
      for (int r = 0; r < MT; ++r) {
        const int8_t* src = c.a2 + (r0 + r) * np * 64 + 64 * p;
        al[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        ah[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
      }
      __m256i u[MT][2];
      for (int q = 0; q < 2; ++q) {
        __m256i t[MT][2];
        for (int jp = 0; jp < 2; ++jp) {
          __m256i v[MT][2];
          for (int jj = 0; jj < 2; ++jj) {
            const uint8_t* wp = cols[4 * q + 2 * jp + jj] + 32 * p;
            const __m256i w = FULL ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp))
                                   : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
            const __m256i lo = _mm256_and_si256(w, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), lo4);
            for (int r = 0; r < MT; ++r) {
              if constexpr (kV) {
                v[r][jj] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, al[r]), hi, ah[r]);
              } else {  // int16 pair sums below 2 * 2 * 15 * 127 < 2^15
                v[r][jj] = _mm256_madd_epi16(
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, al[r]), _mm256_maddubs_epi16(hi, ah[r])), ones16);
              }
            }
          }
          for (int r = 0; r < MT; ++r) t[r][jp] = fold2(v[r][0], v[r][1]);
        }
        // lanes 0..3: block 2p of columns 4q..4q+3, lanes 4..7: block 2p+1
        for (int r = 0; r < MT; ++r) u[r][q] = fold4(t[r][0], t[r][1]);
      }
      for (int r = 0; r < MT; ++r) {
        step(r, 2 * p, _mm256_permute2x128_si256(u[r][0], u[r][1], 0x20));
        if (FULL) step(r, 2 * p + 1, _mm256_permute2x128_si256(u[r][0], u[r][1], 0x31));
      }
    };
    int64_t p = 0;
    for (; 2 * p + 1 < nb; ++p) pair(p, std::true_type{});
    if (p < np) pair(p, std::false_type{});
  } else {
    const __m256i x80 = _mm256_set1_epi8(-128);
    for (int64_t b = 0; b < nb; ++b) {
      pf.at(b);
      __m256i av[MT];
      for (int r = 0; r < MT; ++r)
        av[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.a + (r0 + r) * K + QK * b));
      __m256i u[MT][2];
      for (int q = 0; q < 2; ++q) {
        __m256i t[MT][2];
        for (int jp = 0; jp < 2; ++jp) {
          __m256i v[MT][2];
          for (int jj = 0; jj < 2; ++jj) {
            const __m256i w =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cols[4 * q + 2 * jp + jj] + QK * b));
            if constexpr (kV) {  // sum (q + 128) a = sum q a + 128 sum a; cs carries -128 sum a
              const __m256i wx = _mm256_xor_si256(w, x80);
              for (int r = 0; r < MT; ++r) v[r][jj] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wx, av[r]);
            } else {  // |q| x sign(a, q): pairs below 2 * 128 * 127 < 2^15, no saturation
              const __m256i wa = _mm256_abs_epi8(w);
              for (int r = 0; r < MT; ++r)
                v[r][jj] = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(av[r], w)), ones16);
            }
          }
          for (int r = 0; r < MT; ++r) t[r][jp] = fold2(v[r][0], v[r][1]);
        }
        for (int r = 0; r < MT; ++r) u[r][q] = fold4(t[r][0], t[r][1]);
      }
      for (int r = 0; r < MT; ++r) {
        __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(u[r][0], u[r][1], 0x20),
                                       _mm256_permute2x128_si256(u[r][0], u[r][1], 0x31));
        if constexpr (kV) sum = _mm256_add_epi32(sum, _mm256_set1_epi32(c.cs[(r0 + r) * nb + b]));
        step(r, b, sum);
      }
    }
  }
  for (int r = 0; r < MT; ++r) out[r] = MINS ? _mm256_add_ps(f[r], m[r]) : f[r];
}

template <bool INT4, bool MINS>
void cols_range(const Ctx& c, int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
  // rows sharing one unpacking of the codes (VNNI: 32 registers; AVX2: 16)
  constexpr int MTX = kV ? 4 : 2;
  // the 8 columns' scales and mins, transposed to [nb][8]: float32, or float16 kept as stored
  // (widened in the block step)
  thread_local std::vector<float> wdT, wmT;
  thread_local std::vector<uint16_t> hdT, hmT;
  // float16 scales of a one-row call are widened while transposed (one vcvtph2ps per block of 8
  // columns); with more rows each block step reads them back once per row, so they stay float16
  // there (half the bytes written and read; measured on Zen 1, 2% either way)
  // interleaved float16 scales given (c.smt): read in place, nothing transposed
  const bool inter = c.smt != nullptr;
  const bool widen = !inter && (c.wdh == nullptr || r1 - r0 == 1);
  if (widen && static_cast<int64_t>(wdT.size()) < 8 * c.nb) wdT.resize(8 * c.nb), wmT.resize(8 * c.nb);
  if (!inter && !widen && static_cast<int64_t>(hdT.size()) < 8 * c.nb) hdT.resize(8 * c.nb), hmT.resize(8 * c.nb);
  const uint8_t* cols[8];
  float bv[8];
  int64_t ns[8];
  const GroupPrefetch none;
  for (int64_t g0 = n0; g0 < n1; g0 += 8) {
    const int64_t valid = std::min<int64_t>(8, n1 - g0);
    for (int j = 0; j < 8; ++j) {
      const int64_t n = g0 + std::min<int64_t>(j, valid - 1);
      cols[j] = c.q + n * c.rb;
      bv[j] = c.bias ? c.bias[n] : 0.f;
      ns[j] = n;
    }
    const uint16_t* gs = inter ? c.smt + (g0 / 8) * c.nb * c.ss : nullptr;  // this group's interleaved scales
    if (!inter && c.wdh) {
      if (widen) {
        transpose_scales_f16(c.wdh, ns, c.nb, wdT.data());
        if (MINS) transpose_scales_f16(c.wmh, ns, c.nb, wmT.data());
      } else {
        transpose_scales_f16(c.wdh, ns, c.nb, hdT.data());
        if (MINS) transpose_scales_f16(c.wmh, ns, c.nb, hmT.data());
      }
    } else if (!inter) {
      transpose_scales(c.wd, ns, c.nb, wdT.data());
      if (MINS) transpose_scales(c.wm, ns, c.nb, wmT.data());
    }
    // a later group's codes and scales, a few lines per block (pair) of this group's loop: 8
    // interleaved row streams defeat the hardware prefetcher once the weights come from DRAM (a
    // decode step's layers and the LM head). kPrefetchAhead groups ahead (GroupPrefetch).
    GroupPrefetch pf;
    const int64_t pg = g0 + 8 * kPrefetchAhead;
    if (pg < n1) {
      const int64_t nn = std::min<int64_t>(8, n1 - pg), es = c.wdh ? 2 : 4;
      const int64_t iters = INT4 ? (c.nb + 1) / 2 : c.nb;
      pf.q = reinterpret_cast<const char*>(c.q + pg * c.rb);
      pf.ql = (nn * c.rb + 63) / 64;
      pf.per = (pf.ql + iters - 1) / iters;
      if (inter) {
        pf.s = reinterpret_cast<const char*>(c.smt + (pg / 8) * c.nb * c.ss);
        pf.sl = (c.nb * c.ss * 2 + 63) / 64;
      } else {
        pf.s = c.wdh ? reinterpret_cast<const char*>(c.wdh + pg * c.nb)
                     : reinterpret_cast<const char*>(c.wd + pg * c.nb);
        pf.sl = (nn * c.nb * es + 63) / 64;
      }
      if (MINS && !inter) {
        pf.m = c.wmh ? reinterpret_cast<const char*>(c.wmh + pg * c.nb) : reinterpret_cast<const char*>(c.wm + pg * c.nb);
        pf.ml = pf.sl;
      }
    }
    const __m256 bias = _mm256_loadu_ps(bv);
    auto store = [&](int64_t r, __m256 o) {
      if (c.bias) o = _mm256_add_ps(o, bias);
      float* dst = c.y + r * c.N + g0;
      if (valid == 8) {
        _mm256_storeu_ps(dst, o);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, o);
        for (int64_t j = 0; j < valid; ++j) dst[j] = t[j];
      }
    };
    __m256 out[MTX];
    for (int64_t r = r0; r < r1;) {
      // chunks of at most MTX rows, as even as can be (M = 6 on VNNI: 3 + 3)
      const int64_t left = r1 - r, chunks = (left + MTX - 1) / MTX, mt = (left + chunks - 1) / chunks;
      const GroupPrefetch& p = r == r0 ? pf : none;  // the first chunk of rows prefetches
      auto run = [&](const auto* sd, const auto* sm, auto ss_c) {
        constexpr int SS = decltype(ss_c)::value;
        switch (mt) {
          case 1: cols8<INT4, MINS, 1, SS>(c, cols, sd, sm, r, out, p); break;
          case 2: cols8<INT4, MINS, 2, SS>(c, cols, sd, sm, r, out, p); break;
          case 3: if constexpr (MTX >= 3) cols8<INT4, MINS, 3, SS>(c, cols, sd, sm, r, out, p); break;
          default: if constexpr (MTX >= 4) cols8<INT4, MINS, 4, SS>(c, cols, sd, sm, r, out, p); break;
        }
      };
      using Eight = std::integral_constant<int, 8>;
      if (inter) run(gs, gs + 8, std::integral_constant<int, MINS ? 16 : 8>{});  // c.ss
      else if (widen) run(wdT.data(), wmT.data(), Eight{});
      else run(hdT.data(), hmT.data(), Eight{});
      for (int64_t i = 0; i < mt; ++i) store(r + i, out[i]);
      r += mt;
    }
  }
}

// ---- rows kernel: NC columns (prepared codes wu[j], stride K; AVX2 int8: signed codes ws[j];
// column indices n[j]; float32 scales / mins of column j, block b: sd[sn[j] * nb + b], sm[...]) x the 8 RT rows of tiles t .. t + RT - 1; o[h][j] lane r = y[8 (t + h) + r, n[j]]
// (bias included). RT = 2 (VNNI): each broadcast of 4 weight codes feeds two row tiles, halving the
// broadcasts per vpdpbusd; the NC x 2 chains keep enough products in flight. RT = 1: two chains per
// column (even / odd 4-k groups). Integer sums are exact in any order, so the split changes no bit.
template <bool INT4, bool MINS, int NC, int RT>
void rows_tile(const Ctx& c, const uint8_t* const* wu, const uint8_t* const* ws, const int64_t* n, const float* sd,
               const float* sm, const int64_t* sn, int64_t t, __m256 (*o)[NC]) {
  static_assert(RT == 1 || RT == 2, "RT is 1 or 2 row tiles");
  constexpr int CH = RT == 1 ? 2 : 1;  // chains per (column, row tile)
  const int8_t* at[RT];
  int64_t tb[RT];
  for (int h = 0; h < RT; ++h) {
    at[h] = c.ap + (t + h) * c.nb * 256;
    tb[h] = (t + h) * c.nb * 8;
  }
  __m256 f[RT][NC], m[RT][NC];
  for (int h = 0; h < RT; ++h)
    for (int j = 0; j < NC; ++j) f[h][j] = m[h][j] = _mm256_setzero_ps();
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < c.nb; ++b) {
    __m256i acc[RT][CH][NC];
    for (int h = 0; h < RT; ++h) {
      const __m256i start = (kV && !INT4)
                                ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.cp + tb[h] + 8 * b))
                                : _mm256_setzero_si256();
      for (int j = 0; j < NC; ++j) {
        acc[h][0][j] = start;
        if (CH == 2) acc[h][CH - 1][j] = _mm256_setzero_si256();
      }
    }
    for (int g = 0; g < 8; ++g) {
      const int ch = CH == 2 ? (g & 1) : 0;
      __m256i av[RT];
      for (int h = 0; h < RT; ++h) av[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at[h] + b * 256 + 32 * g));
      for (int j = 0; j < NC; ++j) {
        const __m256i wb = _mm256_set1_epi32(load4(wu[j] + b * QK + 4 * g));
        if constexpr (kV) {
          for (int h = 0; h < RT; ++h) acc[h][ch][j] = _mm256_dpbusd_epi32(acc[h][ch][j], wb, av[h]);
        } else if (INT4) {  // int16 sums of 4 groups each stay below 4 * 2 * 15 * 127 < 2^15
          for (int h = 0; h < RT; ++h) acc[h][ch][j] = _mm256_add_epi16(acc[h][ch][j], _mm256_maddubs_epi16(wb, av[h]));
        } else {
          const __m256i sb = _mm256_set1_epi32(load4(ws[j] + b * QK + 4 * g));
          for (int h = 0; h < RT; ++h)
            acc[h][ch][j] = _mm256_add_epi32(
                acc[h][ch][j], _mm256_madd_epi16(_mm256_maddubs_epi16(wb, _mm256_sign_epi8(av[h], sb)), ones16));
        }
      }
    }
    for (int h = 0; h < RT; ++h) {
      for (int j = 0; j < NC; ++j) {
        if constexpr (!kV && INT4) {
          acc[h][0][j] = _mm256_madd_epi16(CH == 2 ? _mm256_add_epi16(acc[h][0][j], acc[h][CH - 1][j]) : acc[h][0][j],
                                           ones16);
        } else if (CH == 2) {
          acc[h][0][j] = _mm256_add_epi32(acc[h][0][j], acc[h][CH - 1][j]);
        }
      }
    }
    for (int h = 0; h < RT; ++h) {
      const __m256 xdv = _mm256_loadu_ps(c.xdp + tb[h] + 8 * b);
      for (int j = 0; j < NC; ++j) {
        const __m256 s = _mm256_mul_ps(_mm256_set1_ps(sd[sn[j] * c.nb + b]), xdv);
        f[h][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[h][0][j]), s, f[h][j]);
      }
    }
  }
  // the mins' chains need no integer sums: their own pass keeps the main loop's registers free
  if (MINS) {
    for (int64_t b = 0; b < c.nb; ++b) {
      for (int h = 0; h < RT; ++h) {
        const __m256 xsv = _mm256_loadu_ps(c.xsp + tb[h] + 8 * b);
        for (int j = 0; j < NC; ++j) m[h][j] = _mm256_fmadd_ps(_mm256_set1_ps(sm[sn[j] * c.nb + b]), xsv, m[h][j]);
      }
    }
  }
  for (int h = 0; h < RT; ++h) {
    for (int j = 0; j < NC; ++j) {
      __m256 v = MINS ? _mm256_add_ps(f[h][j], m[h][j]) : f[h][j];
      if (c.bias) v = _mm256_add_ps(v, _mm256_set1_ps(c.bias[n[j]]));
      o[h][j] = v;
    }
  }
}

// The codes of one column as the rows kernel's unsigned operand (file comment).
inline void prep_col(const uint8_t* row, int64_t nb, bool int4, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w;
    if (int4) {
      w = unpack4(row + 16 * b);
    } else {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + QK * b));
      w = kV ? _mm256_xor_si256(w, _mm256_set1_epi8(-128)) : _mm256_abs_epi8(w);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + QK * b), w);
  }
}

// 8 floats -> 8 bfloat16 bits, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion
// (the bits of ATen's .to(torch.bfloat16)), in integer operations.
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i p = _mm256_packus_epi32(r, r);  // per 128-bit lane: its 4 values twice (all < 2^16)
  return _mm_unpacklo_epi64(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = c10::BFloat16(v).x; }

// y[r * ldy + j] = src[16 j + r] for r < h, j < np: a panel's column-major outputs of one 8-row tile
// (16 floats per column) written out as rows, 8 x 8 blocks transposed in registers; D = uint16_t:
// rounded to bfloat16 on the way (the bits of ATen's .to()). Storing each column's 8 lanes straight
// into y instead touched 8 rows N floats apart: with N a multiple of 1024 (4 KiB) every row's line
// falls in one L1 set, and those stores were ~15% of the rows kernel's time (perf, Zen 4, gate_up
// 576 -> 3072, M = 64); a bfloat16 output was then rounded in a second pass over a float32 copy.
template <typename D>
inline void store_rows(const float* src, int64_t np, int64_t h, D* y, int64_t ldy) {
  int64_t j = 0;
  for (; j + 8 <= np; j += 8) {
    __m256 r0 = _mm256_loadu_ps(src + 16 * (j + 0)), r1 = _mm256_loadu_ps(src + 16 * (j + 1));
    __m256 r2 = _mm256_loadu_ps(src + 16 * (j + 2)), r3 = _mm256_loadu_ps(src + 16 * (j + 3));
    __m256 r4 = _mm256_loadu_ps(src + 16 * (j + 4)), r5 = _mm256_loadu_ps(src + 16 * (j + 5));
    __m256 r6 = _mm256_loadu_ps(src + 16 * (j + 6)), r7 = _mm256_loadu_ps(src + 16 * (j + 7));
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    const __m256 row[8] = {_mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
                           _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
                           _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
                           _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
    for (int64_t r = 0; r < h; ++r) store8(y + r * ldy + j, row[r]);
  }
  for (; j < np; ++j)
    for (int64_t r = 0; r < h; ++r) store1(y + r * ldy + j, src[16 * j + r]);
}

// Columns n0 .. n1-1 of rows r0 .. r1-1 (r0 a multiple of 8; r1 a multiple of 8 or M).
template <bool INT4, bool MINS>
void rows_range(const Ctx& c, int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
  constexpr int NC = kV ? 6 : 2;  // columns per register tile (VNNI: 32 registers: 2 x 6 int32 chains + 2 x 6 float sums)
  const int64_t K = c.nb * QK, t0 = r0 / 8, T = (r1 + 7) / 8;
  const int64_t C = std::max<int64_t>(NC, kPanelBytes / K / NC * NC);
  thread_local std::vector<uint8_t> wu;
  if (static_cast<int64_t>(wu.size()) < std::min(C, n1 - n0) * K) wu.resize(std::min(C, n1 - n0) * K);
  // float16 scales / mins: each panel's widened once into float32 (indexed by the panel column)
  thread_local std::vector<float> wdf, wmf;
  const bool half = c.wdh != nullptr;
  if (half) {
    const int64_t need = std::min(C, n1 - n0) * c.nb;
    if (static_cast<int64_t>(wdf.size()) < need) wdf.resize(need);
    if (MINS && static_cast<int64_t>(wmf.size()) < need) wmf.resize(need);
  }
  // one row-tile pair's outputs of the panel, column-major [column][16 rows], written out row by
  // row after the panel's last register tile (see store_rows)
  thread_local std::vector<float> yb;
  if (static_cast<int64_t>(yb.size()) < std::min(C, n1 - n0) * 16) yb.resize(std::min(C, n1 - n0) * 16);
  for (int64_t p0 = n0; p0 < n1; p0 += C) {
    const int64_t np = std::min(C, n1 - p0);
    for (int64_t j = 0; j < np; ++j) prep_col(c.q + (p0 + j) * c.rb, c.nb, INT4, wu.data() + j * K);
    if (half) {
      widen(c.wdh + p0 * c.nb, np * c.nb, wdf.data());
      if (MINS) widen(c.wmh + p0 * c.nb, np * c.nb, wmf.data());
    }
    const float* sd = half ? wdf.data() : c.wd;
    const float* sm = half ? (MINS ? wmf.data() : nullptr) : c.wm;
    for (int64_t t = t0; t < T;) {
      const int rt = (kV && t + 1 < T) ? 2 : 1;  // row tiles per register tile
      for (int64_t j0 = 0; j0 < np; j0 += NC) {
        const uint8_t* wp[NC];
        const uint8_t* sp[NC];
        int64_t n[NC], sn[NC];
        for (int j = 0; j < NC; ++j) {
          const int64_t jj = std::min<int64_t>(j0 + j, np - 1);
          wp[j] = wu.data() + jj * K;
          sp[j] = c.q + (p0 + jj) * c.rb;
          n[j] = p0 + jj;
          sn[j] = half ? jj : p0 + jj;
        }
        __m256 o[2][NC];
        if (rt == 2) rows_tile<INT4, MINS, NC, 2>(c, wp, sp, n, sd, sm, sn, t, o);
        else rows_tile<INT4, MINS, NC, 1>(c, wp, sp, n, sd, sm, sn, t, o);
        const int64_t nv = std::min<int64_t>(NC, np - j0);
        for (int hh = 0; hh < rt; ++hh)
          for (int64_t j = 0; j < nv; ++j) _mm256_storeu_ps(yb.data() + (j0 + j) * 16 + 8 * hh, o[hh][j]);
      }
      for (int hh = 0; hh < rt; ++hh) {
        const int64_t h = std::min<int64_t>(8, c.M - 8 * (t + hh)), at = 8 * (t + hh) * c.N + p0;
        if (c.yh) store_rows(yb.data() + 8 * hh, np, h, c.yh + at, c.N);
        else store_rows(yb.data() + 8 * hh, np, h, c.y + at, c.N);
      }
      t += rt;
    }
  }
}

void range(const Ctx& c, bool rows, int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
  const bool mins = c.wm != nullptr || c.wmh != nullptr;
  if (rows) {
    if (c.int4) mins ? rows_range<true, true>(c, n0, n1, r0, r1) : rows_range<true, false>(c, n0, n1, r0, r1);
    else mins ? rows_range<false, true>(c, n0, n1, r0, r1) : rows_range<false, false>(c, n0, n1, r0, r1);
  } else {
    if (c.int4) mins ? cols_range<true, true>(c, n0, n1, r0, r1) : cols_range<true, false>(c, n0, n1, r0, r1);
    else mins ? cols_range<false, true>(c, n0, n1, r0, r1) : cols_range<false, false>(c, n0, n1, r0, r1);
  }
}

#endif  // PAGEDLLM_ID_BODY
