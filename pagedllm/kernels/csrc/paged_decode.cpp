// Paged attention for one-token decodes on CPU, reading K/V straight from the block table
// (no gather into a contiguous copy). Layout: kv_cache [num_blocks, 2, block_size, Hkv, D].
// Per (request, kv head): scores for the G = Hq/Hkv query heads over the request's context,
// float32 softmax, then the weighted sum of V. Same math as pagedllm.attention.torch_paged.
#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_utils.h"

template <typename scalar_t>
static inline void to_float(const scalar_t* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bf16 -> fp32 is a 16-bit shift; spelled out so the compiler vectorizes it.
template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

// rows[i] = the address of context token first + i's row of one kv head (head_off elements into a
// token's row of the cache block) for i < n, walking the block table once (no per-token division
// by the block size). Used by the grouped kernels below.
template <typename KT>
static inline void context_rows(const KT* kv, const int64_t* bt, int64_t first, int64_t n, int64_t block_size,
                                int64_t kv_block_stride, int64_t tok_stride, int64_t head_off, const KT** rows) {
  int64_t blk = first / block_size, off = first % block_size;
  const KT* base = kv + bt[blk] * kv_block_stride + head_off;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = base + off * tok_stride;
    if (++off == block_size && i + 1 < n) {
      off = 0;
      base = kv + bt[++blk] * kv_block_stride + head_off;
    }
  }
}

