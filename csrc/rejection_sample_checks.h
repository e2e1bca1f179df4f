// rejection_sample: argument checks shared by the CPU (cpu/rejection_sample.cpp) and CUDA
// (cuda/rejection_sample.cpp) implementations. Semantics: kernels/rejection_sample.h.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdlib>
#include <optional>

#include "checks.h"
#include "kernels/rejection_sample.h"

namespace osd {

// Whether sequences take the split-vocabulary path (kernels/chunk_stats.h) where it applies.
// OSD_SAMPLER_SPLIT=1: on every device; 0: never (the one-row path); unset: on the CPU,
// not on CUDA (its split kernels have not run on a GPU yet). Read per call.
inline bool sampler_split(bool cuda) {
  const char* v = std::getenv("OSD_SAMPLER_SPLIT");
  if (v == nullptr || *v == '\0') return !cuda;
  return v[0] == '1';
}

// Checks rejection_sample's arguments, allocates its outputs (out [B, K+1] int64, accepted
// [B] int32, on the device of target_logits) and points the kernel arguments at them.
inline RejectionSampleArgs make_rejection_sample_args(
    const at::Tensor& logits, const at::Tensor& draft_ids,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& num_draft,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& seed, const at::Tensor& offset, at::Tensor& out, at::Tensor& accepted) {
  OSD_CHECK(logits.dim() == 3, "target_logits must be [B, K+1, V], got ", logits.sizes());
  const int64_t B = logits.size(0), K = logits.size(1) - 1, V = logits.size(2);
  OSD_CHECK(K >= 0 && V > 0, "target_logits must have K+1 >= 1 rows and V >= 1, got ",
            logits.sizes());
  OSD_CHECK(V < (int64_t{1} << 31), "vocab size ", V, " does not fit the Philox index");
  check_dtype(draft_ids, at::kLong, "draft_token_ids");
  OSD_CHECK(draft_ids.dim() == 2 && draft_ids.size(0) == B && draft_ids.size(1) == K,
            "draft_token_ids must be [B=", B, ", K=", K, "], got ", draft_ids.sizes());
  check_same_device(logits, draft_ids, "target_logits", "draft_token_ids");
  check_per_sequence(num_draft, at::kInt, "num_draft_tokens", B, logits);
  RejectionSampleArgs a{};
  set_sampling_params(a, logits, B, temperature, top_k, top_p, seed, offset);
  a.logits = logits.data_ptr();
  a.logits_dtype = to_dtype(logits, "target_logits");
  a.logits_stride_b = logits.stride(0);
  a.logits_stride_k = logits.stride(1);
  a.logits_stride_v = logits.stride(2);
  a.draft_ids = draft_ids.data_ptr<int64_t>();
  a.draft_ids_stride_b = draft_ids.stride(0);
  a.draft_ids_stride_k = draft_ids.stride(1);
  a.draft_probs = nullptr;
  a.draft_probs_dtype = DType::kFloat32;
  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    OSD_CHECK(q.dim() == 3 && q.size(0) == B && q.size(1) == K && q.size(2) == V,
              "draft_probs must be [B=", B, ", K=", K, ", V=", V, "], got ", q.sizes());
    check_same_device(logits, q, "target_logits", "draft_probs");
    a.draft_probs = q.data_ptr();
    a.draft_probs_dtype = to_dtype(q, "draft_probs");
    a.draft_probs_stride_b = q.stride(0);
    a.draft_probs_stride_k = q.stride(1);
    a.draft_probs_stride_v = q.stride(2);
  }
  out = at::empty({B, K + 1}, logits.options().dtype(at::kLong));
  accepted = at::empty({B}, logits.options().dtype(at::kInt));
  a.num_draft = num_draft.data_ptr<int32_t>();
  a.out_tokens = out.data_ptr<int64_t>();
  a.num_accepted = accepted.data_ptr<int32_t>();
  a.batch = B;
  a.num_draft_max = K;
  a.vocab = V;
  return a;
}

}  // namespace osd
