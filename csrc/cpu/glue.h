// Small shape/dtype check helpers shared by the torch glue files.
#pragma once
#include <torch/library.h>
#include <ATen/core/Tensor.h>

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

}  // namespace osd
