// int8 x int8 -> int32 GEMM for small M (decode batches) with AVX512-VNNI, on weights packed once.
//
//   int8_gemm_packed(x int8 [M, K], packed int8 [NB, KQ, 64], comp int32 [NB * 16], N) -> int32 [M, N]
//
// computes out[m, n] = sum_k x[m, k] * w[n, k] exactly (the same integers as torch._int_mm(x, w.t())).
//
//   int8_gemm_packed_dequant(x, packed, comp, N, sx f32 [M], sw f32 [N], bias? [N], dtype) -> [M, N]
//
// is the same GEMM with W8A8's dequantization as its epilogue: out = float(acc) * (sx[m] * sw[n])
// (+ bias[n]) in float32 or bfloat16 (round to nearest even), bit-identical to dequant_int32
// (quant_ops.cpp) applied to int8_gemm_packed's output, without the int32 [M, N] round trip.
//
// Layout (built by pagedllm.quantization.w8a8.pack_int8_weight): the weight w [N, K] is padded with
// zeros to NB = ceil(N / 16) blocks of 16 output columns and KQ = ceil(K / 4) groups of 4 k, and
// stored as packed[nb, kq, 4 * j + i] = w[16 nb + j, 4 kq + i]: one 64-byte row holds what one
// vpdpbusd needs for 16 columns, and each block of 16 columns is one contiguous stream.
//
// vpdpbusd multiplies unsigned by signed bytes, so x is shifted to u = x + 128 (x ^ 0x80) and the
// excess removed with comp[n] = 128 * sum_k w[n, k]: sum_k u w = sum_k x w + comp[n]. Sums cannot
// overflow int32 for K < 2^16 (|u w| <= 255 * 128 per product).
//
// Why: torch._int_mm (oneDNN) streamed the SmolLM2 decode weights at 7-13 GB/s for M = 1..16 and
// reached ~480 GOP/s at M = 64; this kernel keeps a 6 x 64 tile of accumulators in registers
// (the accumulation is written as inline asm because GCC 12 copies the intrinsic's accumulator
// through extra registers) and was 1.3-2x faster for M <= 256
// (benchmarks/results/performance-history-2026-11.md, step 18).
// Above that oneDNN is as fast or faster, and pagedllm calls it instead.
#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <array>
#include <type_traits>
#include <vector>

#include "cpu_utils.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDLLM_HAVE_VNNI 1
#endif

bool int8_gemm_supported() {
#ifdef PAGEDLLM_HAVE_VNNI
  return true;
#else
  return false;
#endif
}

