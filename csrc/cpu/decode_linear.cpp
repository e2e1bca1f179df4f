// decode_linear: checks and the C++ CPU kernel of y = x W^T + b for few rows.
//
// Decode and verify forwards multiply 1 to ~12 rows by every weight matrix, most of them
// right after an RMSNorm, which the op applies to the rows first when given its weight. A
// general GEMM handles so few rows poorly on one core; the passes of cpu/linear_rows.h
// stream W once for up to 12 rows, prefetching ahead (the zoo target's 5-token verify went
// from 1.51 to 0.92 one-token forwards with the prefetch, docs/benchmarks.md).
// A weight packed into panels ([N / 16, K, 16], osd_kernels.pack_weight) goes through
// cpu/linear_panels.h instead, which needs no horizontal sums and loads each weight line
// once for up to 6 rows.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <optional>

#include "checks.h"
#include "cpu/linear_panels.h"
#include "cpu/linear_rows.h"

namespace osd {
namespace {

at::Tensor decode_linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& norm_weight, double eps) {
  OSD_CHECK(x.device().is_cpu(), "decode_linear CPU kernel got a ", x.device(), " tensor");
  check_dtype(x, at::kFloat, "x");
  check_dtype(weight, at::kFloat, "weight");
  OSD_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows, got ",
            x.sizes(), " strides ", x.strides());
  const bool packed = weight.dim() == 3;
  if (packed) {
    OSD_CHECK(weight.is_contiguous() && weight.size(2) == linear_panels::kPanel,
              "a packed weight must be contiguous [N / 16, K, 16], got ", weight.sizes());
  } else {
    OSD_CHECK(weight.dim() == 2 && weight.is_contiguous(),
              "weight must be contiguous [N, K] or packed [N / 16, K, 16], got ", weight.sizes());
  }
  OSD_CHECK(weight.size(1) == x.size(1), "x has ", x.size(1), " features but weight expects ",
            weight.size(1));
  check_same_device(x, weight, "x", "weight");
  linear_rows::Args a;
  a.M = x.size(0);
  a.K = x.size(1);
  a.N = packed ? weight.size(0) * linear_panels::kPanel : weight.size(0);
  a.ldx = x.stride(0);
  a.x = x.data_ptr<float>();
  a.w = weight.data_ptr<float>();
  a.bias = linear_rows::bias_data(bias, x, a.N);
  const at::Tensor normed = linear_rows::apply_norm(a, x, norm_weight, eps);
  at::Tensor y = at::empty({a.M, a.N}, x.options());
  a.y = y.data_ptr<float>();
  a.ldy = a.N;
  if (a.M == 0 || a.N == 0) return y;
  const bool avx2 = use_avx2_fma();
  if (packed) {
    const linear_panels::Args pa{a.x, a.w, a.bias, a.y, a.M, a.N, a.K, a.ldx, a.ldy};
    // One row (a decode step) is bound by memory either way and keeps the AVX2 kernel;
    // from two rows on (verify forwards, small batches) AVX-512's 32 registers hold more
    // panels per micro-kernel, measured 3-10% faster at 2-6 rows (docs/benchmarks.md).
    const int level = use_avx512() && a.M > 1
                          ? linear_panels::kAvx512
                          : (avx2 ? linear_panels::kAvx2 : linear_panels::kPortable);
    // Threads split the panels (16 at least per thread: each streams its share once).
    at::parallel_for(0, weight.size(0), 16, [&](int64_t p_begin, int64_t p_end) {
      linear_panels::all_rows(pa, p_begin, p_end, level);
    });
    return y;
  }
  // Threads split the weight rows (each streams its share of W once per pass).
  at::parallel_for(0, a.N, 256, [&](int64_t n_begin, int64_t n_end) {
    linear_rows::all_rows(a, n_begin, n_end, avx2);
  });
  return y;
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("decode_linear", &osd::decode_linear_cpu); }
