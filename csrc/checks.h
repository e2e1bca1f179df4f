// Argument-check helpers of the torch glue, shared by the CPU and CUDA implementations
// (csrc/<op>_checks.h, csrc/cpu/*.cpp, csrc/cuda/*.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "kernels/common.h"

#define OSD_CHECK(cond, ...) TORCH_CHECK(cond, "osd: ", __VA_ARGS__)

namespace osd {

inline DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: OSD_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

inline void check_dtype(const at::Tensor& t, at::ScalarType st, const char* name) {
  OSD_CHECK(t.scalar_type() == st, name, " must be ", st, ", got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* na,
                              const char* nb) {
  OSD_CHECK(a.device() == b.device(), na, " is on ", a.device(), " but ", nb, " is on ",
            b.device());
}

// A per-sequence parameter of the sampling ops: a contiguous [B] tensor of dtype st on the
// device of target_logits.
inline void check_per_sequence(const at::Tensor& t, at::ScalarType st, const char* name,
                               int64_t B, const at::Tensor& logits) {
  check_dtype(t, st, name);
  OSD_CHECK(t.dim() == 1 && t.size(0) == B && t.is_contiguous(), name,
            " must be contiguous [B=", B, "], got ", t.sizes());
  check_same_device(logits, t, "target_logits", name);
}

// Checks the sampling parameters shared by rejection_sample and tree_rejection_sample (in
// this order) and points the kernel arguments a.temperature .. a.offset at them.
template <typename Args>
void set_sampling_params(Args& a, const at::Tensor& logits, int64_t B,
                         const at::Tensor& temperature, const at::Tensor& top_k,
                         const at::Tensor& top_p, const at::Tensor& seed,
                         const at::Tensor& offset) {
  check_per_sequence(temperature, at::kFloat, "temperature", B, logits);
  check_per_sequence(top_k, at::kInt, "top_k", B, logits);
  check_per_sequence(top_p, at::kFloat, "top_p", B, logits);
  check_per_sequence(seed, at::kLong, "seed", B, logits);
  check_per_sequence(offset, at::kLong, "offset", B, logits);
  a.temperature = temperature.data_ptr<float>();
  a.top_k = top_k.data_ptr<int32_t>();
  a.top_p = top_p.data_ptr<float>();
  a.seed = seed.data_ptr<int64_t>();
  a.offset = offset.data_ptr<int64_t>();
}

}  // namespace osd