#ifdef PAGEDLLM_HAVE_VNNI
namespace {

constexpr int kMR = 6;   // rows of x per tile
constexpr int kNR = 4;   // 16-column blocks per tile (64 columns)
constexpr int kPrefetch = 1024;  // bytes ahead in each weight stream
constexpr int kTallMax = 16;    // batches of kMR+1 .. kTallMax rows use the tall tile

inline __attribute__((always_inline)) void dpbusd(__m512i& acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
}

#define PL_FOR_J(X, i) X(i, 0) X(i, 1) X(i, 2) X(i, 3)
#define PL_FOR_IJ(X) PL_FOR_J(X, 0) PL_FOR_J(X, 1) PL_FOR_J(X, 2) PL_FOR_J(X, 3) PL_FOR_J(X, 4) PL_FOR_J(X, 5)

// The dequantization epilogue's operands, offset to the tile's first row and column (sx null:
// the tile stores int32 sums).
struct Dequant {
  const float* sx;    // [rows] row scales
  const float* sw;    // [cols] column scales
  const float* bias;  // [cols] or null
};

// Stores 16 columns of one row (mask mk): int32 as is, or dequantized and stored by the same
// helpers as dequant_int32 (cpu_utils.h: dequant16, store16), hence the same bits.
template <typename OutT>
inline __attribute__((always_inline)) void store16(OutT* dst, __m512i acc, __mmask16 mk, float sm, const float* sw,
                                                   const float* bias) {
  if constexpr (std::is_same_v<OutT, int32_t>) {
    _mm512_mask_storeu_epi32(dst, mk, acc);
  } else {
    pagedllm_cpu::store16(dst, pagedllm_cpu::dequant16(acc, sm, sw, bias, mk), mk);
  }
}

// One tile: MR rows of u (row stride lda bytes) times NR 16-column blocks starting at b; stores
// the first ncols columns of the MR x (16 NR) result at c (row stride ldc), as int32 sums or
// dequantized with dq.
template <int MR, int NR, typename OutT>
void tile(const uint8_t* __restrict a, int64_t lda, const int8_t* __restrict b, int64_t KQ,
          const int32_t* __restrict comp, OutT* __restrict c, int64_t ldc, int64_t ncols, Dequant dq) {
#define PL_DECL(i, j) __m512i c##i##j = _mm512_setzero_si512();
  PL_FOR_IJ(PL_DECL)
#undef PL_DECL
  const int64_t bs = KQ * 64;  // bytes between consecutive 16-column blocks
  const int8_t* b0 = b;
  const int8_t* b1 = b + bs;
  const int8_t* b2 = b + 2 * bs;
  const int8_t* b3 = b + 3 * bs;
  for (int64_t kq = 0; kq < KQ; ++kq) {
    const int64_t o = kq * 64;
    __m512i w0, w1, w2, w3;
    _mm_prefetch(reinterpret_cast<const char*>(b0 + o + kPrefetch), _MM_HINT_T0);
    w0 = _mm512_loadu_si512(b0 + o);
    if constexpr (NR > 1) {
      _mm_prefetch(reinterpret_cast<const char*>(b1 + o + kPrefetch), _MM_HINT_T0);
      w1 = _mm512_loadu_si512(b1 + o);
    }
    if constexpr (NR > 2) {
      _mm_prefetch(reinterpret_cast<const char*>(b2 + o + kPrefetch), _MM_HINT_T0);
      w2 = _mm512_loadu_si512(b2 + o);
    }
    if constexpr (NR > 3) {
      _mm_prefetch(reinterpret_cast<const char*>(b3 + o + kPrefetch), _MM_HINT_T0);
      w3 = _mm512_loadu_si512(b3 + o);
    }
#define PL_STEP(i, j) if constexpr (i < MR && j < NR) dpbusd(c##i##j, x##i, w##j);
#define PL_ROW(i)                                                                                  \
  if constexpr (i < MR) {                                                                        \
    const __m512i x##i = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + i * lda + kq * 4)); \
    PL_FOR_J(PL_STEP, i)                                                                         \
  }
    PL_ROW(0) PL_ROW(1) PL_ROW(2) PL_ROW(3) PL_ROW(4) PL_ROW(5)
#undef PL_ROW
#undef PL_STEP
  }
#define PL_STORE(i, j)                                                                                    \
  if constexpr (i < MR && j < NR) {                                                                      \
    const int64_t rem = ncols - j * 16;                                                                  \
    const __mmask16 mk = pagedllm_cpu::tail_mask(rem);                                                  \
    store16<OutT>(c + i * ldc + j * 16, _mm512_sub_epi32(c##i##j, _mm512_loadu_si512(comp + j * 16)), mk,      \
                  dq.sx != nullptr ? dq.sx[i] : 0.f, dq.sw != nullptr ? dq.sw + j * 16 : nullptr,                \
                  dq.bias != nullptr ? dq.bias + j * 16 : nullptr);                                             \
  }
  PL_FOR_IJ(PL_STORE)
#undef PL_STORE
}

#undef PL_FOR_IJ
#undef PL_FOR_J

// A tall tile for 7..16 rows: MR rows x one 16-column block, so a batch of up to 16 rows
// streams each weight block once (the 6 x 64 tiles stream it once per 6 rows and run the later
// row tiles from cache after the stream, without overlapping the two).
#define PL_FOR_T(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

template <int MR, typename OutT>
void tile_tall(const uint8_t* __restrict a, int64_t lda, const int8_t* __restrict b, int64_t KQ,
               const int32_t* __restrict comp, OutT* __restrict c, int64_t ldc, int64_t ncols, Dequant dq) {
#define PL_DECL(i) __m512i c##i = _mm512_setzero_si512();
  PL_FOR_T(PL_DECL)
#undef PL_DECL
  for (int64_t kq = 0; kq < KQ; ++kq) {
    const int64_t o = kq * 64;
    _mm_prefetch(reinterpret_cast<const char*>(b + o + kPrefetch), _MM_HINT_T0);
    const __m512i w = _mm512_loadu_si512(b + o);
#define PL_STEP(i)                                                                                       \
  if constexpr (i < MR) {                                                                              \
    dpbusd(c##i, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + i * lda + kq * 4)), w);      \
  }
    PL_FOR_T(PL_STEP)
#undef PL_STEP
  }
  const __mmask16 mk = pagedllm_cpu::tail_mask(ncols);
  const __m512i cv = _mm512_loadu_si512(comp);
#define PL_STORE(i)                                                                                      \
  if constexpr (i < MR) {                                                                              \
    store16<OutT>(c + i * ldc, _mm512_sub_epi32(c##i, cv), mk, dq.sx != nullptr ? dq.sx[i] : 0.f, dq.sw, \
                  dq.bias);                                                                            \
  }
  PL_FOR_T(PL_STORE)
#undef PL_STORE
}
#undef PL_FOR_T

template <typename OutT>
void tile_tall_any(int mr, const uint8_t* a, int64_t lda, const int8_t* b, int64_t KQ, const int32_t* comp,
                   OutT* c, int64_t ldc, int64_t ncols, Dequant dq) {
  switch (mr) {
#define PL_CASE(R) case R: tile_tall<R>(a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
    PL_CASE(7) PL_CASE(8) PL_CASE(9) PL_CASE(10) PL_CASE(11) PL_CASE(12) PL_CASE(13) PL_CASE(14) PL_CASE(15)
    default: tile_tall<16>(a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
#undef PL_CASE
  }
}

template <int MR, typename OutT>
void tile_nr(int nr, const uint8_t* a, int64_t lda, const int8_t* b, int64_t KQ, const int32_t* comp,
             OutT* c, int64_t ldc, int64_t ncols, Dequant dq) {
  switch (nr) {
    case 4: tile<MR, 4>(a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
    case 3: tile<MR, 3>(a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
    case 2: tile<MR, 2>(a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
    default: tile<MR, 1>(a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
  }
}

template <typename OutT>
void tile_any(int mr, int nr, const uint8_t* a, int64_t lda, const int8_t* b, int64_t KQ, const int32_t* comp,
              OutT* c, int64_t ldc, int64_t ncols, Dequant dq) {
  switch (mr) {
    case 6: tile_nr<6>(nr, a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
    case 5: tile_nr<5>(nr, a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
    case 4: tile_nr<4>(nr, a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
    case 3: tile_nr<3>(nr, a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
    case 2: tile_nr<2>(nr, a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
    default: tile_nr<1>(nr, a, lda, b, KQ, comp, c, ldc, ncols, dq); break;
  }
}

// The GEMM into c [M, N] (OutT int32: the sums; float / bf16: dequantized with dq, which holds
// the full sx [M], sw [N], bias [N] here).
template <typename OutT>
void gemm_packed(const int8_t* x, int64_t M, int64_t K, const int8_t* b, int64_t NB, int64_t KQ, const int32_t* cp,
                 int64_t N, OutT* c, Dequant dq) {
  // u = x + 128 as bytes, rows padded to 4 KQ with 128 (the padded weights are 0).
  const int64_t lda = KQ * 4;
  std::vector<uint8_t> ubuf(M * lda);
  uint8_t* u = ubuf.data();
  const uint8_t* xs = reinterpret_cast<const uint8_t*>(x);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) u[m * lda + k] = xs[m * K + k] ^ 0x80u;
    for (int64_t k = K; k < lda; ++k) u[m * lda + k] = 128u;
  }
  if (M > kMR && M <= kTallMax) {  // one tall tile per 16-column block: the weights stream once
    at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const Dequant t{dq.sx, dq.sw != nullptr ? dq.sw + nb * 16 : nullptr,
                        dq.bias != nullptr ? dq.bias + nb * 16 : nullptr};
        tile_tall_any(static_cast<int>(M), u, lda, b + nb * KQ * 64, KQ, cp + nb * 16, c + nb * 16, N,
                      std::min<int64_t>(16, N - nb * 16), t);
      }
    });
    return;
  }
  // Threads split the 16-column blocks evenly; each walks its blocks kNR at a time and, for each
  // group, every kMR-row tile of x (the group's weights stay in L1/L2 across the row tiles).
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; nb += kNR) {
      const int nr = static_cast<int>(std::min<int64_t>(kNR, nb1 - nb));
      const int64_t ncols = std::min<int64_t>(nr * 16, N - nb * 16);
      for (int64_t m = 0; m < M; m += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, M - m));
        const Dequant t{dq.sx != nullptr ? dq.sx + m : nullptr, dq.sw != nullptr ? dq.sw + nb * 16 : nullptr,
                        dq.bias != nullptr ? dq.bias + nb * 16 : nullptr};
        tile_any(mr, nr, u + m * lda, lda, b + nb * KQ * 64, KQ, cp + nb * 16, c + m * N + nb * 16, N, ncols, t);
      }
    }
  });
}

}  // namespace
#endif  // PAGEDLLM_HAVE_VNNI

namespace {

// Shape and dtype checks shared by both entry points; returns {M, K, NB, KQ}.
std::array<int64_t, 4> check_packed(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& comp, int64_t N) {
  TORCH_CHECK(int8_gemm_supported(), "int8_gemm_packed: this build has no AVX512-VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar && x.is_contiguous(),
              "x must be a contiguous int8 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64 && packed.scalar_type() == at::kChar &&
              packed.is_contiguous(), "packed must be a contiguous int8 [NB, KQ, 64] tensor");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KQ = packed.size(1);
  TORCH_CHECK(KQ == (K + 3) / 4, "packed has ", KQ, " groups of 4 k, x has K=", K);
  TORCH_CHECK(N > 0 && (N + 15) / 16 == NB, "N=", N, " does not match ", NB, " packed 16-column blocks");
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.is_contiguous() && comp.numel() == NB * 16,
              "comp must be a contiguous int32 [NB * 16] tensor");
  return {M, K, NB, KQ};
}

}  // namespace

at::Tensor int8_gemm_packed(at::Tensor x, at::Tensor packed, at::Tensor comp, int64_t N) {
  const auto [M, K, NB, KQ] = check_packed(x, packed, comp, N);
  auto out = at::empty({M, N}, x.options().dtype(at::kInt));
#ifdef PAGEDLLM_HAVE_VNNI
  if (M > 0)
    gemm_packed<int32_t>(x.data_ptr<int8_t>(), M, K, packed.data_ptr<int8_t>(), NB, KQ, comp.data_ptr<int32_t>(), N,
                         out.data_ptr<int32_t>(), Dequant{nullptr, nullptr, nullptr});
#endif
  return out;
}

at::Tensor int8_gemm_packed_dequant(at::Tensor x, at::Tensor packed, at::Tensor comp, int64_t N, at::Tensor sx,
                                   at::Tensor sw, c10::optional<at::Tensor> bias, at::ScalarType dtype) {
  const auto [M, K, NB, KQ] = check_packed(x, packed, comp, N);
  const at::Tensor b = pagedllm_cpu::check_dequant_operands(sx, sw, bias, dtype, M, N);
  auto out = at::empty({M, N}, x.options().dtype(dtype));
#ifdef PAGEDLLM_HAVE_VNNI
  if (M > 0) {
    const Dequant dq{sx.data_ptr<float>(), sw.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr};
    if (dtype == at::kFloat)
      gemm_packed<float>(x.data_ptr<int8_t>(), M, K, packed.data_ptr<int8_t>(), NB, KQ, comp.data_ptr<int32_t>(), N,
                         out.data_ptr<float>(), dq);
    else
      gemm_packed<at::BFloat16>(x.data_ptr<int8_t>(), M, K, packed.data_ptr<int8_t>(), NB, KQ, comp.data_ptr<int32_t>(),
                                N, out.data_ptr<at::BFloat16>(), dq);
  }
#endif
  return out;
}

// ---- int8 x int8 -> int32 GEMM on the plain [N, K] weight, AVX2 (CPUs without AVX512-VNNI) ----
//
//   int8_gemm_nk(x int8 [M, K], w int8 [N, K]) -> int32 [M, N],  out[m, n] = sum_k x[m, k] w[n, k]
//
// the same exact integers as torch._int_mm(x, w.t()), which on CPUs without VNNI runs ATen's
// reference loop (measured on Zen 1: 88% of a W8A8 400-token prefill, 40 s against 3.6 s for the
// float32 model). Per 32 k: vpmaddubsw(|w|, sign(x, w)) multiplies |w| (unsigned) by x with w's
// sign, pairs summed into int16 lanes (|pair| <= 2 * 128 * 127 < 2^15: exact, no saturation, for
// w in -128..127 and x in -127..127, the range W8A8's quantize_rows writes), then vpmaddwd against
// ones into int32. A register tile of MR rows x NR columns keeps MR * NR int32 accumulators; one
// transposing hadd tree per tile reduces them. Blocks: 64 columns x 64 rows, so a block of w and
// of x stays in L2 while the tiles pass over it. Threads split the columns.
bool int8_gemm_nk_supported() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX2__)
#include <immintrin.h>
namespace {

// lanes of the 8 sums of a[0..7] (each a vector of 8 int32 partial sums), in order
inline __m256i hsum8x8(const __m256i* a) {
  const __m256i t0 = _mm256_hadd_epi32(a[0], a[1]), t1 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i t2 = _mm256_hadd_epi32(a[4], a[5]), t3 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// out[i, j] (row stride ldo) = x row i (stride K) . w row j (stride K), i < MR, j < NR
// pf: the next tile's weight rows (pfl lines from it), prefetched a few lines per 32 k: the rows are
// NR interleaved streams, which the hardware prefetcher follows poorly when they come from DRAM
// (decode); nullptr: no prefetch
template <int MR, int NR>
void nk_tile(const int8_t* __restrict x, const int8_t* __restrict w, int64_t K, int32_t* __restrict out, int64_t ldo,
             const char* pf = nullptr, int64_t pfl = 0) {
  static_assert(MR * NR <= 8, "at most 8 accumulators");
  __m256i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t K32 = K & ~int64_t{31};
  const int64_t per = K32 ? (pfl * 32 + K32 - 1) / K32 : 0;  // lines per iteration
  for (int64_t k = 0, l = 0; k < K32; k += 32) {
    if (pf)
      for (const int64_t e = std::min(pfl, l + per); l < e; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    __m256i wv[NR], wa[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
      wa[j] = _mm256_abs_epi8(wv[j]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * K + k));
      for (int j = 0; j < NR; ++j)
        acc[i * NR + j] = _mm256_add_epi32(
            acc[i * NR + j], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(xv, wv[j])), ones));
    }
  }
  alignas(32) int32_t s[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(s), hsum8x8(acc));
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      int32_t v = s[i * NR + j];
      for (int64_t k = K32; k < K; ++k) v += static_cast<int32_t>(x[i * K + k]) * w[j * K + k];
      out[i * ldo + j] = v;
    }
}