// One (request, kv head) work item. DIM > 0 fixes the head size at compile time (full
// unrolling and vectorization of the d loops); DIM == 0 handles any head size.
// NOTE: noipa: with the AVX2 kernels below in the same file, GCC 12.2's interprocedural
// optimizations (-O3 -march=znver1 -ffast-math) compiled the bf16, head-size-128 instance to read
// the K row where the V row is (tests/attention/test_cpu_kernel.py caught it); one call per
// (request, kv head), so the lost inlining costs nothing measurable.
template <int DIM, typename scalar_t, typename kv_t = scalar_t>
__attribute__((noipa)) static void decode_one(const scalar_t* q, const kv_t* kv, const int64_t* bt, int64_t L, int64_t b,
                       int64_t h, scalar_t* out, int64_t Hq, int64_t G, int64_t D_rt, int64_t block_size,
                       int64_t kv_block_stride, int64_t tok_stride, int64_t v_offset, float scale,
                       int64_t window, float soft_cap, std::vector<float>& qf, std::vector<float>& acc,
                       std::vector<float>& kf, std::vector<float>& scores) {
  const int64_t D = DIM > 0 ? DIM : D_rt;
  const int64_t first = (window > 0 && L > window) ? L - window : 0;
  const int64_t n = L - first;
  scores.resize(G * n);
  for (int64_t g = 0; g < G; ++g) {
    to_float(q + (b * Hq + h * G + g) * D, qf.data() + g * D, D);
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;  // fold the scale into q
  }
  float* __restrict kb = kf.data();
  // Pass 1: scores.
  for (int64_t p = first; p < L; ++p) {
    const kv_t* kp = kv + bt[p / block_size] * kv_block_stride + (p % block_size) * tok_stride + h * D;
    to_float(kp, kb, D);
    for (int64_t g = 0; g < G; ++g) {
      const float* __restrict qg = qf.data() + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * kb[d];
      if (soft_cap > 0.f) s = soft_cap * std::tanh(s / soft_cap);
      scores[g * n + (p - first)] = s;
    }
  }
  // Softmax per query head (float32).
  for (int64_t g = 0; g < G; ++g) pagedllm_cpu::softmax_row(scores.data() + g * n, n);
  // Pass 2: weighted sum of V.
  std::fill(acc.begin(), acc.begin() + G * D, 0.f);
  for (int64_t p = first; p < L; ++p) {
    const kv_t* vp = kv + bt[p / block_size] * kv_block_stride + v_offset + (p % block_size) * tok_stride + h * D;
    to_float(vp, kb, D);
    for (int64_t g = 0; g < G; ++g) {
      const float wgt = scores[g * n + (p - first)];
      float* __restrict ag = acc.data() + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += wgt * kb[d];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    scalar_t* o = out + (b * Hq + h * G + g) * D;
    const float* ag = acc.data() + g * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(ag[d]);
  }
}

// K + V bytes of the distinct contexts of a step: consecutive rows whose block tables start with
// the same block share their context (the k + 1 rows of a speculative verify, parallel samples
// of one prompt), so each such run counts once, at its longest row; *runs: how many runs. O(B),
// once per layer call.
static int64_t distinct_kv_bytes(const int64_t* block_tables, const int64_t* seq_lens, int64_t B, int64_t max_blocks,
                                 int64_t token_bytes, int64_t* runs) {
  int64_t tokens = 0, run_max = 0;
  *runs = 0;
  for (int64_t b = 0; b < B; ++b) {
    const bool same = b > 0 && max_blocks > 0 && block_tables[b * max_blocks] == block_tables[(b - 1) * max_blocks];
    if (!same) tokens += run_max, run_max = 0, ++*runs;
    run_max = std::max(run_max, seq_lens[b]);
  }
  return (tokens + run_max) * token_bytes;
}

// Whether a step's decode goes request-wise (decode_request_bf16 / _f32) rather than per
// (request, kv head): with up to 8 query heads per kv head, every thread getting whole requests
// (one thread, or at least two requests per thread), more distinct K/V than stays in the caches
// across a step (kRequestWiseMinBytes per layer; 30 layers of SmolLM2 at that size are ~30 MiB,
// about this Zen 4's L3), and most rows with a context of their own. Where K/V come from the
// caches the per-head split was faster (0.76x for the request-wise walk, cache-resident, Zen 4),
// and so it was where rows share a context, which the rows re-read from the caches: one stream's
// speculative verify rows (n-gram speculation on SmolLM2's copy workload read 433.3 tok/s per
// head vs 334.3 request-wise). PAGEDLLM_DECODE_PER_HEAD=1 / 0 forces either (read on every call, so that one
// process can A/B both; for measurements and tests).
constexpr int64_t kRequestWiseMinBytes = 1 << 20;
static bool decode_request_wise(int64_t G, int64_t B, int64_t nthr, const int64_t* block_tables,
                                const int64_t* seq_lens, int64_t max_blocks, int64_t token_bytes) {
  const char* e = std::getenv("PAGEDLLM_DECODE_PER_HEAD");
  if (G > 8) return false;
  if (e != nullptr && (e[0] == '0' || e[0] == '1')) return e[0] == '0';
  if (nthr > 1 && B < 2 * nthr) return false;
  int64_t runs = 0;
  const int64_t bytes = distinct_kv_bytes(block_tables, seq_lens, B, max_blocks, token_bytes, &runs);
  return bytes >= kRequestWiseMinBytes && 2 * runs > B;
}

// Requests b in [split[t], split[t + 1]) go to thread t: contiguous runs of about equal context
// tokens (within a window, the window), not of equal counts, since prompts differ in length.
static std::vector<int64_t> request_split(const int64_t* seq_lens, int64_t B, int64_t nthr, int64_t window) {
  std::vector<int64_t> split(nthr + 1, B);
  split[0] = 0;
  auto ctx = [&](int64_t i) { return (window > 0 && seq_lens[i] > window) ? window : seq_lens[i]; };
  int64_t total = 0, cum = 0, t = 1;
  for (int64_t i = 0; i < B; ++i) total += ctx(i);
  for (int64_t i = 0; i < B && t < nthr; ++i) {
    cum += ctx(i);
    while (t < nthr && cum * nthr >= t * total) split[t++] = i + 1;
  }
  return split;
}

// Score rows of the grouped decode kernels: every row starts on a 64-byte line (stride a multiple
// of 16 floats), and one out-of-line function applies the soft cap and the softmax to a row. The
// per-head and request-wise splits must give bit-identical outputs, and a vectorized sum's order
// (the compiler peels unaligned leading elements, and may vectorize each inlined copy its own
// way) would otherwise depend on where a row sits in memory and on which kernel inlined it.
struct ScoreRows {
  std::vector<float> buf;
  float* base = nullptr;
  int64_t stride = 0;
  // rows x n floats, each row 64-byte aligned; returns the row stride in floats
  int64_t resize(int64_t rows, int64_t n) {
    stride = (n + 15) / 16 * 16;
    buf.resize(rows * stride + 16);
    base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    return stride;
  }
  float* row(int64_t r) { return base + r * stride; }
};

// s[0 .. n): soft cap (soft_cap * tanh(s / soft_cap), when soft_cap > 0) and then softmax_row, in
// place. Not inlined: one body for every kernel (see ScoreRows).
__attribute__((noinline)) static void normalize_scores(float* __restrict s, int64_t n, float soft_cap) {
  if (soft_cap > 0.f)
    for (int64_t i = 0; i < n; ++i) s[i] = soft_cap * std::tanh(s[i] / soft_cap);
  pagedllm_cpu::softmax_row(s, n);
}

// Bytes of one request's K + V that the request-wise decode kernels expect to keep in L2 while
// they use them (the smallest L2 of the CPUs they run on is 512 KiB-1 MiB per core).
constexpr int64_t kL2Budget = 384 * 1024;

// f(std::integral_constant<int, g>{}) for g = 1 .. 8 (8 for more): the query heads per kv head
// that a grouped kernel instance holds in registers.
template <typename F>
static inline void with_group(int64_t g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// f(std::integral_constant<int, d>{}) for the first of Ds equal to d (none: nothing is called;
// the callers check the head size first).
template <int... Ds, typename F>
static inline void with_dim(int64_t d, F&& f) {
  (void)((d == Ds ? (f(std::integral_constant<int, Ds>{}), true) : false) || ...);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGEDLLM_AVX512_BF16 1

// Horizontal sums of 16 vectors: element i of the result is the sum of v[i]'s 16 lanes.
// Pairwise unpack/shuffle + add (15 adds, 30 shuffles) instead of 16 separate reductions.
static inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

static inline __m512 bf16x16_to_f32(const c10::BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// fp8 codes -> fp16 bits, from which the hardware conversion (vcvtph2ps, exact, subnormals
// included) gives float32. E5M2 is the top byte of an fp16. An E4M3 code shifted into the fp16
// fields reads as value / 256 (fp16's exponent bias is 8 more; E4M3's subnormals land on fp16
// subnormals), so the kernels scale by kScale = 256 where it is free: into the softmax scale for
// K, into the final output for V.
template <int M>
static inline __m256i fp8x16_to_f16(__m128i c) {
  if constexpr (M == 2) {
    return _mm256_slli_epi16(_mm256_cvtepu8_epi16(c), 8);
  } else {
    // sign-extended code << 7 puts exponent and mantissa in bits 7..13 and the sign in bits 14
    // and 15; clear bit 14
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7),
                            _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  }
}

// How the AVX512-BF16 kernels read K/V rows of a cache element type: 32 values as bf16 pairs
// (for _mm512_dpbf16_ps) and 16 values as float32, both equal to the stored values / kScale
// (exact: fp8 values and their power-of-two scalings are exact in bf16).
struct KvBf16 {
  using T = c10::BFloat16;
  static constexpr float kScale = 1.f;
  static inline __m512bh load32_bf16(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static inline __m512 load16_f32(const T* p) { return bf16x16_to_f32(p); }
};
template <int M, int BIAS>
struct KvFp8 {
  using T = uint8_t;
  static constexpr float kScale = M == 3 ? 256.f : 1.f;
  static inline __m512bh load32_bf16(const T* p) {
    const __m512 lo = _mm512_cvtph_ps(fp8x16_to_f16<M>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512 hi = _mm512_cvtph_ps(fp8x16_to_f16<M>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
  static inline __m512 load16_f32(const T* p) {
    return _mm512_cvtph_ps(fp8x16_to_f16<M>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
using KvE4M3 = KvFp8<3, 7>;
using KvE5M2 = KvFp8<2, 15>;

// bf16 decode with AVX512-BF16 for G query heads (heads head0 .. head0+G-1 of request b) that
// share kv head h: q.k by _mm512_dpbf16_ps (exact bf16 products, float32 sums) 16 tokens at a
// time with one transposing reduction, softmax in float32, P.V with float32 FMAs into register
// accumulators. Same math as decode_one up to summation order. Each context token's K/V row
// address is computed once (no per-token division by the block size), the K rows of 16 tokens
// are scored for all G heads while they sit in L1, and each V row is loaded and widened once for
// all G heads (G heads x CV vectors of the head dim in registers). prefetch_rows: also prefetch
// whole token rows (every kv head) into L2 (the request's first kv head does, see below).
constexpr int decode_cv(int G, int NV) {
  int cv = NV;
  while (cv > 1 && G * cv > 16) cv /= 2;  // NV is a power of two
  return cv;
}

template <typename KV, int DIM, int G>
static void decode_group_bf16(const c10::BFloat16* q, const typename KV::T* kv, const int64_t* bt, int64_t L,
                              int64_t b, int64_t h, int64_t head0, bool prefetch_rows, c10::BFloat16* out,
                              int64_t Hq, int64_t block_size, int64_t kv_block_stride, int64_t tok_stride,
                              int64_t v_offset, float scale, int64_t window, float soft_cap,
                              ScoreRows& scores, std::vector<const typename KV::T*>& rows) {
  using KT = typename KV::T;
  constexpr int NC = DIM / 32;  // 32-element bf16 chunks per row
  constexpr int NV = DIM / 16;  // 16-element float32 chunks per row
  constexpr int CV = decode_cv(G, NV);
  const int64_t first = (window > 0 && L > window) ? L - window : 0;
  const int64_t n = L - first;
  const int64_t n16 = (n + 15) / 16 * 16;
  const int64_t ss = scores.resize(G, n);
  rows.resize(n16);
  // K row address of every context token, walking the block table once.
  context_rows(kv, bt, first, n, block_size, kv_block_stride, tok_stride, h * DIM, rows.data());
  const __m512 vscale = _mm512_set1_ps(scale * KV::kScale);
  const c10::BFloat16* qh = q + (b * Hq + head0) * DIM;
  // NOTE: software prefetch one 16-token group ahead: the block table scatters rows, so the
  // hardware prefetcher loses the stream at every block boundary. The first kv head of a request
  // prefetches whole token rows (every kv head's K, resp. V) into L2, so the request's other kv
  // heads, which the same thread runs next, read them from L2 instead of DRAM.
  constexpr int LINES = std::max<int>(1, DIM * sizeof(KT) / 64);  // cache lines per K (or V) row of one head
  const int64_t row_lines = tok_stride * static_cast<int64_t>(sizeof(KT)) / 64;  // per token row, all kv heads
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - p0);
    for (int64_t j = p0 + 16; j < std::min<int64_t>(p0 + 32, n); ++j) {
      const char* r = reinterpret_cast<const char*>(rows[j]);
      if (prefetch_rows)
        for (int64_t l = LINES; l < row_lines; ++l) _mm_prefetch(r + 64 * l, _MM_HINT_T1);
      for (int l = 0; l < LINES; ++l) _mm_prefetch(r + 64 * l, _MM_HINT_T0);
    }
    for (int g = 0; g < G; ++g) {
      __m512bh qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qh + g * DIM + 32 * c);
      __m512 acc[16];
      for (int64_t j = 0; j < 16; ++j) {
        __m512 a = _mm512_setzero_ps();
        if (j < cnt) {
          const KT* kp = rows[p0 + j];
          for (int c = 0; c < NC; ++c) a = _mm512_dpbf16_ps(a, qv[c], KV::load32_bf16(kp + 32 * c));
        }
        acc[j] = a;
      }
      _mm512_storeu_ps(scores.row(g) + p0, _mm512_mul_ps(reduce16(acc), vscale));
    }
  }
  for (int64_t g = 0; g < G; ++g) normalize_scores(scores.row(g), n, soft_cap);
  // P.V for all G heads, CV vectors of the head dim at a time.
  for (int c0 = 0; c0 < NV; c0 += CV) {
    __m512 acc[G][CV];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CV; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const KT* vp = rows[i] + v_offset + 16 * c0;
      if (i + 8 < n) {
        const char* r = reinterpret_cast<const char*>(rows[i + 8] + v_offset + 16 * c0);
        if (prefetch_rows && c0 == 0)
          for (int64_t l = LINES; l < row_lines; ++l) _mm_prefetch(r + 64 * l, _MM_HINT_T1);
        for (int l = 0; l < std::max<int>(1, CV * 16 * sizeof(KT) / 64); ++l) _mm_prefetch(r + 64 * l, _MM_HINT_T0);
      }
      __m512 v[CV];
      for (int c = 0; c < CV; ++c) v[c] = KV::load16_f32(vp + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores.base[g * ss + i]);
        for (int c = 0; c < CV; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      c10::BFloat16* o = out + (b * Hq + head0 + g) * DIM + 16 * c0;
      for (int c = 0; c < CV; ++c) {
        const __m512 a = KV::kScale == 1.f ? acc[g][c] : _mm512_mul_ps(acc[g][c], _mm512_set1_ps(KV::kScale));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(a));
      }
    }
  }
}

// decode_group_bf16 for the G query heads of kv head h, in chunks of up to 8 heads (the
// instances: accumulators for more heads would not fit in registers).
template <typename KV, int DIM>
static void decode_heads_bf16(int64_t G, const c10::BFloat16* q, const typename KV::T* kv, const int64_t* bt,
                              int64_t L, int64_t b, int64_t h, c10::BFloat16* out, int64_t Hq, int64_t block_size,
                              int64_t kv_block_stride, int64_t tok_stride, int64_t v_offset, float scale,
                              int64_t window, float soft_cap, ScoreRows& scores,
                              std::vector<const typename KV::T*>& rows) {
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int64_t head0 = h * G + g0;
    const bool prefetch_rows = h == 0 && g0 == 0;
    with_group(std::min<int64_t>(8, G - g0), [&](auto gc) {
      decode_group_bf16<KV, DIM, decltype(gc)::value>(q, kv, bt, L, b, h, head0, prefetch_rows, out, Hq, block_size,
                                                     kv_block_stride, tok_stride, v_offset, scale, window, soft_cap,
                                                     scores, rows);
    });
  }
}

// One request, every kv head (G <= 8 query heads per kv head): decode_group_bf16's arithmetic for
// each (kv head, query head) -- the same products, sums and softmax in the same order, so the
// outputs are bit-identical -- with the memory walked request-wise. The scores of every head come
// from one pass over the context's K rows (a token's K row holds every kv head, and a block's K is
// one contiguous run of block_size rows), and while a group of 16 rows is scored the K rows 32
// ahead and the group's own V rows are prefetched into L2, a few rows per (kv head, query head)
// pass: the memory is busy during the compute-heavy score pass, and the P.V passes read V from L2.
// A request whose K and V would not stay in L2 (kL2Budget) prefetches V during its first P.V pass
// instead. Measured on Zen 4 (SmolLM2's 9 / 3 heads of 64, 64 requests of 50-430 tokens, 30
// layers' caches cycled so that they come from DRAM; benchmarks/decode_attention_batch_ab.py):
// 1.59x / 1.38x the per-(request, kv head) split on 1 / 2 threads, which walked one head's 2 lines
// of every 6-line row per pass (9.4 GB/s on one core); bursts of prefetches (a whole group at
// once) stalled the core and were slower than no change; cache-resident K/V run 0.76x (see
// decode_request_wise).
template <typename KV, int DIM, int G>
static void decode_request_bf16(const c10::BFloat16* q, const typename KV::T* kv, const int64_t* bt, int64_t L,
                                int64_t b, int64_t Hkv, c10::BFloat16* out, int64_t Hq, int64_t block_size,
                                int64_t kv_block_stride, int64_t tok_stride, int64_t v_offset, float scale,
                                int64_t window, float soft_cap, ScoreRows& scores,
                                std::vector<const typename KV::T*>& rows) {
  using KT = typename KV::T;
  constexpr int NC = DIM / 32;
  constexpr int NV = DIM / 16;
  constexpr int CV = decode_cv(G, NV);
  constexpr int64_t kAheadK = 32, kAheadV = 16;  // rows ahead of the scored group
  const int64_t first = (window > 0 && L > window) ? L - window : 0;
  const int64_t n = L - first;
  const int64_t n16 = (n + 15) / 16 * 16;
  const int64_t HG = Hkv * G;
  const int64_t ss = scores.resize(HG, n);
  rows.resize(n16);
  context_rows(kv, bt, first, n, block_size, kv_block_stride, tok_stride, 0, rows.data());
  const int64_t row_bytes = tok_stride * static_cast<int64_t>(sizeof(KT));  // one token's K (or V), all kv heads
  const int64_t row_lines = (row_bytes + 63) / 64;
  const bool v_in_scores = 2 * n * row_bytes <= kL2Budget;
  // lines l0 .. l1-1 of token j's K (off 0) or V (off v_offset) row into L2
  auto prefetch_lines = [&](int64_t j, int64_t off, int64_t l0, int64_t l1) {
    const char* r = reinterpret_cast<const char*>(rows[j] + off);
    for (int64_t l = l0; l < l1; ++l) _mm_prefetch(r + 64 * l, _MM_HINT_T1);
  };
  auto prefetch_row = [&](int64_t j, int64_t off) { prefetch_lines(j, off, 0, row_lines); };
  for (int64_t j = 0; j < std::min<int64_t>(kAheadK, n); ++j) prefetch_row(j, 0);
  const __m512 vscale = _mm512_set1_ps(scale * KV::kScale);
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - p0);
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int g = 0; g < G; ++g) {
        const int64_t k = h * G + g;
        const int64_t l0 = k * row_lines / HG, l1 = (k + 1) * row_lines / HG;  // this pass's share of each row
        const c10::BFloat16* qh = q + (b * Hq + h * G + g) * DIM;
        __m512bh qv[NC];
        for (int c = 0; c < NC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
        __m512 acc[16];
        for (int64_t j = 0; j < 16; ++j) {
          if (p0 + kAheadK + j < n) prefetch_lines(p0 + kAheadK + j, 0, l0, l1);
          if (v_in_scores && j < cnt) prefetch_lines(p0 + j, v_offset, l0, l1);  // V of the group scored now
          __m512 a = _mm512_setzero_ps();
          if (j < cnt) {
            const KT* kp = rows[p0 + j] + h * DIM;
            for (int c = 0; c < NC; ++c) a = _mm512_dpbf16_ps(a, qv[c], KV::load32_bf16(kp + 32 * c));
          }
          acc[j] = a;
        }
        _mm512_storeu_ps(scores.row(k) + p0, _mm512_mul_ps(reduce16(acc), vscale));
      }
    }
  }
  if (!v_in_scores)
    for (int64_t j = 0; j < std::min<int64_t>(kAheadV, n); ++j) prefetch_row(j, v_offset);
  for (int64_t hg = 0; hg < HG; ++hg) normalize_scores(scores.row(hg), n, soft_cap);
  for (int64_t h = 0; h < Hkv; ++h) {
    const float* sh = scores.row(h * G);
    const bool prefetch_v = !v_in_scores && h == 0;
    for (int c0 = 0; c0 < NV; c0 += CV) {
      __m512 acc[G][CV];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CV; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        if (prefetch_v && c0 == 0 && i + kAheadV < n) prefetch_row(i + kAheadV, v_offset);
        const KT* vp = rows[i] + v_offset + h * DIM + 16 * c0;
        __m512 v[CV];
        for (int c = 0; c < CV; ++c) v[c] = KV::load16_f32(vp + 16 * c);
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(sh[g * ss + i]);
          for (int c = 0; c < CV; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g) {
        c10::BFloat16* o = out + (b * Hq + h * G + g) * DIM + 16 * c0;
        for (int c = 0; c < CV; ++c) {
          const __m512 a = KV::kScale == 1.f ? acc[g][c] : _mm512_mul_ps(acc[g][c], _mm512_set1_ps(KV::kScale));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(a));
        }
      }
    }
  }
}



// Decode with bf16 q and head size 64/128/256 on AVX512-BF16: the grouped kernel over a bf16 or
// fp8 cache (KV: KvBf16, KvE4M3, KvE5M2): request-wise (decode_request_bf16, whole requests per
// thread) where there are enough requests, else one task per (request, kv head).
template <typename KV>
static void decode_kernel_bf16(const c10::BFloat16* q, const typename KV::T* kv, const int64_t* block_tables,
                               const int64_t* seq_lens, c10::BFloat16* out, int64_t B, int64_t Hq, int64_t Hkv,
                               int64_t D, int64_t block_size, int64_t max_blocks, int64_t kv_block_stride,
                               float scale, int64_t window, float soft_cap) {
  const int64_t G = Hq / Hkv;
  const int64_t tok_stride = Hkv * D, v_offset = block_size * Hkv * D;
  // NOTE: no threads at all for a small step (e.g. one short request): waking them would cost
  // more than the work (under 512 KiB of K/V).
  int64_t ctx_tokens = 0;
  for (int64_t b = 0; b < B; ++b) ctx_tokens += seq_lens[b];
  const int64_t kv_bytes = ctx_tokens * Hkv * D * static_cast<int64_t>(sizeof(typename KV::T));
  const int64_t grain = kv_bytes < 524288 ? B * Hkv : 1;
  // Request-wise (decode_request_bf16) where every thread gets whole requests: threads split the
  // requests into runs of about equal context tokens (not equal counts: prompts differ in length).
  // A few requests over many threads keep the per-(request, kv head) split below.
  const int64_t nthr = grain > 1 ? 1 : at::get_num_threads();
  if (decode_request_wise(G, B, nthr, block_tables, seq_lens, max_blocks,
                          2 * Hkv * D * static_cast<int64_t>(sizeof(typename KV::T)))) {
    const std::vector<int64_t> split = request_split(seq_lens, B, nthr, window);
    at::parallel_for(0, nthr, 1, [&](int64_t tb, int64_t te) {
      ScoreRows scores;
      std::vector<const typename KV::T*> rows;
      for (int64_t tt = tb; tt < te; ++tt)
        for (int64_t b = split[tt]; b < split[tt + 1]; ++b) {
          const int64_t* bt = block_tables + b * max_blocks;
          with_dim<64, 128, 256>(D, [&](auto dc) {
            with_group(G, [&](auto gc) {
              decode_request_bf16<KV, decltype(dc)::value, decltype(gc)::value>(
                  q, kv, bt, seq_lens[b], b, Hkv, out, Hq, block_size, kv_block_stride, tok_stride, v_offset, scale,
                  window, soft_cap, scores, rows);
            });
          });
        }
    });
    return;
  }
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    ScoreRows scores;
    std::vector<const typename KV::T*> rows;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv;
      const int64_t* bt = block_tables + b * max_blocks;
      with_dim<64, 128, 256>(D, [&](auto dc) {
        decode_heads_bf16<KV, decltype(dc)::value>(G, q, kv, bt, seq_lens[b], b, h, out, Hq, block_size,
                                                   kv_block_stride, tok_stride, v_offset, scale, window, soft_cap,
                                                   scores, rows);
      });
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLLM_AVX2_F32 1

// How the float32-q AVX2 kernel reads 8 values of a K/V row of a cache element type as float32
// (exact widening: bf16 by a 16-bit shift, fp16 by vcvtph2ps).
struct KvF32FromBf16 {
  using T = c10::BFloat16;
  static inline __m256 load8(const T* p) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  }
};
struct KvF32FromHalf {
  using T = c10::Half;
  static inline __m256 load8(const T* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
struct KvF32FromF32 {
  using T = float;
  static inline __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
};

// Horizontal sums of 8 vectors: lane i of the result is the sum of v[i]'s 8 lanes.
static inline __m256 reduce8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  // u0 = [v0, v1, v2, v3 (lanes 0-3) | the same for lanes 4-7], u1 likewise for v4 .. v7
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Vectors of the head dim per P.V pass: the largest divisor of NV with G x CV accumulators, CV
// values and one weight in 16 registers.
constexpr int decode_cv_f32(int G, int NV) {
  for (int cv = NV; cv > 1; --cv)
    if (NV % cv == 0 && (G + 1) * cv + 1 <= 16) return cv;
  return 1;
}

// Float32 decode on AVX2 + FMA for the G query heads head0 .. head0+G-1 of request b that share
// kv head h, over a bf16 / fp16 / float32 cache (the float32-activation path of CPUs without
// AVX512-BF16). Same math as decode_one (q pre-scaled, float32 scores, softmax_row, float32
// P.V) up to the order of the float sums: the K row of each context token is widened once for
// all G heads (one 8-lane FMA chain per head and token, the chains of 8 tokens reduced together
// by one transposing hadd tree), each V row is widened once for all G heads (G x CV vectors of
// the head dim in registers), and every token's row address is computed once from the block table.
template <typename KV, int DIM, int G>
static void decode_group_f32(const float* q, const typename KV::T* kv, const int64_t* bt, int64_t L, int64_t b,
                             int64_t head0, int64_t h, float* out, int64_t Hq, int64_t block_size,
                             int64_t kv_block_stride, int64_t tok_stride, int64_t v_offset, float scale,
                             int64_t window, float soft_cap, ScoreRows& scores,
                             std::vector<const typename KV::T*>& rows) {
  using KT = typename KV::T;
  static_assert(DIM % 8 == 0, "head size a multiple of 8");
  constexpr int NV = DIM / 8;  // 8-lane vectors per row
  constexpr int CV = decode_cv_f32(G, NV);
  const int64_t first = (window > 0 && L > window) ? L - window : 0;
  const int64_t n = L - first;
  const int64_t n8 = (n + 7) / 8 * 8;
  const int64_t ss = scores.resize(G, n);
  rows.resize(n8);
  context_rows(kv, bt, first, n, block_size, kv_block_stride, tok_stride, h * DIM, rows.data());
  for (int64_t i = n; i < n8; ++i) rows[i] = rows[0];  // padding tokens: scored, never used
  alignas(32) float qs[G * DIM];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < DIM; ++d) qs[g * DIM + d] = q[(b * Hq + head0 + g) * DIM + d] * scale;
  constexpr int LINES = std::max<int>(1, DIM * static_cast<int>(sizeof(KT)) / 64);
  // Pass 1: scores, 8 tokens at a time.
  for (int64_t p0 = 0; p0 < n; p0 += 8) {
    __m256 part[G][8];
    for (int j = 0; j < 8; ++j) {
      const KT* kp = rows[p0 + j];
      if (p0 + 8 + j < n) {
        const char* r = reinterpret_cast<const char*>(rows[p0 + 8 + j]);
        for (int l = 0; l < LINES; ++l) _mm_prefetch(r + 64 * l, _MM_HINT_T0);
      }
      __m256 a[G];
      for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
      for (int c = 0; c < NV; ++c) {
        const __m256 kc = KV::load8(kp + 8 * c);
        for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_load_ps(qs + g * DIM + 8 * c), kc, a[g]);
      }
      for (int g = 0; g < G; ++g) part[g][j] = a[g];
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(scores.row(g) + p0, reduce8(part[g]));
  }
  for (int64_t g = 0; g < G; ++g) normalize_scores(scores.row(g), n, soft_cap);
  // Pass 2: P.V for all G heads, CV vectors of the head dim at a time.
  for (int c0 = 0; c0 < NV; c0 += CV) {
    __m256 acc[G][CV];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CV; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const KT* vp = rows[i] + v_offset + 8 * c0;
      if (i + 8 < n) _mm_prefetch(reinterpret_cast<const char*>(rows[i + 8] + v_offset + 8 * c0), _MM_HINT_T0);
      __m256 v[CV];
      for (int c = 0; c < CV; ++c) v[c] = KV::load8(vp + 8 * c);
      for (int g = 0; g < G; ++g) {
        const __m256 w = _mm256_set1_ps(scores.base[g * ss + i]);
        for (int c = 0; c < CV; ++c) acc[g][c] = _mm256_fmadd_ps(w, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CV; ++c) _mm256_storeu_ps(out + (b * Hq + head0 + g) * DIM + 8 * (c0 + c), acc[g][c]);
  }
}

// One request, every kv head (G <= 8): decode_group_f32's arithmetic for each (kv head, query
// head) -- bit-identical outputs -- with the memory walked request-wise, as decode_request_bf16:
// one pass over the K rows scores every head, and while a group of 8 rows is scored the K rows 32
// ahead and the group's own V rows are prefetched into L2 (each (kv head, token) pass of the group
// takes its share of the lines), so the P.V passes read V from L2 (a request whose K and V exceed
// kL2Budget prefetches V in its first P.V pass instead).
template <typename KV, int DIM, int G>
static void decode_request_f32(const float* q, const typename KV::T* kv, const int64_t* bt, int64_t L, int64_t b,
                               int64_t Hkv, float* out, int64_t Hq, int64_t block_size, int64_t kv_block_stride,
                               int64_t tok_stride, int64_t v_offset, float scale, int64_t window, float soft_cap,
                               ScoreRows& scores, std::vector<const typename KV::T*>& rows,
                               std::vector<float>& qbuf) {
  using KT = typename KV::T;
  static_assert(DIM % 8 == 0, "head size a multiple of 8");
  constexpr int NV = DIM / 8;
  constexpr int CV = decode_cv_f32(G, NV);
  constexpr int64_t kAheadK = 32, kAheadV = 16;
  const int64_t first = (window > 0 && L > window) ? L - window : 0;
  const int64_t n = L - first;
  const int64_t n8 = (n + 7) / 8 * 8;
  const int64_t HG = Hkv * G;
  const int64_t ss = scores.resize(HG, n);
  rows.resize(n8);
  context_rows(kv, bt, first, n, block_size, kv_block_stride, tok_stride, 0, rows.data());
  for (int64_t i = n; i < n8; ++i) rows[i] = rows[0];  // padding tokens: scored, never used
  qbuf.resize(HG * DIM + 8);
  float* qs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(qbuf.data()) + 31) & ~uintptr_t(31));
  for (int64_t k = 0; k < HG; ++k)
    for (int d = 0; d < DIM; ++d) qs[k * DIM + d] = q[(b * Hq + k) * DIM + d] * scale;
  const int64_t row_bytes = tok_stride * static_cast<int64_t>(sizeof(KT));
  const int64_t row_lines = (row_bytes + 63) / 64;
  const bool v_in_scores = 2 * n * row_bytes <= kL2Budget;
  auto prefetch_lines = [&](int64_t j, int64_t off, int64_t l0, int64_t l1) {
    const char* r = reinterpret_cast<const char*>(rows[j] + off);
    for (int64_t l = l0; l < l1; ++l) _mm_prefetch(r + 64 * l, _MM_HINT_T1);
  };
  for (int64_t j = 0; j < std::min<int64_t>(kAheadK, n); ++j) prefetch_lines(j, 0, 0, row_lines);
  for (int64_t p0 = 0; p0 < n; p0 += 8) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t l0 = h * row_lines / Hkv, l1 = (h + 1) * row_lines / Hkv;  // this pass's share of each row
      const float* qh = qs + h * G * DIM;
      __m256 part[G][8];
      for (int j = 0; j < 8; ++j) {
        if (p0 + kAheadK + j < n) prefetch_lines(p0 + kAheadK + j, 0, l0, l1);
        if (v_in_scores && p0 + j < n) prefetch_lines(p0 + j, v_offset, l0, l1);  // V of the group scored now
        const KT* kp = rows[p0 + j] + h * DIM;
        __m256 a[G];
        for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
        for (int c = 0; c < NV; ++c) {
          const __m256 kc = KV::load8(kp + 8 * c);
          for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_load_ps(qh + g * DIM + 8 * c), kc, a[g]);
        }
        for (int g = 0; g < G; ++g) part[g][j] = a[g];
      }
      for (int g = 0; g < G; ++g) _mm256_storeu_ps(scores.row(h * G + g) + p0, reduce8(part[g]));
    }
  }
  if (!v_in_scores)
    for (int64_t j = 0; j < std::min<int64_t>(kAheadV, n); ++j) prefetch_lines(j, v_offset, 0, row_lines);
  for (int64_t k = 0; k < HG; ++k) normalize_scores(scores.row(k), n, soft_cap);
  for (int64_t h = 0; h < Hkv; ++h) {
    const float* sh = scores.row(h * G);
    const bool prefetch_v = !v_in_scores && h == 0;
    for (int c0 = 0; c0 < NV; c0 += CV) {
      __m256 acc[G][CV];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CV; ++c) acc[g][c] = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        if (prefetch_v && c0 == 0 && i + kAheadV < n) prefetch_lines(i + kAheadV, v_offset, 0, row_lines);
        const KT* vp = rows[i] + v_offset + h * DIM + 8 * c0;
        __m256 v[CV];
        for (int c = 0; c < CV; ++c) v[c] = KV::load8(vp + 8 * c);
        for (int g = 0; g < G; ++g) {
          const __m256 w = _mm256_set1_ps(sh[g * ss + i]);
          for (int c = 0; c < CV; ++c) acc[g][c] = _mm256_fmadd_ps(w, v[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CV; ++c) _mm256_storeu_ps(out + (b * Hq + h * G + g) * DIM + 8 * (c0 + c), acc[g][c]);
    }
  }
}

