// kv_rollback: the C++ CPU kernel (shared checks: kv_rollback_checks.h).
// Semantics and the in-place ordering argument: kernels/kv_rollback.h.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstring>

#include "kernels/kv_rollback.h"
#include "kv_rollback_checks.h"

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

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("kv_rollback", &osd::kv_rollback_cpu_op); }