// rows of x against NR weight rows; the first tile prefetches the next NR weight rows (up to w_end)
template <int NR>
void nk_rows(const int8_t* x, const int8_t* w, int64_t K, int32_t* out, int64_t ldo, int64_t rows,
             const int8_t* w_end) {
  constexpr int MR = NR == 2 ? 4 : 2;
  const int8_t* nw = w + NR * K;
  const char* pf = nw < w_end ? reinterpret_cast<const char*>(nw) : nullptr;
  const int64_t pfl = pf ? (std::min<int64_t>(NR * K, w_end - nw) + 63) / 64 : 0;
  int64_t i = 0;
  for (; i + MR <= rows; i += MR) nk_tile<MR, NR>(x + i * K, w, K, out + i * ldo, ldo, i ? nullptr : pf, pfl);
  for (; i < rows; ++i) nk_tile<1, NR>(x + i * K, w, K, out + i * ldo, ldo, i ? nullptr : pf, pfl);
}

}  // namespace
#endif

at::Tensor int8_gemm_nk(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous int8 [M, K] CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.device().is_cpu(),
              "w must be a contiguous int8 [N, K] CPU tensor");
  TORCH_CHECK(w.size(1) == x.size(1), "x has K=", x.size(1), ", w has K=", w.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, x.options().dtype(at::kInt));
