// kv_rollback: CUDA glue (device guard, stream, launch). Checks: kv_rollback_checks.h;
// kernel: kernels/kv_rollback.cu.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/kv_rollback_cuda.h"
#include "kv_rollback_checks.h"

namespace osd {
namespace {

void kv_rollback_cuda_op(at::Tensor kv, at::Tensor lens, const at::Tensor& slots,
                         const at::Tensor& keep) {
  OSD_CHECK(kv.is_cuda(), "kv_rollback CUDA kernel got a ", kv.device(), " tensor");
  const c10::cuda::CUDAGuard guard(kv.device());
  auto a = make_kv_rollback_args(kv, lens, slots, keep);
  const cudaError_t err = kv_rollback_cuda(a, c10::cuda::getCurrentCUDAStream());
  OSD_CHECK(err == cudaSuccess, "kv_rollback launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CUDA, m) { m.impl("kv_rollback", &osd::kv_rollback_cuda_op); }
