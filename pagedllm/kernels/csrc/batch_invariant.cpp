// Batch-invariant CPU kernels: every output element is computed by one fixed sequence of
// floating-point operations that depends only on that element's own inputs, never on how many
// rows the call has, where a prefill was split, how the work is divided among threads, or
// whether K/V were written in this step or an earlier one. Built as its own extension module
// (pagedllm/kernels/batch_invariant.py) with -fno-fast-math -ffp-contract=off, so the compiler
// can neither reassociate a sum nor fuse a multiply-add differently in different call sites;
// fused multiply-adds are explicit (exactly rounded, so the AVX-512, AVX2 and scalar forms of
// one FMA chain give the same bits).
//
//   linear(x [M, K], w [N, K], bias? [N]) -> [M, N] (float32 / bfloat16; x, w, bias one dtype)
//       out[m, n] = tree(lanes) + bias[n], where lane l accumulates fma(x[m, k], w[n, k], .)
//       over k = l, l + L, l + 2L, ... in order (L = 8 on AVX2, 16 on AVX-512; K's tail is zero-
//       padded) and `tree` is the fixed pairwise sum of reduce8 below.
//   attention(q [T, Hq, D], kv_cache [NB, 2, BS, Hkv, D], block_tables [B, nb], query_start_loc
//             [B + 1], seq_lens [B], scale, window, soft_cap) -> [T, Hq, D]
//       One algorithm for every query token, decode or prefill chunk alike: keys in tiles of 16
//       at absolute positions (16 t .. 16 t + 15), a query's tiles in order, online softmax in
//       float32 (running max m, sum l, accumulator acc), q . k as a `linear` dot product of the
//       query scaled by `scale`, P . V as an FMA chain over the tile's keys in order.
//   act_mul(gu [M, 2I], kind) -> [M, I]: act(gu[:, :I]) * gu[:, I:] in float32 (kind 0 SiLU,
//       1 GELU-tanh, 2 GELU-erf), rounded once to gu's dtype.
//
// References: the online softmax is FlashAttention's (Dao et al. 2022, alg. 1); the fixed
// reduction order is the idea of "Defeating Nondeterminism in LLM Inference" (Thinking Machines,
// 2025) and of vLLM's batch-invariant mode, applied to the CPU kernels here.
#include "torch_lite.h"
#include "cpu_utils.h"
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BI_X86 1
#endif

