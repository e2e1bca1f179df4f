// kv_rollback: CUDA glue (checks, stream, launch). Kernel: kernels/kv_rollback.cu.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cpu/glue.h"
#include "kernels/kv_rollback_cuda.h"

namespace osd {
KvRollbackArgs make_kv_rollback_args(const at::Tensor& kv, const at::Tensor& lens,
                                     const at::Tensor& slots, const at::Tensor& keep);
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
