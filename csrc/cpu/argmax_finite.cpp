// argmax_finite: per row of logits [..., V] the first index of its largest value and
// whether the row holds a NaN or an infinity (osd_kernels/argmax_finite.py has the
// contract and the reference). It is the greedy step's whole sampler and the engine's
// check of the target's logits, in one read of each row.
//
// One pass a row: row_argmax_nonfinite (cpu/warp_cpu.cpp), the CPU samplers' argmax too.
// Each of 16 lanes keeps the largest value it has seen and its first index; the row's
// answer is the lowest index among the lanes holding the maximum. NaN compares false, so a
// lane never takes one (the row's flag is set, its id unspecified). The flag accumulates
// x * 0: 0 for a finite x, NaN for an infinity or a NaN. torch's argmax runs scalar on the
// CPU and the check is a second reduction that wakes the thread pool.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "checks.h"
#include "cpu/warp_cpu.h"

namespace osd {
namespace {

std::tuple<at::Tensor, at::Tensor> argmax_finite_cpu(const at::Tensor& logits) {
  OSD_CHECK(logits.device().is_cpu(), "argmax_finite CPU kernel got a ", logits.device(),
            " tensor");
  check_dtype(logits, at::kFloat, "logits");
  OSD_CHECK(logits.dim() >= 1 && logits.size(-1) >= 1,
            "logits must be [..., V] with V >= 1, got ", logits.sizes());
  const int64_t V = logits.size(-1);
  std::vector<int64_t> shape(logits.sizes().begin(), logits.sizes().end() - 1);
  at::Tensor ids = at::empty(shape, logits.options().dtype(at::kLong));
  at::Tensor flags = at::empty(shape, logits.options().dtype(at::kBool));
  const int64_t M = logits.numel() / V;
  if (M == 0) return {ids, flags};
  at::Tensor rows = logits.reshape({M, V});
  if (V > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t ld = rows.stride(0);
  const float* x0 = rows.data_ptr<float>();
  int64_t* id0 = ids.data_ptr<int64_t>();
  bool* f0 = flags.data_ptr<bool>();
  // A task reads at least 1M logits: below that, waking another thread costs more than
  // the pass (a row of 49,152 is a few microseconds from the cache).
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t{1} << 20) / V), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      id0[m] = row_argmax_nonfinite(x0 + m * ld, V, f0 + m);
    }
  });
  return {ids, flags};
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("argmax_finite", &osd::argmax_finite_cpu); }
