// Python bindings of the CPU kernels (one extension module, built by pagedllm/kernels/cpu_ops.py).
#include "torch_lite.h"
#include <torch/csrc/utils/pybind.h>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double soft_cap);
bool prefill_supported(torch::Tensor q);
bool kv_fp8_supported(torch::Tensor q);
bool kv_half_f32_supported();
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                                      int64_t q_offset, double scale, int64_t window, double soft_cap);
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(at::Tensor x);
std::tuple<at::Tensor, at::Tensor> rms_norm_quant(at::Tensor x, c10::optional<at::Tensor> residual,
                                                   at::Tensor weight, double eps);
at::Tensor dequant_int32(at::Tensor acc, at::Tensor sx, at::Tensor sw, c10::optional<at::Tensor> bias,
                         at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor> dequant_silu_mul_quant(at::Tensor acc, at::Tensor sx, at::Tensor sw);
void rotary_inplace(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos, at::Tensor sin);
void reshape_and_cache(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slots);
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gu);
bool int8_gemm_supported();
bool int8_gemm_nk_supported();
at::Tensor int8_gemm_nk(at::Tensor x, at::Tensor w);
at::Tensor int8_gemm_packed(at::Tensor x, at::Tensor packed, at::Tensor comp, int64_t N);
at::Tensor int8_gemm_packed_dequant(at::Tensor x, at::Tensor packed, at::Tensor comp, int64_t N, at::Tensor sx,
                                   at::Tensor sw, c10::optional<at::Tensor> bias, at::ScalarType dtype);
bool install_cpu_allocator(int64_t min_bytes, int64_t max_cached_bytes, bool huge_pages);
std::unordered_map<std::string, int64_t> cpu_allocator_stats();
void cpu_allocator_empty_cache();
at::Tensor llama_decode_w8a8(at::Tensor x, at::Tensor positions, const TensorList& layers,
                             std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor cos, at::Tensor sin, at::Tensor final_norm,
                             std::vector<int64_t> windows, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, double scale, double eps);
at::Tensor llama_decode_dense(at::Tensor x, at::Tensor positions, const TensorList& layers,
                              std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor block_tables,
                              at::Tensor seq_lens, at::Tensor cos, at::Tensor sin, at::Tensor final_norm,
                              std::vector<int64_t> windows, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, double scale, double eps, bool packed);