// decode_group_f32 over all (request, kv head) pairs, the G query heads of a kv head in chunks
// of up to 8. Returns false (nothing done) for a head size it has no instance for.
template <typename KV>
static bool decode_kernel_f32(const float* q, const typename KV::T* kv, const int64_t* block_tables,
                              const int64_t* seq_lens, float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                              int64_t block_size, int64_t max_blocks, int64_t kv_block_stride, float scale,
                              int64_t window, float soft_cap) {
  if (D != 64 && D != 80 && D != 96 && D != 128 && D != 256) return false;
  const int64_t G = Hq / Hkv;
  const int64_t tok_stride = Hkv * D, v_offset = block_size * Hkv * D;
  int64_t ctx_tokens = 0;
  for (int64_t b = 0; b < B; ++b) ctx_tokens += seq_lens[b];
  // no threads at all for a small step (waking them would cost more than the work); from 64 Ki
  // context elements per layer on (SmolLM2: 342 tokens) the (request, kv head) items are split
  // over the threads: one request's 3 kv heads over 2 threads took 0.71x the time at 512 and 1,024
  // tokens on Zen 1 (benchmarks/decode_attention_bench.py at 2 threads), 0.76x at 190
  const bool par = ctx_tokens * Hkv * D >= 65536;
  // query heads per work item: up to 8 (registers); when there are fewer (request, kv head)
  // items than threads, the heads of a kv head are split too (Gemma 3 270M: 1 kv head, 4 query
  // heads), each item re-reading and widening the same K/V rows: 1.1-1.15x at 1,024-2,048 tokens
  // on 2 threads of Zen 1 (the widening is done twice)
  int64_t gc = std::min<int64_t>(8, G);
  if (par && B * Hkv < at::get_num_threads() && G > 1)
    gc = std::min<int64_t>(gc, (G * B * Hkv + at::get_num_threads() - 1) / at::get_num_threads() / (B * Hkv));
  gc = std::max<int64_t>(1, gc);
  // request-wise (decode_request_f32) where every thread gets whole requests, split by context tokens
  const int64_t nthr = par ? at::get_num_threads() : 1;
  if (decode_request_wise(G, B, nthr, block_tables, seq_lens, max_blocks,
                          2 * Hkv * D * static_cast<int64_t>(sizeof(typename KV::T)))) {
    const std::vector<int64_t> split = request_split(seq_lens, B, nthr, window);
    at::parallel_for(0, nthr, 1, [&](int64_t tb, int64_t te) {
      ScoreRows scores;
      std::vector<float> qbuf;
      std::vector<const typename KV::T*> rows;
      for (int64_t tt = tb; tt < te; ++tt)
        for (int64_t b = split[tt]; b < split[tt + 1]; ++b) {
          const int64_t* bt = block_tables + b * max_blocks;
          with_dim<64, 80, 96, 128, 256>(D, [&](auto dc) {
            with_group(G, [&](auto gc) {
              decode_request_f32<KV, decltype(dc)::value, decltype(gc)::value>(
                  q, kv, bt, seq_lens[b], b, Hkv, out, Hq, block_size, kv_block_stride, tok_stride, v_offset, scale,
                  window, soft_cap, scores, rows, qbuf);
            });
          });
        }
    });
    return true;
  }
  const int64_t chunks = (G + gc - 1) / gc;
  at::parallel_for(0, B * Hkv * chunks, par ? 1 : B * Hkv * chunks, [&](int64_t begin, int64_t end) {
    ScoreRows scores;
    std::vector<const typename KV::T*> rows;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / (Hkv * chunks), h = (w / chunks) % Hkv, g0 = (w % chunks) * gc;
      const int64_t* bt = block_tables + b * max_blocks;
      {
        const int64_t head0 = h * G + g0;
        with_dim<64, 80, 96, 128, 256>(D, [&](auto dc) {
          with_group(std::min<int64_t>(gc, G - g0), [&](auto gcc) {
            decode_group_f32<KV, decltype(dc)::value, decltype(gcc)::value>(
                q, kv, bt, seq_lens[b], b, head0, h, out, Hq, block_size, kv_block_stride, tok_stride, v_offset,
                scale, window, soft_cap, scores, rows);
          });
        });
      }
    }
  });
  return true;
}
#endif

