// CUDA launcher declaration for rejection_sample (torch-free; included by the CUDA glue).
#pragma once
#include <cuda_runtime.h>

#include "kernels/rejection_sample.h"

namespace osd {
// One block per sequence on `stream`; args.out_tokens / num_accepted are written.
cudaError_t rejection_sample_cuda(const RejectionSampleArgs& args, cudaStream_t stream);
}  // namespace osd
