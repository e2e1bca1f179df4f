// philox_uniform: the C++ side of the shared counter-based generator (kernels/philox.h),
// exposed so tests can compare it word for word with the PyTorch and Triton versions, and
// the draft's sampling noise on the CPU (osd.spec_decode.model_drafter.sample_draft).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "kernels/philox.h"

namespace osd {
namespace {

at::Tensor philox_uniform_cpu_op(const at::Tensor& seed, const at::Tensor& offset, int64_t stream,
                                 int64_t num) {
  check_dtype(seed, at::kLong, "seed");
  check_dtype(offset, at::kLong, "offset");
  OSD_CHECK(seed.dim() == 1 && offset.sizes() == seed.sizes(),
            "seed and offset must be [B] with the same size, got ", seed.sizes(), " and ",
            offset.sizes());
  OSD_CHECK(stream >= 0 && stream <= 0xFFFFFFFFll, "stream must fit in 32 bits, got ", stream);
  OSD_CHECK(num >= 0 && num <= 0x100000000ll, "num must be in [0, 2^32], got ", num);
  const auto s = seed.contiguous();
  const auto o = offset.contiguous();
  auto out = at::empty({seed.size(0), num}, seed.options().dtype(at::kFloat));
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* op = o.data_ptr<int64_t>();
  float* outp = out.data_ptr<float>();
  // One Philox block yields the words of four consecutive indices.
  const int64_t blocks = (num + 3) / 4;
  at::parallel_for(0, seed.size(0) * blocks, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, block = i % blocks;
      const Philox4 w = philox_block(static_cast<uint64_t>(sp[b]), static_cast<uint64_t>(op[b]),
                                     static_cast<uint32_t>(stream), static_cast<uint32_t>(block));
      float* row = outp + b * num;
      for (int64_t j = 0; j < 4 && block * 4 + j < num; ++j) {
        row[block * 4 + j] = philox_to_uniform(w.x[j]);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("philox_uniform", &osd::philox_uniform_cpu_op); }
