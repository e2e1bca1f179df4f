// kv_rollback: argument checks shared by the CPU (cpu/kv_rollback.cpp) and CUDA
// (cuda/kv_rollback.cpp) implementations. Semantics: kernels/kv_rollback.h.
#pragma once
#include <ATen/core/Tensor.h>

#include "checks.h"
#include "kernels/kv_rollback.h"

namespace osd {

// Checks the shapes, dtypes and devices of kv_rollback's tensors and points the kernel
// arguments at them. The slot values are device data: the CPU implementation checks them.
inline KvRollbackArgs make_kv_rollback_args(const at::Tensor& kv, const at::Tensor& lens,
                                            const at::Tensor& slots, const at::Tensor& keep) {
  OSD_CHECK(kv.dim() == 6, "kv_cache must be [L, 2, B_max, H, S, D], got ", kv.sizes());
  OSD_CHECK(kv.size(1) == 2, "kv_cache dim 1 must be 2 (K and V), got ", kv.size(1));
  OSD_CHECK(kv.stride(5) == 1, "kv_cache must be contiguous in its last dim");
  OSD_CHECK(kv.stride(0) == 2 * kv.stride(1), "kv_cache dims 0 and 1 must be mergeable");
  to_dtype(kv, "kv_cache");
  check_dtype(lens, at::kInt, "cache_lens");
  check_dtype(slots, at::kLong, "accepted_slots");
  check_dtype(keep, at::kInt, "num_keep");
  OSD_CHECK(lens.dim() == 1 && lens.size(0) == kv.size(2) && lens.is_contiguous(),
            "cache_lens must be contiguous [B_max=", kv.size(2), "], got ", lens.sizes());
  OSD_CHECK(slots.dim() == 2 && slots.stride(1) == 1,
            "accepted_slots must be [B, N] with contiguous rows, got ", slots.sizes());
  const int64_t batch = slots.size(0);
  OSD_CHECK(batch <= kv.size(2), "accepted_slots has ", batch, " rows but the cache only ",
            kv.size(2));
  OSD_CHECK(keep.dim() == 1 && keep.size(0) == batch && keep.is_contiguous(),
            "num_keep must be contiguous [B=", batch, "], got ", keep.sizes());
  check_same_device(kv, lens, "kv_cache", "cache_lens");
  check_same_device(kv, slots, "kv_cache", "accepted_slots");
  check_same_device(kv, keep, "kv_cache", "num_keep");
  KvRollbackArgs a;
  a.kv = kv.data_ptr();
  a.elem_size = kv.element_size();
  a.num_lk = kv.size(0) * 2;
  a.num_heads = kv.size(3);
  a.head_dim = kv.size(5);
  a.stride_lk = kv.stride(1);
  a.stride_b = kv.stride(2);
  a.stride_h = kv.stride(3);
  a.stride_s = kv.stride(4);
  a.lens = lens.data_ptr<int32_t>();
  a.slots = slots.data_ptr<int64_t>();
  a.slots_stride_b = slots.stride(0);
  a.keep = keep.data_ptr<int32_t>();
  a.batch = batch;
  a.max_keep = slots.size(1);
  return a;
}

}  // namespace osd