template <typename scalar_t, typename kv_t = scalar_t>
static void decode_kernel(const scalar_t* q, const kv_t* kv, const int64_t* block_tables,
                          const int64_t* seq_lens, scalar_t* out, int64_t B, int64_t Hq, int64_t Hkv,
                          int64_t D, int64_t block_size, int64_t max_blocks, int64_t kv_block_stride,
                          float scale, int64_t window, float soft_cap) {
  const int64_t G = Hq / Hkv;
  const int64_t tok_stride = Hkv * D;              // between tokens inside a block
  const int64_t v_offset = block_size * Hkv * D;   // K -> V inside a block
  // NOTE: one task per (request, kv head), but no threads at all for a small step (e.g. one
  // short request): waking them would cost more than the work.
  int64_t ctx_tokens = 0;
  for (int64_t b = 0; b < B; ++b) ctx_tokens += seq_lens[b];
  const int64_t grain = ctx_tokens * Hkv * D < 262144 ? B * Hkv : 1;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), kf(D), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv;
      const int64_t* bt = block_tables + b * max_blocks;
#define PAGEDLLM_DECODE(DIMV)                                                                       \
  decode_one<DIMV, scalar_t, kv_t>(q, kv, bt, seq_lens[b], b, h, out, Hq, G, D, block_size, kv_block_stride, \
                             tok_stride, v_offset, scale, window, soft_cap, qf, acc, kf, scores)
      switch (D) {
        case 64: PAGEDLLM_DECODE(64); break;
        case 128: PAGEDLLM_DECODE(128); break;
        case 256: PAGEDLLM_DECODE(256); break;
        default: PAGEDLLM_DECODE(0); break;
      }
