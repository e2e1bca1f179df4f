// distill_loss_fwd_bwd: argument checks and the C++ CPU kernel.
//
// Semantics and the top-k approximation: osd_kernels/distill_loss.py. Per row, with log
// probabilities lp (target) and lq (draft) over buckets B (every token for full target
// logits; the k kept tokens plus one "other" bucket for top-k targets), the row loss is
// sum_B l_B and the gradient w.r.t. draft logit v in bucket B is
//   grad_v = h_B * q_v / Q_B - q_v * H,   H = sum_B h_B,
// where h_B = Q_B dL/dQ_B:
//   fkl  l = p (lp - lq)                               h = -p
//   rkl  l = q (lq - max(lp, floor))                   h = q (lq - max(lp, floor) + 1)
//   jsd  l = beta p (lp - lm) + (1 - beta) q (lq - lm)  h = (1 - beta) q (lq - lm),
//        lm = log(beta p + (1 - beta) q)
//   tvd  l = 0.5 |p - q|                               h = 0.5 q sign(q - p)
// One row per thread at a time, with fp32 row buffers of V elements (the "chunk" is one row
// per thread); the vocabulary sums are reassociated (vectorised) fp32 sums. Masked rows
// get loss 0 and a zero gradient.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "checks.h"

// Floating-point operations are assumed not to trap (as in torch's own build) and sums may
// be reassociated, so GCC can if-convert the selects of the helpers below and vectorise the
// vocabulary loops and their reductions. Applies to everything defined after this line;
// bfloat16 conversions are therefore done here (fast_math.h), not by c10's helpers, which
// GCC would not inline across differing optimisation options.
#pragma GCC optimize("no-trapping-math", "no-signed-zeros", "associative-math")
#include "cpu/fast_math.h"

namespace osd {
namespace {

enum class Loss { kFkl, kRkl, kJsd, kTvd };

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kRklLogPFloor = -69.07755278982137f;  // log(1e-30), RKL_P_FLOOR in Python
constexpr double kLeftoverEps = 1e-6;                 // TOPK_LEFTOVER_EPS in Python

struct RowView {
  const void* data;
  at::ScalarType dtype;
  int64_t stride_row, stride_col;
};

struct DistillArgs {
  RowView draft, target, probs;
  const int64_t* ids;
  int64_t ids_stride_row, ids_stride_col;
  const bool* mask;             // [N] or nullptr
  int64_t mask_stride;
  float* loss_rows;             // [N]
  void* grad;                   // [N, V] contiguous, draft dtype
  int64_t rows, vocab, topk;    // topk = 0: full target logits
  float beta;
};

template <typename scalar_t>
OSD_INLINE float to_float(scalar_t x) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return bf16_bits_to_float(x.x);
  } else {
    return static_cast<float>(x);
  }
}

template <typename scalar_t>
OSD_INLINE void load_typed(const scalar_t* src, int64_t stride, int64_t n, float* dst) {
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i * stride]);
  }
}

// Row n of a float/half/bfloat16 matrix, as fp32.
OSD_INLINE void load_row(const RowView& m, int64_t n, int64_t count, float* dst) {
  switch (m.dtype) {
    case at::kFloat:
      load_typed(static_cast<const float*>(m.data) + n * m.stride_row, m.stride_col, count, dst);
      break;
    case at::kHalf:
      load_typed(static_cast<const c10::Half*>(m.data) + n * m.stride_row, m.stride_col, count,
                 dst);
      break;
    default:
      load_typed(static_cast<const c10::BFloat16*>(m.data) + n * m.stride_row, m.stride_col,
                 count, dst);
      break;
  }
}

// log sum_i e^x[i] (-inf when every x[i] is -inf). The max runs in eight explicit lanes
// (GCC does not vectorise a max reduction that must respect NaN); the sum is reassociated.
OSD_INLINE float logsumexp(const float* x, int64_t n) {
  float lane[8] = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int u = 0; u < 8; ++u) lane[u] = x[i + u] > lane[u] ? x[i + u] : lane[u];
  }
  float mx = kNegInf;
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  for (int u = 0; u < 8; ++u) mx = std::max(mx, lane[u]);
  if (mx == kNegInf) return kNegInf;
  float s = 0.f;
  for (i = 0; i < n; ++i) s += exp_nonpos(x[i] - mx);
  return mx + std::log(s);
}

