// CUDA launcher declaration for kv_rollback (torch-free; included by the CUDA glue).
#pragma once
#include <cuda_runtime.h>

#include "kernels/kv_rollback.h"

namespace osd {
cudaError_t kv_rollback_cuda(const KvRollbackArgs& args, cudaStream_t stream);
}  // namespace osd