#undef PAGEDLLM_DECODE
    }
  });
}

// PAGEDLLM_DECODE_GENERIC=1: the per-head decode_one kernel even where a grouped one exists
// (read once; for A/B measurements and tests).
static bool pagedllm_decode_generic() {
  static const bool v = [] {
    const char* e = std::getenv("PAGEDLLM_DECODE_GENERIC");
    return e != nullptr && e[0] == '1';
  }();
  return v;
}

// q: [B, Hq, D]; kv_cache: [NB, 2, BS, Hkv, D] (q's dtype; bf16/fp16 for float32 q; fp8 for bf16 q);
// block_tables: int64 [B, M];
// seq_lens: int64 [B] (context length incl. the new token). window <= 0: none; soft_cap <= 0: none.
static bool is_fp8(const torch::Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

// Whether the kernels read an fp8 KV cache for this q: bf16, head size 64/128/256, AVX512-BF16
// (the same condition as prefill_supported).
bool kv_fp8_supported(torch::Tensor q);

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "bad ranks");
  const bool f32q_half_kv = q.scalar_type() == at::kFloat &&
                            (kv_cache.scalar_type() == at::kBFloat16 || kv_cache.scalar_type() == at::kHalf);
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() || f32q_half_kv || (is_fp8(kv_cache) && kv_fp8_supported(q)),
              "q and kv_cache dtypes differ (an fp8 cache needs bf16 q with head size 64/128/256 and AVX512-BF16; "
              "a bf16/fp16 cache float32 q)");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hq % Hkv == 0, "head shapes");
