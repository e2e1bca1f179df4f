// tree_rejection_sample: CUDA glue (device guard, workspace, stream, launch). Checks:
// tree_rejection_sample_checks.h; kernel: kernels/tree_rejection_sample.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/tree_rejection_sample_cuda.h"
#include "tree_rejection_sample_checks.h"

namespace osd {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cuda_op(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& seed,
    const at::Tensor& offset, int64_t max_depth, bool without_replacement) {
  OSD_CHECK(logits.is_cuda(), "tree_rejection_sample CUDA kernel got a ", logits.device(),
            " tensor");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor nodes, out, accepted;
  auto a = make_tree_rejection_sample_args(logits, tokens, parents, draft_probs, temperature,
                                           top_k, top_p, seed, offset, max_depth,
                                           without_replacement, nodes, out, accepted);
  // Residual and warped-target rows: from the caching allocator, so graph capture works.
  at::Tensor workspace = at::empty({a.batch, 2, a.vocab}, logits.options().dtype(at::kFloat));
  a.workspace = workspace.data_ptr<float>();
  const cudaError_t err = tree_rejection_sample_cuda(a, c10::cuda::getCurrentCUDAStream());
  OSD_CHECK(err == cudaSuccess, "tree_rejection_sample launch failed: ",
            cudaGetErrorString(err));
  return {nodes, out, accepted};
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CUDA, m) {
  m.impl("tree_rejection_sample", &osd::tree_rejection_sample_cuda_op);
}