// Loss term l and h = Q dL/dQ of one bucket with log probabilities lp (target), lq (draft);
// zero probabilities contribute exactly 0 (0 log 0 = 0).
template <Loss kLoss>
OSD_INLINE void bucket_term(float lp, float lq, float beta, float log_beta, float log_1mb,
                            float& l, float& h) {
  const float p = exp_nonpos(lp);  // lp, lq <= 0 (up to rounding); -inf gives 0
  const float q = exp_nonpos(lq);
  if constexpr (kLoss == Loss::kFkl) {
    l = p > 0.f ? p * (lp - lq) : 0.f;
    h = -p;
  } else if constexpr (kLoss == Loss::kRkl) {
    const float d = q > 0.f ? lq - std::max(lp, kRklLogPFloor) : 0.f;
    l = q * d;
    h = q * (d + 1.f);
  } else if constexpr (kLoss == Loss::kJsd) {
    const float a = lp + log_beta, b = lq + log_1mb;
    const float hi = a > b ? a : b, lo = a > b ? b : a;
    const float lm = hi == kNegInf ? kNegInf : hi + log_pos(1.f + exp_nonpos(lo - hi));
    const float kq = q > 0.f ? q * (lq - lm) : 0.f;
    l = beta * (p > 0.f ? p * (lp - lm) : 0.f) + (1.f - beta) * kq;
    h = (1.f - beta) * kq;
  } else {
    l = 0.5f * std::fabs(p - q);
    h = 0.5f * q * static_cast<float>((q > p) - (q < p));
  }
}

template <typename scalar_t>
OSD_INLINE void store_row(void* grad, int64_t n, int64_t vocab, const float* g) {
  scalar_t* dst = static_cast<scalar_t*>(grad) + n * vocab;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    auto* bits = reinterpret_cast<uint16_t*>(dst);
    for (int64_t v = 0; v < vocab; ++v) bits[v] = float_to_bf16_bits(g[v]);
  } else {
    for (int64_t v = 0; v < vocab; ++v) dst[v] = static_cast<scalar_t>(g[v]);
  }
}

OSD_INLINE void store_grad_row(const DistillArgs& a, int64_t n, const float* g) {
  switch (a.draft.dtype) {
    case at::kFloat: store_row<float>(a.grad, n, a.vocab, g); break;
    case at::kHalf: store_row<c10::Half>(a.grad, n, a.vocab, g); break;
    default: store_row<c10::BFloat16>(a.grad, n, a.vocab, g); break;
  }
}

struct RowScratch {
  std::vector<float> z, t, top_lq, top_h;
  RowScratch(int64_t vocab, int64_t topk)
      : z(vocab), t(topk == 0 ? vocab : topk), top_lq(topk), top_h(topk) {}
};

// Full target logits: every token is its own bucket.
template <Loss kLoss>
OSD_INLINE void full_row(const DistillArgs& a, int64_t n, RowScratch& w) {
  const int64_t V = a.vocab;
  float* z = w.z.data();
  float* t = w.t.data();
  load_row(a.draft, n, V, z);
  load_row(a.target, n, V, t);
  const float lse_z = logsumexp(z, V), lse_t = logsumexp(t, V);
  const float log_beta = std::log(a.beta), log_1mb = std::log1p(-a.beta);
  float loss = 0.f, hsum = 0.f;
  for (int64_t v = 0; v < V; ++v) {
    float l, h;
    bucket_term<kLoss>(t[v] - lse_t, z[v] - lse_z, a.beta, log_beta, log_1mb, l, h);
    loss += l;
    hsum += h;
    t[v] = h;  // t now holds h_v
  }
  const float H = hsum;
  for (int64_t v = 0; v < V; ++v) z[v] = t[v] - exp_nonpos(z[v] - lse_z) * H;
  a.loss_rows[n] = loss;
  store_grad_row(a, n, z);
}