#ifdef PAGEDLLM_AVX512_BF16
  if (kv_fp8_supported(q)) {  // bf16 q, head size 64/128/256: the grouped kernel
    const auto kvt = kv_cache.scalar_type();
#define PAGEDLLM_DECODE_KV(KVT)                                                                              \
  decode_kernel_bf16<KVT>(q.data_ptr<c10::BFloat16>(), static_cast<const KVT::T*>(kv_cache.data_ptr()),        \
                          block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),                     \
                          out.data_ptr<c10::BFloat16>(), B, Hq, Hkv, D, BS, block_tables.size(1),             \
                          kv_cache.stride(0), (float)scale, window, (float)soft_cap)
    if (kvt == at::kBFloat16) PAGEDLLM_DECODE_KV(KvBf16);
    else if (kvt == at::kFloat8_e4m3fn) PAGEDLLM_DECODE_KV(KvE4M3);
    else PAGEDLLM_DECODE_KV(KvE5M2);
#undef PAGEDLLM_DECODE_KV
    return out;
  }
#endif
#ifdef PAGEDLLM_AVX2_F32
  if (q.scalar_type() == at::kFloat && !pagedllm_decode_generic()) {  // float32 q: the AVX2 grouped kernel
    const auto kvt = kv_cache.scalar_type();
#define PAGEDLLM_DECODE_F32(KVT)                                                                             \
  decode_kernel_f32<KVT>(q.data_ptr<float>(), static_cast<const KVT::T*>(kv_cache.data_ptr()),                 \
                         block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), \
                         B, Hq, Hkv, D, BS, block_tables.size(1), kv_cache.stride(0), (float)scale, window,    \
                         (float)soft_cap)
    bool done = false;
    if (kvt == at::kBFloat16) done = PAGEDLLM_DECODE_F32(KvF32FromBf16);
    else if (kvt == at::kHalf) done = PAGEDLLM_DECODE_F32(KvF32FromHalf);
    else if (kvt == at::kFloat) done = PAGEDLLM_DECODE_F32(KvF32FromF32);
