// Paged attention for one-token decodes on CPU, reading K/V straight from the block table
// (no gather into a contiguous copy). Layout: kv_cache [num_blocks, 2, block_size, Hkv, D].
// Per (request, kv head): scores for the G = Hq/Hkv query heads over the request's context,
// float32 softmax, then the weighted sum of V. Same math as pagedllm.attention.torch_paged.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <limits>

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

// One (request, kv head) work item. DIM > 0 fixes the head size at compile time (full
// unrolling and vectorization of the d loops); DIM == 0 handles any head size.
template <int DIM, typename scalar_t>
static void decode_one(const scalar_t* q, const scalar_t* kv, const int64_t* bt, int64_t L, int64_t b,
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
    const scalar_t* kp = kv + bt[p / block_size] * kv_block_stride + (p % block_size) * tok_stride + h * D;
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
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict sg = scores.data() + g * n;
    float m = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) m = sg[i] > m ? sg[i] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      const float e = std::exp(sg[i] - m);
      sg[i] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
  }
  // Pass 2: weighted sum of V.
  std::fill(acc.begin(), acc.begin() + G * D, 0.f);
  for (int64_t p = first; p < L; ++p) {
    const scalar_t* vp = kv + bt[p / block_size] * kv_block_stride + v_offset + (p % block_size) * tok_stride + h * D;
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

template <typename scalar_t>
static void decode_kernel(const scalar_t* q, const scalar_t* kv, const int64_t* block_tables,
                          const int64_t* seq_lens, scalar_t* out, int64_t B, int64_t Hq, int64_t Hkv,
                          int64_t D, int64_t block_size, int64_t max_blocks, int64_t kv_block_stride,
                          float scale, int64_t window, float soft_cap) {
  const int64_t G = Hq / Hkv;
  const int64_t tok_stride = Hkv * D;              // between tokens inside a block
  const int64_t v_offset = block_size * Hkv * D;   // K -> V inside a block
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), kf(D), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv;
      const int64_t* bt = block_tables + b * max_blocks;
#define PAGEDLLM_DECODE(DIMV)                                                                       \
  decode_one<DIMV, scalar_t>(q, kv, bt, seq_lens[b], b, h, out, Hq, G, D, block_size, kv_block_stride, \
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

// q: [B, Hq, D]; kv_cache: [NB, 2, BS, Hkv, D] (same dtype as q); block_tables: int64 [B, M];
// seq_lens: int64 [B] (context length incl. the new token). window <= 0: none; soft_cap <= 0: none.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "bad ranks");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hq % Hkv == 0, "head shapes");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
                            seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, Hq, Hkv, D, BS,
                            block_tables.size(1), kv_cache.stride(0), (float)scale, window, (float)soft_cap);
  });
  return out;
}