namespace {

// ---------------------------------------------------------------------------------------------
// Vectors of L float32 lanes: load (float32 or bf16 bits), zero, fma, and fold to 8 lanes.
#if defined(BI_X86) && defined(__AVX512F__)
struct V {
  using T = __m512;
  static constexpr int L = 16;
  static inline T zero() { return _mm512_setzero_ps(); }
  static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  static inline T load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline T set1(float v) { return _mm512_set1_ps(v); }
  static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static inline void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  // lane i + lane i + 8 (one fixed add per lane pair)
  static inline __m256 fold8(T v) {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(lo, hi);
  }
};
#elif defined(BI_X86)
struct V {
  using T = __m256;
  static constexpr int L = 8;
  static inline T zero() { return _mm256_setzero_ps(); }
  static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  static inline T load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline T set1(float v) { return _mm256_set1_ps(v); }
  static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static inline void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static inline __m256 fold8(T v) { return v; }
};
#else
// Portable fallback (no AVX2/FMA): 8 lanes in an array, std::fma per lane (exactly rounded, so
// the same bits as the vector forms' FMA chains).
struct V {
  struct T { float v[8]; };
  static constexpr int L = 8;
  static inline T zero() { T r; for (int i = 0; i < 8; ++i) r.v[i] = 0.f; return r; }
  static inline T load(const float* p) { T r; for (int i = 0; i < 8; ++i) r.v[i] = p[i]; return r; }
  static inline T load(const uint16_t* p) {
    T r;
    for (int i = 0; i < 8; ++i) {
      const uint32_t b = static_cast<uint32_t>(p[i]) << 16;
      std::memcpy(&r.v[i], &b, 4);
    }
    return r;
  }
  static inline T set1(float x) { T r; for (int i = 0; i < 8; ++i) r.v[i] = x; return r; }
  static inline T fma(T a, T b, T c) { T r; for (int i = 0; i < 8; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
  static inline T mul(T a, T b) { T r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
  static inline void store(float* p, T v) { for (int i = 0; i < 8; ++i) p[i] = v.v[i]; }
  static inline T fold8(T v) { return v; }
};
#endif

// Sums of the 8 lanes of each of 8 vectors: out[j] = ((v_j0 + v_j1) + (v_j2 + v_j3)) +
// ((v_j4 + v_j5) + (v_j6 + v_j7)), the same tree for every j (AVX2: three rounds of hadd and one
// add of the 128-bit halves). Fewer than 8 vectors: pass zeros for the rest.
#if defined(BI_X86)
using V8 = __m256;
static inline void reduce8(const V8* v, float* out) {
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(b, c, 0x20), _mm256_permute2f128_ps(b, c, 0x31)));
}
static inline V8 zero8() { return _mm256_setzero_ps(); }
#else
using V8 = V::T;
static inline void reduce8(const V8* v, float* out) {
  for (int j = 0; j < 8; ++j) {
    const float* l = v[j].v;
    out[j] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
}
static inline V8 zero8() { return V::zero(); }
#endif

inline float bits_to_float(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// float32 -> bf16 bits, round to nearest even (finite values), as cpu_utils.h store_row.
inline uint16_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

inline float to_f(float v) { return v; }
inline float to_f(uint16_t v) { return bits_to_float(v); }

inline void to_float_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_float_row(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(src[i]);
}
inline void from_float_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void from_float_row(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bits(src[i]);
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp(x) in float32: cpu_utils.h's exp_approx (2^(x log2 e) as an integer power times a degree-6
// polynomial of the fraction, relative error ~2e-7), compiled here with this file's flags: plain
// multiplies and adds, no FMA contraction, so vector and scalar uses give the same bits.
inline float bi_exp(float x) { return pagedllm_cpu::exp_approx(x); }

// ---------------------------------------------------------------------------------------------
// linear

// MR rows of xs (float32, row stride kp, zero-padded to kp = round_up(K, L)) times NR rows of w
// (row stride K) -> res[r * NR + c] (sums without bias). Each (r, c) is one FMA chain per lane
// over K, then reduce8's tree: the same operations whatever MR and NR are.
template <int MR, int NR, typename WT>
inline void micro(const float* xs, int64_t kp, const WT* w, int64_t K, float* res) {
  constexpr int L = V::L;
  typename V::T acc[MR][NR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) acc[r][c] = V::zero();
  const int64_t kmain = K / L * L;
  for (int64_t k = 0; k < kmain; k += L) {
    typename V::T xv[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) xv[r] = V::load(xs + r * kp + k);
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      const typename V::T wv = V::load(w + c * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][c] = V::fma(xv[r], wv, acc[r][c]);
    }
  }
  if (kmain < K) {  // the tail, zero-padded (fma(0, 0, a) == a)
    alignas(64) WT tail[L];
    for (int c = 0; c < NR; ++c) {
      for (int i = 0; i < L; ++i) tail[i] = kmain + i < K ? w[c * K + kmain + i] : WT(0);
      const typename V::T wv = V::load(tail);
      for (int r = 0; r < MR; ++r) acc[r][c] = V::fma(V::load(xs + r * kp + kmain), wv, acc[r][c]);
    }
  }
  V8 f[8];
  for (int i = MR * NR; i < 8; ++i) f[i] = zero8();
  int cnt = 0;
  float* dst = res;
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) {
      f[cnt++] = V::fold8(acc[r][c]);
      if (cnt == 8) {
        reduce8(f, dst);
        dst += 8;
        cnt = 0;
      }
    }
  if (cnt) {
    for (int i = cnt; i < 8; ++i) f[i] = zero8();
    alignas(32) float tmp[8];
    reduce8(f, tmp);
    for (int i = 0; i < cnt; ++i) dst[i] = tmp[i];
  }
}

// One (rows m0 .. m1) x (cols n0 .. n1) block of the output.
template <typename WT, typename OT>
void linear_block(const float* xs, int64_t kp, const WT* w, const WT* bias, OT* out, int64_t K, int64_t N,
                  int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  alignas(64) float res[32];
  auto emit = [&](int64_t m, int64_t n, int mr, int nr) {
    for (int r = 0; r < mr; ++r) {
      alignas(64) float row[8];
      for (int c = 0; c < nr; ++c) {
        float v = res[r * nr + c];
        if (bias != nullptr) v = v + to_f(bias[n + c]);
        row[c] = v;
      }
      from_float_row(row, out + (m + r) * N + n, nr);
    }
  };
  auto cols = [&](auto mr_tag, int64_t m) {
    constexpr int MR = decltype(mr_tag)::value;
    const float* xr = xs + m * kp;
    int64_t n = n0;
    if constexpr (MR == 1) {  // one row: 8 chains in flight (the FMA latency), as many loads as FMAs
      for (; n + 8 <= n1; n += 8) {
        micro<1, 8>(xr, kp, w + n * K, K, res);
        emit(m, n, 1, 8);
      }
    }
    for (; n + 4 <= n1; n += 4) {
      micro<MR, 4>(xr, kp, w + n * K, K, res);
      emit(m, n, MR, 4);
    }
    for (; n < n1; ++n) {
      micro<MR, 1>(xr, kp, w + n * K, K, res);
      emit(m, n, MR, 1);
    }
  };
  int64_t m = m0;
  for (; m + 3 <= m1; m += 3) cols(std::integral_constant<int, 3>{}, m);
  if (m1 - m == 2) cols(std::integral_constant<int, 2>{}, m);
  else if (m1 - m == 1) cols(std::integral_constant<int, 1>{}, m);
}

template <typename XT>
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  constexpr int L = V::L;
  const int64_t kp = round_up(std::max<int64_t>(K, 1), L);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const XT* xp = reinterpret_cast<const XT*>(x.data_ptr());
  const XT* wp = reinterpret_cast<const XT*>(w.data_ptr());
  const XT* bp = bias.has_value() ? reinterpret_cast<const XT*>(bias->data_ptr()) : nullptr;
  XT* op = reinterpret_cast<XT*>(out.data_ptr());
  // x widened to float32 once, rows zero-padded to kp
  std::vector<float> xs(static_cast<size_t>(M * kp), 0.f);
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / kp), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) to_float_row(xp + m * K, xs.data() + m * kp, K);
  });
  // Tasks: blocks of NBK output columns (their weight rows stay in L2 while the rows of one
  // block of MBK x rows stream past them) by blocks of MBK rows. The split only decides who
  // computes an element, never how.
  const int64_t wbytes = K * static_cast<int64_t>(sizeof(XT));
  const int64_t nbk = std::max<int64_t>(8, std::min<int64_t>(256, (196608 / std::max<int64_t>(wbytes, 1)) / 8 * 8));
  const int64_t mbk = 96;
  const int64_t n_blocks = (N + nbk - 1) / nbk, m_blocks = (M + mbk - 1) / mbk;
  const int64_t work = M * N * K;
  const int64_t grain = work < (1 << 18) ? n_blocks * m_blocks : 1;  // small: one thread
  at::parallel_for(0, n_blocks * m_blocks, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t nb = t % n_blocks, mb = t / n_blocks;
      const int64_t n0 = nb * nbk, n1 = std::min(N, n0 + nbk);
      const int64_t m0 = mb * mbk, m1 = std::min(M, m0 + mbk);
      linear_block<XT, XT>(xs.data(), kp, wp, bp, op, K, N, m0, m1, n0, n1);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// attention

constexpr int KT = 16;  // keys per tile (tiles start at absolute positions 16 t)
constexpr int QT = 16;  // query tokens per work item of a prefill chunk

struct AttnArgs {
  int64_t Hq, Hkv, D, Dp, BS, max_blocks, kv_block_stride;
  float scale, soft_cap;
  int64_t window;
};

// Queries i0 .. i1 - 1 of one request (query i at position ctx + i) against kv head h: out rows.
template <typename CT>
void attend(const CT* q, const CT* kv, const int64_t* bt, int64_t ctx, int64_t i0, int64_t i1, int64_t h,
            const AttnArgs& a, CT* out, std::vector<float>& buf) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, Dp = a.Dp;
  const int64_t R = (i1 - i0) * G;
  constexpr int L = V::L;
  // scratch: qs [R, Dp], acc [R, Dp], m [R], l [R], started [R], kt/vt [KT, Dp]
  const size_t need = static_cast<size_t>(2 * R * Dp + 2 * R + R + 2 * KT * Dp);
  if (buf.size() < need) buf.resize(need);
  float* qs = buf.data();
  float* acc = qs + R * Dp;
  float* mrow = acc + R * Dp;
  float* lrow = mrow + R;
  float* started = lrow + R;
  float* kt = started + R;
  float* vt = kt + KT * Dp;
  std::fill(qs, qs + 2 * R * Dp + 3 * R, 0.f);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = i0 + r / G, head = h * G + r % G;
    const CT* qr = q + (i * a.Hq + head) * D;
    float* dst = qs + r * Dp;
    to_float_row(qr, dst, D);
    for (int64_t d = 0; d < D; ++d) dst[d] = dst[d] * a.scale;
  }
  const int64_t tok_stride = a.Hkv * D, v_offset = a.BS * a.Hkv * D;
  const int64_t last = ctx + i1 - 1;
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, ctx + i0 - a.window + 1) : 0;
  for (int64_t k0 = first / KT * KT; k0 <= last; k0 += KT) {
    const int64_t nk = std::min<int64_t>(KT, last + 1 - k0);
    for (int64_t j = 0; j < KT; ++j) {
      float* kd = kt + j * Dp;
      float* vd = vt + j * Dp;
      if (j < nk) {
        const int64_t p = k0 + j;
        const CT* kr = kv + bt[p / a.BS] * a.kv_block_stride + (p % a.BS) * tok_stride + h * D;
        to_float_row(kr, kd, D);
        to_float_row(kr + v_offset, vd, D);
      } else {
        std::fill(kd, kd + D, 0.f);
        std::fill(vd, vd + D, 0.f);
      }
      std::fill(kd + D, kd + Dp, 0.f);
      std::fill(vd + D, vd + Dp, 0.f);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t qpos = ctx + i0 + r / G;
      const int64_t hi = std::min<int64_t>(nk - 1, qpos - k0);
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, qpos - a.window + 1 - k0) : 0;
      if (hi < lo) continue;
      // scores of keys 0 .. 15 (those past hi are not used)
      alignas(64) float s[KT];
      const float* qr = qs + r * Dp;
      for (int j0 = 0; j0 <= hi; j0 += 8) {
        typename V::T sacc[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) sacc[j] = V::zero();
        for (int64_t d = 0; d < Dp; d += L) {
          const typename V::T qv = V::load(qr + d);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) sacc[j] = V::fma(qv, V::load(kt + (j0 + j) * Dp + d), sacc[j]);
        }
        V8 f[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) f[j] = V::fold8(sacc[j]);
        reduce8(f, s + j0);
      }
      if (a.soft_cap > 0.f)
        for (int64_t j = lo; j <= hi; ++j) s[j] = a.soft_cap * std::tanh(s[j] / a.soft_cap);
      float mt = s[lo];
      for (int64_t j = lo + 1; j <= hi; ++j) mt = std::max(mt, s[j]);
      float& m = mrow[r];
      float& l = lrow[r];
      float corr = 0.f;
      float mnew = mt;
      if (started[r] != 0.f) {
        mnew = std::max(m, mt);
        corr = bi_exp(m - mnew);
      }
      alignas(64) float p[KT];
      for (int64_t j = lo; j <= hi; ++j) p[j] = bi_exp(s[j] - mnew);
      float psum = 0.f;
      for (int64_t j = lo; j <= hi; ++j) psum = psum + p[j];
      l = l * corr + psum;
      m = mnew;
      started[r] = 1.f;
      float* ar = acc + r * Dp;
      const typename V::T vc = V::set1(corr);
      for (int64_t d = 0; d < Dp; d += L) {
        typename V::T av = V::mul(V::load(ar + d), vc);
        for (int64_t j = lo; j <= hi; ++j) av = V::fma(V::set1(p[j]), V::load(vt + j * Dp + d), av);
        V::store(ar + d, av);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = i0 + r / G, head = h * G + r % G;
    float* ar = acc + r * Dp;
    const float inv = lrow[r] > 0.f ? 1.f / lrow[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) ar[d] = ar[d] * inv;
    from_float_row(ar, out + (i * a.Hq + head) * D, D);
  }
}