#if defined(__AVX2__)
  if (M == 0 || N == 0) return out;
  const int8_t* xp = x.data_ptr<int8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  // decode-sized M: 4 columns per tile (2 rows), else 2 columns x 4 rows
  const bool narrow = M < 4;
  constexpr int64_t kBlock = 64;
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t n0 = nb * kBlock, n1 = std::min(N, n0 + kBlock);
      for (int64_t m0 = 0; m0 < M; m0 += kBlock) {
        const int64_t rows = std::min(M, m0 + kBlock) - m0;
        int64_t n = n0;
        const int8_t* w_end = wp + b1 * kBlock * K < wp + N * K ? wp + b1 * kBlock * K : wp + N * K;
        if (narrow)
          for (; n + 4 <= n1; n += 4) nk_rows<4>(xp + m0 * K, wp + n * K, K, op + m0 * N + n, N, rows, w_end);
        for (; n + 2 <= n1; n += 2) nk_rows<2>(xp + m0 * K, wp + n * K, K, op + m0 * N + n, N, rows, w_end);
        for (; n < n1; ++n) {
          for (int64_t i = 0; i < rows; ++i) nk_tile<1, 1>(xp + (m0 + i) * K, wp + n * K, K, op + (m0 + i) * N + n, N);
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "int8_gemm_nk: built without AVX2");
  return out;
#endif
}