// Top-k target: buckets are the k kept ids plus "other" (every token not kept).
template <Loss kLoss>
OSD_INLINE void topk_row(const DistillArgs& a, int64_t n, RowScratch& w) {
  const int64_t V = a.vocab, K = a.topk;
  float* z = w.z.data();
  float* probs = w.t.data();
  load_row(a.draft, n, V, z);
  load_row(a.probs, n, K, probs);
  const int64_t* ids = a.ids + n * a.ids_stride_row;
  const float lse = logsumexp(z, V);
  for (int64_t i = 0; i < K; ++i) {
    float& zi = z[ids[i * a.ids_stride_col]];
    w.top_lq[i] = zi - lse;
    zi = kNegInf;  // z now holds the "other" tokens only
  }
  const float lse_other = logsumexp(z, V);
  const float log_beta = std::log(a.beta), log_1mb = std::log1p(-a.beta);
  double loss = 0.0, hsum = 0.0, kept_mass = 0.0;
  for (int64_t i = 0; i < K; ++i) {
    float l, h;
    kept_mass += probs[i];
    const float lp = probs[i] > 0.f ? log_pos(probs[i]) : kNegInf;
    bucket_term<kLoss>(lp, w.top_lq[i], a.beta, log_beta, log_1mb, l, h);
    loss += l;
    hsum += h;
    w.top_h[i] = h;
  }
  const double leftover = 1.0 - kept_mass;
  const float p_other = leftover < kLeftoverEps ? 0.f : static_cast<float>(leftover);
  float l_o, h_o;
  bucket_term<kLoss>(p_other > 0.f ? std::log(p_other) : kNegInf, lse_other - lse, a.beta,
                     log_beta, log_1mb, l_o, h_o);
  loss += l_o;
  hsum += h_o;
  const float H = static_cast<float>(hsum);
  if (lse_other == kNegInf) {
    std::fill(z, z + V, 0.f);
  } else {
    for (int64_t v = 0; v < V; ++v) {
      z[v] = exp_nonpos(z[v] - lse_other) * h_o - exp_nonpos(z[v] - lse) * H;
    }
  }
  for (int64_t i = 0; i < K; ++i) {
    z[ids[i * a.ids_stride_col]] = w.top_h[i] - std::exp(w.top_lq[i]) * H;
  }
  a.loss_rows[n] = static_cast<float>(loss);
  store_grad_row(a, n, z);
}

template <Loss kLoss>
OSD_INLINE void run_rows(const DistillArgs& a, int64_t begin, int64_t end, RowScratch& w) {
  for (int64_t n = begin; n < end; ++n) {
    if (a.mask != nullptr && !a.mask[n * a.mask_stride]) {
      std::fill(w.z.begin(), w.z.end(), 0.f);
      a.loss_rows[n] = 0.f;
      store_grad_row(a, n, w.z.data());
    } else if (a.topk == 0) {
      full_row<kLoss>(a, n, w);
    } else {
      topk_row<kLoss>(a, n, w);
    }
  }
}

#if defined(__x86_64__)
template <Loss kLoss>
OSD_AVX2 void run_rows_avx2(const DistillArgs& a, int64_t begin, int64_t end, RowScratch& w) {
  run_rows<kLoss>(a, begin, end, w);
}
#endif

template <Loss kLoss>
void distill_loss_cpu_kernel(const DistillArgs& a) {
  const bool avx2 = use_avx2_fma();
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    RowScratch w(a.vocab, a.topk);
#if defined(__x86_64__)
    if (avx2) {
      run_rows_avx2<kLoss>(a, begin, end, w);
      return;
    }
#endif
    run_rows<kLoss>(a, begin, end, w);
  });
}

RowView row_view(const at::Tensor& t) {
  return RowView{t.data_ptr(), t.scalar_type(), t.stride(0), t.stride(1)};
}

