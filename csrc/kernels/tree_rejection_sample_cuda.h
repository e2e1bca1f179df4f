// CUDA launcher declaration for tree_rejection_sample (torch-free; included by the CUDA glue).
#pragma once
#include <cuda_runtime.h>

#include "kernels/tree_rejection_sample.h"

namespace osd {
// `args.workspace` must hold B * 2 * V floats.
cudaError_t tree_rejection_sample_cuda(const TreeRejectionSampleArgs& args, cudaStream_t stream);
}  // namespace osd
