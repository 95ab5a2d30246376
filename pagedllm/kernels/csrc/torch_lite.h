// The ATen headers the kernel sources need, instead of <torch/extension.h>.
//
// <torch/extension.h> pulls in all of libtorch's C++ API (autograd, nn, optim) and pybind11:
// ~45 s of g++ per translation unit on a 2-core machine, the bulk of the first-run kernel build.
// The kernels need only the Tensor class, at::parallel_for and a few ATen functions (~5 s).
// Sources with a PYBIND11_MODULE include <torch/csrc/utils/pybind.h> (pybind11 plus torch's
// Tensor type casters, ~10 s) for their bindings.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <vector>

// Tensors kept on the C++ side (bound as pagedllm_cpu_ops.TensorList): the fused decode step takes
// a model's per-layer operands (~18 a layer) as one of these, built once, instead of a Python list
// whose every tensor pybind11 would convert on each step (~0.3 ms a step for SmolLM2 on Zen 1).
struct TensorList {
  std::vector<at::Tensor> tensors;
};
#include <c10/util/Optional.h>

namespace torch {
using at::Tensor;
using at::empty_like;
}  // namespace torch