std::tuple<at::Tensor, at::Tensor> distill_loss_fwd_bwd_cpu(
    const at::Tensor& draft_logits, const std::optional<at::Tensor>& target_logits,
    const std::optional<at::Tensor>& topk_ids, const std::optional<at::Tensor>& topk_probs,
    const std::optional<at::Tensor>& mask, c10::string_view loss, double beta) {
  OSD_CHECK(draft_logits.device().is_cpu(), "distill_loss CPU kernel got a ",
            draft_logits.device(), " tensor");
  OSD_CHECK(draft_logits.dim() == 2, "draft_logits must be [N, V], got ", draft_logits.sizes());
  to_dtype(draft_logits, "draft_logits");
  const int64_t N = draft_logits.size(0), V = draft_logits.size(1);
  OSD_CHECK(beta >= 0.0 && beta <= 1.0, "beta must be in [0, 1], got ", beta);
  DistillArgs a{};
  a.draft = row_view(draft_logits);
  a.rows = N;
  a.vocab = V;
  a.beta = static_cast<float>(beta);
  if (mask.has_value()) {
    check_dtype(*mask, at::kBool, "mask");
    OSD_CHECK(mask->dim() == 1 && mask->size(0) == N, "mask must be [N=", N, "], got ",
              mask->sizes());
    check_same_device(draft_logits, *mask, "draft_logits", "mask");
    a.mask = mask->data_ptr<bool>();
    a.mask_stride = mask->stride(0);
  }
  const bool full = target_logits.has_value();
  OSD_CHECK(full != (topk_ids.has_value() && topk_probs.has_value()) &&
                topk_ids.has_value() == topk_probs.has_value(),
            "pass either target_logits or both topk_ids and topk_probs");
  if (full) {
    const at::Tensor& t = *target_logits;
    OSD_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == V, "target_logits must be [N=", N,
              ", V=", V, "], got ", t.sizes());
    to_dtype(t, "target_logits");
    check_same_device(draft_logits, t, "draft_logits", "target_logits");
    a.target = row_view(t);
  } else {
    const at::Tensor& ids = *topk_ids;
    const at::Tensor& probs = *topk_probs;
    check_dtype(ids, at::kLong, "topk_ids");
    OSD_CHECK(ids.dim() == 2 && ids.size(0) == N && ids.size(1) >= 1 && ids.size(1) < V,
              "topk_ids must be [N=", N, ", k] with 1 <= k < V=", V, ", got ", ids.sizes());
    OSD_CHECK(probs.sizes() == ids.sizes(), "topk_probs must be ", ids.sizes(), ", got ",
              probs.sizes());
    to_dtype(probs, "topk_probs");
    check_same_device(draft_logits, ids, "draft_logits", "topk_ids");
    check_same_device(draft_logits, probs, "draft_logits", "topk_probs");
    a.topk = ids.size(1);
    a.ids = ids.data_ptr<int64_t>();
    a.ids_stride_row = ids.stride(0);
    a.ids_stride_col = ids.stride(1);
    a.probs = row_view(probs);
    // Ids index the row buffers: they must be in range and distinct within every row that
    // is not masked out (masked rows are never read, so padding there is allowed).
    std::vector<int64_t> sorted(a.topk);
    for (int64_t n = 0; n < N; ++n) {
      if (a.mask != nullptr && !a.mask[n * a.mask_stride]) continue;
      for (int64_t i = 0; i < a.topk; ++i) {
        sorted[i] = a.ids[n * a.ids_stride_row + i * a.ids_stride_col];
        OSD_CHECK(sorted[i] >= 0 && sorted[i] < V, "topk_ids[", n, ", ", i, "]=", sorted[i],
                  " is outside the vocabulary [0, ", V, ")");
      }
      std::sort(sorted.begin(), sorted.end());
      OSD_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "topk_ids row ",
                n, " has a repeated id");
    }
  }
  at::Tensor loss_rows = at::empty({N}, draft_logits.options().dtype(at::kFloat));
  at::Tensor grad = at::empty({N, V}, draft_logits.options());
  a.loss_rows = loss_rows.data_ptr<float>();
  a.grad = grad.data_ptr();
  if (N == 0) return {loss_rows, grad};
  if (loss == "fkl") {
    distill_loss_cpu_kernel<Loss::kFkl>(a);
  } else if (loss == "rkl") {
    distill_loss_cpu_kernel<Loss::kRkl>(a);
  } else if (loss == "jsd") {
    if (beta == 0.0 || beta == 1.0) {  // m = q or m = p: identically zero
      return {loss_rows.zero_(), grad.zero_()};
    }
    distill_loss_cpu_kernel<Loss::kJsd>(a);
  } else {
    OSD_CHECK(loss == "tvd", "unknown loss '", loss, "'; expected fkl, rkl, jsd or tvd");
    distill_loss_cpu_kernel<Loss::kTvd>(a);
  }
  return {loss_rows, grad};
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) {
  m.impl("distill_loss_fwd_bwd", &osd::distill_loss_fwd_bwd_cpu);
}
