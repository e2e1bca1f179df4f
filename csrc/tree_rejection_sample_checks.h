// tree_rejection_sample: argument checks shared by the CPU (cpu/tree_rejection_sample.cpp)
// and CUDA (cuda/tree_rejection_sample.cpp) implementations. Semantics:
// kernels/tree_rejection_sample.h.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>

#include "checks.h"
#include "kernels/tree_rejection_sample.h"

namespace osd {

// Checks tree_rejection_sample's arguments, allocates its outputs (accepted_nodes and
// out_tokens [B, max_depth + 1] int64, num_accepted [B] int32, on the device of
// target_logits) and points the kernel arguments at them; a.workspace is left null (the
// CUDA implementation allocates it).
inline TreeRejectionSampleArgs make_tree_rejection_sample_args(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& seed,
    const at::Tensor& offset, int64_t max_depth, bool without_replacement,
    at::Tensor& accepted_nodes, at::Tensor& out_tokens, at::Tensor& num_accepted) {
  OSD_CHECK(logits.dim() == 3, "target_logits must be [B, T, V], got ", logits.sizes());
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  OSD_CHECK(T >= 1 && V >= 1, "target_logits needs T >= 1 and V >= 1, got ", logits.sizes());
  OSD_CHECK(V < (int64_t{1} << 31), "vocab size ", V, " does not fit the Philox index");
  OSD_CHECK(max_depth >= 0 && max_depth < T, "max_depth must be in [0, T=", T, "), got ",
            max_depth);
  check_dtype(tokens, at::kLong, "node_token_ids");
  check_dtype(parents, at::kInt, "parents");
  OSD_CHECK(tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) == T,
            "node_token_ids must be [B=", B, ", T=", T, "], got ", tokens.sizes());
  OSD_CHECK(parents.dim() == 2 && parents.size(0) == B && parents.size(1) == T,
            "parents must be [B=", B, ", T=", T, "], got ", parents.sizes());
  check_same_device(logits, tokens, "target_logits", "node_token_ids");
  check_same_device(logits, parents, "target_logits", "parents");
  TreeRejectionSampleArgs a{};
  set_sampling_params(a, logits, B, temperature, top_k, top_p, seed, offset);
  a.logits = logits.data_ptr();
  a.logits_dtype = to_dtype(logits, "target_logits");
  a.logits_stride_b = logits.stride(0);
  a.logits_stride_t = logits.stride(1);
  a.logits_stride_v = logits.stride(2);
  a.tokens = tokens.data_ptr<int64_t>();
  a.tokens_stride_b = tokens.stride(0);
  a.tokens_stride_t = tokens.stride(1);
  a.parents = parents.data_ptr<int32_t>();
  a.parents_stride_b = parents.stride(0);
  a.parents_stride_t = parents.stride(1);
  a.draft_probs = nullptr;
  a.draft_probs_dtype = DType::kFloat32;
  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    OSD_CHECK(q.dim() == 3 && q.size(0) == B && q.size(1) == T && q.size(2) == V,
              "draft_probs must be [B=", B, ", T=", T, ", V=", V, "], got ", q.sizes());
    check_same_device(logits, q, "target_logits", "draft_probs");
    a.draft_probs = q.data_ptr();
    a.draft_probs_dtype = to_dtype(q, "draft_probs");
    a.draft_probs_stride_b = q.stride(0);
    a.draft_probs_stride_t = q.stride(1);
    a.draft_probs_stride_v = q.stride(2);
  }
  accepted_nodes = at::empty({B, max_depth + 1}, logits.options().dtype(at::kLong));
  out_tokens = at::empty({B, max_depth + 1}, logits.options().dtype(at::kLong));
  num_accepted = at::empty({B}, logits.options().dtype(at::kInt));
  a.accepted_nodes = accepted_nodes.data_ptr<int64_t>();
  a.out_tokens = out_tokens.data_ptr<int64_t>();
  a.num_accepted = num_accepted.data_ptr<int32_t>();
  a.workspace = nullptr;
  a.batch = B;
  a.num_nodes = T;
  a.vocab = V;
  a.max_depth = max_depth;
  a.without_replacement = without_replacement;
  return a;
}

}  // namespace osd