template <typename CT>
void attention_impl(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                    const at::Tensor& qsl, const at::Tensor& seq_lens, const AttnArgs& a, at::Tensor& out) {
  const int64_t B = seq_lens.size(0);
  const int64_t* qs = qsl.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  struct Item { int64_t b, i0, i1, h; };
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qs[b + 1] - qs[b];
    for (int64_t i0 = 0; i0 < n; i0 += QT)
      for (int64_t h = 0; h < a.Hkv; ++h) items.push_back({b, i0, std::min(n, i0 + QT), h});
  }
  const CT* qp = reinterpret_cast<const CT*>(q.data_ptr());
  const CT* kvp = reinterpret_cast<const CT*>(kv_cache.data_ptr());
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  CT* op = reinterpret_cast<CT*>(out.data_ptr());
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += (qs[b + 1] - qs[b]) * sl[b];
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t grain = work * a.Hq * a.D < (1 << 17) ? std::max<int64_t>(1, n_items) : 1;
  at::parallel_for(0, n_items, grain, [&](int64_t b0, int64_t e0) {
    std::vector<float> buf;
    for (int64_t t = b0; t < e0; ++t) {
      const Item& it = items[t];
      const int64_t n = qs[it.b + 1] - qs[it.b];
      const int64_t ctx = sl[it.b] - n;
      attend<CT>(qp + qs[it.b] * a.Hq * a.D, kvp, bt + it.b * a.max_blocks, ctx, it.i0, it.i1, it.h, a,
                 op + qs[it.b] * a.Hq * a.D, buf);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// act_mul

inline float act(float x, int64_t kind) {
  if (kind == 0) return x / (1.f + bi_exp(-x));  // SiLU
  if (kind == 1) {  // GELU, tanh approximation: tanh(y) = 1 - 2 / (exp(2 y) + 1)
    const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float th = 1.f - 2.f / (bi_exp(2.f * y) + 1.f);
    return 0.5f * x * (1.f + th);
  }
  return 0.5f * x * (1.f + std::erf(x * 0.7071067811865476f));  // GELU (erf)
}

template <typename T>
void act_mul_impl(const T* gu, T* out, int64_t M, int64_t I, int64_t kind) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> g(I), u(I);
    for (int64_t m = b; m < e; ++m) {
      to_float_row(gu + m * 2 * I, g.data(), I);
      to_float_row(gu + m * 2 * I + I, u.data(), I);
      for (int64_t i = 0; i < I; ++i) g[i] = act(g[i], kind) * u[i];
      from_float_row(g.data(), out + m * I, I);
    }
  });
}