#undef PAGEDLLM_DECODE_F32
    if (done) return out;
  }
#endif
  if (f32q_half_kv) {  // float32 model, 16-bit cache: K/V widened to float32 per row (exact)
    if (kv_cache.scalar_type() == at::kBFloat16)
      decode_kernel<float, c10::BFloat16>(q.data_ptr<float>(), kv_cache.data_ptr<c10::BFloat16>(),
                                          block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                                          out.data_ptr<float>(), B, Hq, Hkv, D, BS, block_tables.size(1),
                                          kv_cache.stride(0), (float)scale, window, (float)soft_cap);
    else
      decode_kernel<float, c10::Half>(q.data_ptr<float>(), kv_cache.data_ptr<c10::Half>(),
                                      block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                                      out.data_ptr<float>(), B, Hq, Hkv, D, BS, block_tables.size(1),
                                      kv_cache.stride(0), (float)scale, window, (float)soft_cap);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
                            seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, Hq, Hkv, D, BS,
                            block_tables.size(1), kv_cache.stride(0), (float)scale, window, (float)soft_cap);
  });
  return out;
}


// ------------------------------------------------------------------------------------------
// Prefill (a chunk of Lq query tokens of one request) over the paged cache, bf16, AVX512-BF16.
// Flash-style: per (kv head, block of 16 query rows), keys in blocks of 16 with an online
// float32 softmax; q.k by _mm512_dpbf16_ps against a pair-transposed K block (16 keys per
// vector, no horizontal sums), P.V by float32 FMAs. Causal (query i sits at q_offset + i),
// optional sliding window (a query at p sees keys > p - window) and soft cap.
#ifdef PAGEDLLM_AVX512_BF16
// NOTE: a finite "minus infinity": the kernels are built with -ffast-math (no infinities).
constexpr float kNegBig = -1e30f;

// Scores of NR rows against one pair-transposed 16-key block: sc[t][j] = q_t . k_j (float32).
// NR is a template argument so that the NR accumulators stay in registers (GCC keeps an array of
// vectors in memory, with a store and reload per step, once any index into it is not a constant).
template <int DP, int NR>
static inline void prefill_scores(const uint32_t* const* qrow, const uint32_t (*kp)[16], float (*sc)[16]) {
  __m512 sv[NR];
#pragma GCC unroll 8
  for (int t = 0; t < NR; ++t) sv[t] = _mm512_setzero_ps();
  for (int d = 0; d < DP; ++d) {
    const __m512bh kd = (__m512bh)_mm512_load_si512(kp[d]);
#pragma GCC unroll 8
    for (int t = 0; t < NR; ++t)
      sv[t] = _mm512_dpbf16_ps(sv[t], (__m512bh)_mm512_set1_epi32(static_cast<int>(qrow[t][d])), kd);
  }
#pragma GCC unroll 8
  for (int t = 0; t < NR; ++t) _mm512_store_ps(sc[t], sv[t]);
}

