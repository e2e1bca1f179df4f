// rejection_sample: CUDA glue (device guard, stream, launch). Checks:
// rejection_sample_checks.h; kernel: kernels/rejection_sample.cu.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "kernels/rejection_sample_cuda.h"
#include "rejection_sample_checks.h"

namespace osd {
namespace {

std::tuple<at::Tensor, at::Tensor> rejection_sample_cuda_op(
    const at::Tensor& logits, const at::Tensor& draft_ids,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& num_draft,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& seed, const at::Tensor& offset) {
  OSD_CHECK(logits.is_cuda(), "rejection_sample CUDA kernel got a ", logits.device(), " tensor");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor out, accepted;
  auto a = make_rejection_sample_args(logits, draft_ids, draft_probs, num_draft, temperature,
                                      top_k, top_p, seed, offset, out, accepted);
  // the split-vocabulary path's records (uninitialised) and counters (zeroed); without
  // them every sequence takes the one-block-per-sequence kernel
  at::Tensor workspace, counters;
  if (sampler_split(true)) {
    const SplitLayout layout = split_layout(a.batch, a.num_draft_max + 1, a.vocab);
    workspace = at::empty({layout.bytes}, logits.options().dtype(at::kByte));
    counters = at::zeros({layout.counters}, logits.options().dtype(at::kInt));
    a.workspace = workspace.data_ptr();
    a.counters = counters.data_ptr<int32_t>();
  }
  const cudaError_t err = rejection_sample_cuda(a, c10::cuda::getCurrentCUDAStream());
  OSD_CHECK(err == cudaSuccess, "rejection_sample launch failed: ", cudaGetErrorString(err));
  return {out, accepted};
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CUDA, m) { m.impl("rejection_sample", &osd::rejection_sample_cuda_op); }