void check_float_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

}  // namespace

at::Tensor bi_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x [M, K] and w [N, K] expected, got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "linear: w dtype ", w.scalar_type(), " != x dtype ", x.scalar_type());
  x = x.contiguous();
  w = w.contiguous();
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == w.size(0) && bias->scalar_type() == x.scalar_type(), "linear: bias must be [N] of x's dtype");
    bias = bias->contiguous();
  }
  if (x.scalar_type() == at::kFloat) return linear_impl<float>(x, w, bias);
  return linear_impl<uint16_t>(x, w, bias);
}

at::Tensor bi_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables, at::Tensor query_start_loc,
                        at::Tensor seq_lens, double scale, int64_t window, double soft_cap) {
  check_float_or_bf16(q, "q");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.is_contiguous(), "attention: q [T, Hq, D] and a contiguous "
              "kv_cache [NB, 2, BS, Hkv, D] expected");
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type(), "attention: kv_cache dtype ", kv_cache.scalar_type(),
              " != q dtype ", q.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong, "attention: block_tables, query_start_loc, seq_lens must be int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  query_start_loc = query_start_loc.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = seq_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == B + 1 && block_tables.dim() == 2 && block_tables.size(0) >= B,
              "attention: query_start_loc [B + 1] and block_tables [B, n] expected");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = kv_cache.size(3), BS = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(4) == D && Hkv > 0 && Hq % Hkv == 0, "attention: head shapes");
  const int64_t* qs = query_start_loc.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[B] == q.size(0), "attention: query_start_loc must run from 0 to T");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qs[b + 1] - qs[b];
    TORCH_CHECK(n >= 0 && sl[b] >= n, "attention: request ", b, " has ", n, " queries but seq_len ", sl[b]);
    TORCH_CHECK(sl[b] <= block_tables.size(1) * BS, "attention: block table of request ", b, " too short");
  }
  AttnArgs a{Hq, Hkv, D, round_up(D, V::L), BS, block_tables.size(1), kv_cache.stride(0),
             static_cast<float>(scale), static_cast<float>(soft_cap), window};
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) attention_impl<float>(q, kv_cache, block_tables, query_start_loc, seq_lens, a, out);
  else attention_impl<uint16_t>(q, kv_cache, block_tables, query_start_loc, seq_lens, a, out);
  return out;
}