at::Tensor llama_decode_group(at::Tensor x, at::Tensor positions, const TensorList& layers,
                              std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor block_tables,
                              at::Tensor seq_lens, at::Tensor cos, at::Tensor sin, at::Tensor final_norm,
                              std::vector<int64_t> windows, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, double scale, double eps, std::vector<int64_t> modes,
                              int64_t group_fn, int64_t intdot_fn, int64_t large_m, int64_t isa,
                              int64_t intdot_max_m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("prefill_supported", &prefill_supported, "whether paged_prefill_attention handles q here");
  m.def("kv_half_f32_supported", &kv_half_f32_supported,
        "whether paged_decode_attention / reshape_and_cache take a bf16/fp16 cache with float32 q/k/v");
  m.def("kv_fp8_supported", &kv_fp8_supported,
        "whether the attention kernels read an fp8 (float8_e4m3fn / float8_e5m2) KV cache for this q");
  m.def("paged_prefill_attention", &paged_prefill_attention, "causal paged prefill attention (CPU, bf16)", py::call_guard<py::gil_scoped_release>());
  m.def("quantize_rows_int8", &quantize_rows_int8, "per-row symmetric int8 quantization", py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_quant", &rms_norm_quant, "[residual add +] RMSNorm + per-row int8 quantization", py::call_guard<py::gil_scoped_release>(),
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("dequant_int32", &dequant_int32, "int32 GEMM accumulators -> float with row/column scales", py::call_guard<py::gil_scoped_release>(),
        py::arg("acc"), py::arg("sx"), py::arg("sw"), py::arg("bias"), py::arg("dtype"));
  m.def("dequant_silu_mul_quant", &dequant_silu_mul_quant, "dequantize gate|up, silu(gate)*up, quantize", py::call_guard<py::gil_scoped_release>());
  m.def("rotary_inplace", &rotary_inplace, "NeoX-style rope applied to q and k in place", py::call_guard<py::gil_scoped_release>());
  m.def("reshape_and_cache", &reshape_and_cache, "store k/v rows at flat slots of the paged cache", py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gu[:, :I]) * gu[:, I:] for float32 / bfloat16 gu [T, 2I]",
        py::call_guard<py::gil_scoped_release>(), py::arg("gu"));
  m.def("rms_norm", &rms_norm, "[residual add +] RMSNorm, one pass", py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"));
  m.def("int8_gemm_supported", &int8_gemm_supported, "whether int8_gemm_packed was built (AVX512-VNNI)");
  m.def("int8_gemm_nk_supported", &int8_gemm_nk_supported, "whether int8_gemm_nk was built (AVX2)");
  m.def("int8_gemm_nk", &int8_gemm_nk, "int8 [M, K] x int8 [N, K] weights -> int32 [M, N] (AVX2, exact)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"));
  m.def("int8_gemm_packed", &int8_gemm_packed, "int8 x packed int8 weights -> int32 (small M, VNNI)", py::call_guard<py::gil_scoped_release>(),
        py::arg("x"), py::arg("packed"), py::arg("comp"), py::arg("n"));
  m.def("int8_gemm_packed_dequant", &int8_gemm_packed_dequant,
        "int8_gemm_packed with dequant_int32 as its epilogue (float32/bf16 out)", py::call_guard<py::gil_scoped_release>(),
        py::arg("x"), py::arg("packed"), py::arg("comp"), py::arg("n"), py::arg("sx"), py::arg("sw"), py::arg("bias"),
        py::arg("dtype"));
  m.def("install_cpu_allocator", &install_cpu_allocator,
        "install the caching allocator for large CPU blocks as torch's CPU allocator (True the first time)",
        py::arg("min_bytes"), py::arg("max_cached_bytes"), py::arg("huge_pages") = false);
  m.def("cpu_allocator_stats", &cpu_allocator_stats, "hits, misses, cached_bytes, live_bytes, settings ({} if not installed)");
  m.def("cpu_allocator_empty_cache", &cpu_allocator_empty_cache, "return the allocator's cached free blocks to the OS");
  py::class_<TensorList>(m, "TensorList", "tensors held on the C++ side (the fused decode step's per-layer operands)")
      .def(py::init([](std::vector<at::Tensor> t) { return TensorList{std::move(t)}; }), py::arg("tensors"))
      .def("__len__", [](const TensorList& l) { return l.tensors.size(); });
  m.def("llama_decode_w8a8", &llama_decode_w8a8,
        "the decoder layers + final norm of a decode-only W8A8 Llama step in one call (same kernels, same order)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("positions"), py::arg("layers"),
        py::arg("kv_caches"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("cos"),
        py::arg("sin"), py::arg("final_norm"), py::arg("windows"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("scale"), py::arg("eps"));
  m.def("llama_decode_dense", &llama_decode_dense,
        "the decoder layers + final norm of a decode-only float Llama step in one call (same ops, same order)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("positions"), py::arg("layers"),
        py::arg("kv_caches"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("cos"),
        py::arg("sin"), py::arg("final_norm"), py::arg("windows"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("scale"), py::arg("eps"), py::arg("packed"));
  m.def("llama_decode_group", &llama_decode_group,
        "the decoder layers + final norm of a decode-only group-quantized (GGUF, ...) Llama step in one call",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("positions"), py::arg("layers"),
        py::arg("kv_caches"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("cos"),
        py::arg("sin"), py::arg("final_norm"), py::arg("windows"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("scale"), py::arg("eps"), py::arg("modes"), py::arg("group_fn"),
        py::arg("intdot_fn"), py::arg("large_m"), py::arg("isa"), py::arg("intdot_max_m"));
}
