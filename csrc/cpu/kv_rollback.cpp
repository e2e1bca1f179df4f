// kv_rollback: schema, argument checks, and the C++ CPU kernel.
// Semantics and the in-place ordering argument: kernels/kv_rollback.h.
#include <ATen/Parallel.h>
#include <cstring>

#include "cpu/glue.h"
#include "kernels/kv_rollback.h"

namespace osd {

void kv_rollback_cpu(const KvRollbackArgs& a) {
  const int64_t rows = a.batch * a.num_lk * a.num_heads;
  const int64_t row_bytes = a.head_dim * a.elem_size;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / (a.num_lk * a.num_heads);
      const int64_t lk = (r / a.num_heads) % a.num_lk;
      const int64_t h = r % a.num_heads;
      const int32_t n = a.keep[b];
      if (n <= 0) continue;
      const int64_t base = a.lens[b];
      char* row = static_cast<char*>(a.kv) +
                  (lk * a.stride_lk + b * a.stride_b + h * a.stride_h) * a.elem_size;
      const int64_t* slots = a.slots + b * a.slots_stride_b;
      for (int32_t j = 0; j < n; ++j) {
        const int64_t src = base + slots[j];
        const int64_t dst = base + j;
        if (src != dst) {
          std::memcpy(row + dst * a.stride_s * a.elem_size,
                      row + src * a.stride_s * a.elem_size, row_bytes);
        }
      }
    }
  });
  for (int64_t b = 0; b < a.batch; ++b) {
    if (a.keep[b] > 0) a.lens[b] += a.keep[b];
  }
}

KvRollbackArgs make_kv_rollback_args(const at::Tensor& kv, const at::Tensor& lens,
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

namespace {

void kv_rollback_cpu_op(at::Tensor kv, at::Tensor lens, const at::Tensor& slots,
                        const at::Tensor& keep) {
  OSD_CHECK(kv.device().is_cpu(), "kv_rollback CPU kernel got a ", kv.device(), " tensor");
  auto a = make_kv_rollback_args(kv, lens, slots, keep);
  for (int64_t b = 0; b < a.batch; ++b) {
    const int32_t n = a.keep[b];
    OSD_CHECK(n <= a.max_keep, "num_keep[", b, "]=", n, " exceeds accepted_slots width ",
              a.max_keep);
    for (int32_t j = 0; j < n; ++j) {
      const int64_t s = a.slots[b * a.slots_stride_b + j];
      OSD_CHECK(s >= j && (j == 0 || s > a.slots[b * a.slots_stride_b + j - 1]),
                "accepted_slots[", b, "] must be strictly increasing tree-node indices");
      OSD_CHECK(a.lens[b] + s < kv.size(4), "slot ", s, " of row ", b,
                " is past the cache capacity ", kv.size(4));
    }
  }
  kv_rollback_cpu(a);
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_FRAGMENT(osd, m) {
  // Compact accepted tree slots of every layer's K/V in place and advance the lengths.
  m.def(
      "kv_rollback(Tensor(a!) kv_cache, Tensor(b!) cache_lens, Tensor accepted_slots, "
      "Tensor num_keep) -> ()");
}

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("kv_rollback", &osd::kv_rollback_cpu_op); }