// acc_t = acc_t * corr_t + sum_j p_t[j] v_j over nk keys, for NR rows (row stride DIM) and the 4
// float32 vectors starting at column 16 * c0.
template <int DIM, int NR>
static inline void prefill_pv(float* acc, const float* corr, const float* p, const float (*vf)[DIM], int64_t nk,
                              int c0) {
  __m512 a[NR][4];
#pragma GCC unroll 4
  for (int t = 0; t < NR; ++t) {
    const __m512 vc = _mm512_set1_ps(corr[t]);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[t][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + t * DIM + 16 * (c0 + c)), vc);
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 vv[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) vv[c] = _mm512_load_ps(&vf[j][16 * (c0 + c)]);
#pragma GCC unroll 4
    for (int t = 0; t < NR; ++t) {
      const __m512 pj = _mm512_set1_ps(p[t * 16 + j]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[t][c] = _mm512_fmadd_ps(pj, vv[c], a[t][c]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < NR; ++t)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + t * DIM + 16 * (c0 + c), a[t][c]);
}

template <typename KV, int DIM>
static void prefill_tile(const c10::BFloat16* q, const typename KV::T* kv, const int64_t* bt, int64_t q_offset,
                         int64_t i0, int64_t i1, int64_t h, int64_t Hq, int64_t G, int64_t block_size,
                         int64_t kv_block_stride, int64_t tok_stride, int64_t v_offset, float scale,
                         int64_t window, float soft_cap, c10::BFloat16* out) {
  constexpr int DP = DIM / 2;   // bf16 pairs per row
  constexpr int NV = DIM / 16;  // float32 vectors per row
  constexpr int QB = 8;         // rows scored together (independent dpbf16 chains)
  constexpr int PB = 4;         // rows whose P.V accumulate together (4 x 4 vectors in registers)
  const int64_t R = (i1 - i0) * G;  // rows of this tile: (query, head-in-group), r = (i - i0) * G + g
  std::vector<float> m(R, kNegBig), l(R, 0.f), acc(R * DIM, 0.f), corr(R), pr(R * 16);
  std::vector<const uint32_t*> qrow(R);
  for (int64_t r = 0; r < R; ++r)
    qrow[r] = reinterpret_cast<const uint32_t*>(q + ((i0 + r / G) * Hq + h * G + r % G) * DIM);
  alignas(64) uint32_t kp[DP][16];    // K block, pair-transposed: kp[d/2][key] = (K[key][d], K[key][d+1])
  alignas(64) float vf[16][DIM];      // V block in float32
  alignas(64) float sc[QB][16];
  const int64_t last_key = q_offset + i1 - 1;
  int64_t first_key = 0;
  if (window > 0) first_key = std::max<int64_t>(0, q_offset + i0 - window + 1);
  scale *= KV::kScale;  // K and V are read as value / kScale
  for (int64_t k0 = (first_key / 16) * 16; k0 <= last_key; k0 += 16) {
    const int64_t nk = std::min<int64_t>(16, last_key + 1 - k0);
    for (int64_t j = 0; j < 16; ++j) {
      if (j < nk) {
        const int64_t p = k0 + j;
        const int64_t base = bt[p / block_size] * kv_block_stride + (p % block_size) * tok_stride + h * DIM;
        if constexpr (std::is_same_v<KV, KvBf16>) {
          const uint32_t* kr = reinterpret_cast<const uint32_t*>(kv + base);
          for (int d = 0; d < DP; ++d) kp[d][j] = kr[d];
        } else {
          alignas(64) uint32_t kr[DP];  // the row widened to bf16 pairs
          for (int c = 0; c < DIM / 32; ++c) _mm512_store_si512(kr + 16 * c, (__m512i)KV::load32_bf16(kv + base + 32 * c));
          for (int d = 0; d < DP; ++d) kp[d][j] = kr[d];
        }
        const typename KV::T* vr = kv + base + v_offset;
        for (int c = 0; c < NV; ++c) _mm512_store_ps(&vf[j][16 * c], KV::load16_f32(vr + 16 * c));
      } else {
        for (int d = 0; d < DP; ++d) kp[d][j] = 0;
        for (int c = 0; c < DIM; ++c) vf[j][c] = 0.f;
      }
    }
    // Scores and online softmax, QB rows at a time: each K pair-vector is loaded once for the QB
    // rows and the QB dpbf16 chains run side by side. Rows whose query sees no key of this block
    // keep m and l, and get p = 0 and corr = 1 (their accumulators pass through unchanged).
    for (int64_t r0 = 0; r0 < R; r0 += QB) {
      const int nr = static_cast<int>(std::min<int64_t>(QB, R - r0));
      switch (nr) {
        case 8: prefill_scores<DP, 8>(qrow.data() + r0, kp, sc); break;
        case 7: prefill_scores<DP, 7>(qrow.data() + r0, kp, sc); break;
        case 6: prefill_scores<DP, 6>(qrow.data() + r0, kp, sc); break;
        case 5: prefill_scores<DP, 5>(qrow.data() + r0, kp, sc); break;
        case 4: prefill_scores<DP, 4>(qrow.data() + r0, kp, sc); break;
        case 3: prefill_scores<DP, 3>(qrow.data() + r0, kp, sc); break;
        case 2: prefill_scores<DP, 2>(qrow.data() + r0, kp, sc); break;
        default: prefill_scores<DP, 1>(qrow.data() + r0, kp, sc); break;
      }
      for (int t = 0; t < nr; ++t) {
        const int64_t r = r0 + t;
        // keys k0 + j allowed: j < nk, k0 + j <= qpos (causal), and k0 + j > qpos - window
        const int64_t qpos = q_offset + i0 + r / G;
        const int64_t hi = std::min<int64_t>(nk - 1, qpos - k0);  // last allowed j
        const int64_t lo = window > 0 ? std::max<int64_t>(0, qpos - window + 1 - k0) : 0;  // first
        const uint32_t allow = hi < lo ? 0u : ((2u << hi) - 1u) & ~((1u << lo) - 1u);
        float* s = pr.data() + r * 16;
        if (allow == 0) {
          for (int j = 0; j < 16; ++j) s[j] = 0.f;
          corr[r] = 1.f;
          continue;
        }
        __m512 v = _mm512_mul_ps(_mm512_load_ps(sc[t]), _mm512_set1_ps(scale));
        if (soft_cap > 0.f) {
          _mm512_storeu_ps(s, v);
          for (int j = 0; j < 16; ++j) s[j] = soft_cap * std::tanh(s[j] / soft_cap);
          v = _mm512_loadu_ps(s);
        }
        v = _mm512_mask_mov_ps(_mm512_set1_ps(kNegBig), static_cast<__mmask16>(allow), v);
        const float mb = _mm512_reduce_max_ps(v);
        const float mnew = std::max(m[r], mb);
        corr[r] = pagedllm_cpu::exp_approx(m[r] - mnew);  // ~0 for the first block (m = kNegBig)
        _mm512_storeu_ps(s, _mm512_sub_ps(v, _mm512_set1_ps(mnew)));
        float psum = 0.f;
#pragma omp simd reduction(+ : psum)
        for (int j = 0; j < 16; ++j) {
          const float e = ((allow >> j) & 1u) ? pagedllm_cpu::exp_approx(s[j]) : 0.f;
          s[j] = e;
          psum += e;
        }
        l[r] = l[r] * corr[r] + psum;
        m[r] = mnew;
      }
    }
    // acc = acc * corr + P.V, PB rows x 4 float32 vectors at a time: each V vector is loaded once
    // for the PB rows.
    for (int64_t r0 = 0; r0 < R; r0 += PB) {
      const int nr = static_cast<int>(std::min<int64_t>(PB, R - r0));
      float* ar = acc.data() + r0 * DIM;
      const float* pp = pr.data() + r0 * 16;
      for (int c0 = 0; c0 < NV; c0 += 4) {
        switch (nr) {
          case 4: prefill_pv<DIM, 4>(ar, corr.data() + r0, pp, vf, nk, c0); break;
          case 3: prefill_pv<DIM, 3>(ar, corr.data() + r0, pp, vf, nk, c0); break;
          case 2: prefill_pv<DIM, 2>(ar, corr.data() + r0, pp, vf, nk, c0); break;
          default: prefill_pv<DIM, 1>(ar, corr.data() + r0, pp, vf, nk, c0); break;
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = l[r] > 0.f ? KV::kScale / l[r] : 0.f;  // a row with no allowed key gives zeros
    c10::BFloat16* o = out + ((i0 + r / G) * Hq + h * G + r % G) * DIM;
    const float* ar = acc.data() + r * DIM;
    for (int c = 0; c < NV; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(ar + 16 * c), _mm512_set1_ps(inv))));
  }
}
#endif

// q: [Lq, Hq, D] bf16 at positions q_offset .. q_offset + Lq - 1 of one request whose K/V
// (positions 0 .. q_offset + Lq - 1) are already in kv_cache [NB, 2, BS, Hkv, D]; block_table:
// int64 [n] of that request. Returns [Lq, Hq, D]. Raises if the CPU or shapes are unsupported
// (callers check prefill_supported first).
bool prefill_supported(torch::Tensor q) {
#ifdef PAGEDLLM_AVX512_BF16
  const int64_t D = q.size(-1);
  return q.scalar_type() == at::kBFloat16 && (D == 64 || D == 128 || D == 256);
#else
  (void)q;
  return false;
#endif
}

bool kv_fp8_supported(torch::Tensor q) { return prefill_supported(q); }

// Whether paged_decode_attention and reshape_and_cache take a bf16/fp16 cache with float32 q/k/v.
bool kv_half_f32_supported() { return true; }

torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                                      int64_t q_offset, double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(prefill_supported(q), "paged_prefill_attention: needs bf16 q with head size 64/128/256 and AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.is_contiguous(), "bad ranks / layout");
  TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16 || is_fp8(kv_cache), "kv_cache must be bf16 or fp8");
  TORCH_CHECK(block_table.scalar_type() == at::kLong, "block_table must be int64");
  q = q.contiguous();
  block_table = block_table.contiguous();
  const int64_t Lq = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hq % Hkv == 0, "head shapes");
  TORCH_CHECK(block_table.numel() * BS >= q_offset + Lq, "block_table too short for the context");
  auto out = torch::empty_like(q);
#ifdef PAGEDLLM_AVX512_BF16
  const int64_t G = Hq / Hkv, nqb = (Lq + 15) / 16;
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const void* kvp = kv_cache.data_ptr();
  const auto kvt = kv_cache.scalar_type();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t kv_block_stride = kv_cache.stride(0), tok_stride = Hkv * D, v_offset = BS * Hkv * D;
  // Causal: query block qb scores qb + 1 key blocks. Tiles are numbered so that any contiguous
  // range (at::parallel_for's static split) holds early and late query blocks alike:
  // p = 0, 1, 2, 3, ... -> qb = 0, nqb - 1, 1, nqb - 2, ...
  at::parallel_for(0, Hkv * nqb, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      const int64_t h = w % Hkv, p = w / Hkv;
      const int64_t qb = (p % 2 == 0) ? p / 2 : nqb - 1 - p / 2;
      const int64_t i0 = qb * 16, i1 = std::min(Lq, i0 + 16);
#define PAGEDLLM_PREFILL_KV(KVT, DIMV)                                                                   \
  prefill_tile<KVT, DIMV>(qp, static_cast<const KVT::T*>(kvp), bt, q_offset, i0, i1, h, Hq, G, BS,          \
                          kv_block_stride, tok_stride, v_offset, (float)scale, window, (float)soft_cap, op)
#define PAGEDLLM_PREFILL(DIMV)                                                   \
  if (kvt == at::kBFloat16) PAGEDLLM_PREFILL_KV(KvBf16, DIMV);                   \
  else if (kvt == at::kFloat8_e4m3fn) PAGEDLLM_PREFILL_KV(KvE4M3, DIMV);         \
  else PAGEDLLM_PREFILL_KV(KvE5M2, DIMV);
      if (D == 64) { PAGEDLLM_PREFILL(64) }
      else if (D == 128) { PAGEDLLM_PREFILL(128) }
      else { PAGEDLLM_PREFILL(256) }
#undef PAGEDLLM_PREFILL
#undef PAGEDLLM_PREFILL_KV
    }
  });
#endif
  return out;
}