at::Tensor bi_act_mul(at::Tensor gu, int64_t kind) {
  check_float_or_bf16(gu, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "act_mul: gu [M, 2I] expected, got ", gu.sizes());
  TORCH_CHECK(kind >= 0 && kind <= 2, "act_mul: kind must be 0 (silu), 1 (gelu_tanh) or 2 (gelu)");
  gu = gu.contiguous();
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({M, I}, gu.options());
  if (gu.scalar_type() == at::kFloat)
    act_mul_impl<float>(gu.data_ptr<float>(), out.data_ptr<float>(), M, I, kind);
  else
    act_mul_impl<uint16_t>(reinterpret_cast<const uint16_t*>(gu.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                           M, I, kind);
  return out;
}

std::string bi_isa() {
#if defined(BI_X86) && defined(__AVX512F__)
  return "avx512";
#elif defined(BI_X86)
  return "avx2";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &bi_linear, "batch-invariant x @ w.T + bias (float32 / bf16)", py::call_guard<py::gil_scoped_release>(),
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("attention", &bi_attention, "batch-invariant paged attention over a step's decodes and prefill chunks",
        py::call_guard<py::gil_scoped_release>(), py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("window"), py::arg("soft_cap"));
  m.def("act_mul", &bi_act_mul, "act(gate) * up, row-wise (0 silu, 1 gelu_tanh, 2 gelu)",
        py::call_guard<py::gil_scoped_release>(), py::arg("gu"), py::arg("kind"));
  m.def("isa", &bi_isa, "the vector width the module was built for: avx512, avx2 or generic");
}
