// rejection_sample: the C++ CPU kernel (shared checks: rejection_sample_checks.h).
// Semantics, randomness layout and the derivation: kernels/rejection_sample.h.
//
// One sequence per task (at::parallel_for over the batch). Greedy, temperature-only and
// top-k <= kSplitTopKMax sequences take the split-vocabulary path
// (cpu/rejection_sample_split.cpp, the logic the CUDA kernels share through
// kernels/chunk_stats.h; OSD_SAMPLER_SPLIT=0 turns it off: sampler_split in
// rejection_sample_checks.h); the others (top-p without top-k, larger top-k, a top-k tail the
// chunk records cannot resolve) take the one-row path below. There each visited row is
// converted once into a float scratch row s = logits / temperature; (max, sum exp) come
// from two vectorisable passes, the accept test needs only the draft token's
// log-probability, and only the one rejected or bonus row runs the exponential race. Rows
// after the first rejection are never read. The top-k and top-p thresholds come from the
// radix selection the CUDA kernel uses, with serial histograms (cpu/warp_cpu.h,
// kernels/radix_select.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/rejection_sample_split.h"
#include "cpu/sample_vec.h"
#include "cpu/warp_cpu.h"
#include "kernels/philox.h"
#include "kernels/rejection_sample.h"
#include "rejection_sample_checks.h"

namespace osd {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread rows of V floats, allocated on first use: greedy rows over float32 logits
// with a contiguous vocab read the logits in place and need none.
struct Scratch {
  int64_t v;
  std::vector<float> s, e, t;
  explicit Scratch(int64_t vocab) : v(vocab) {}
  void ensure() {
    if (s.empty()) {
      s.resize(v);
      e.resize(v);
      t.resize(4 * ((v + 3) / 4));
    }
  }
};

// Warped target row i of sequence b: s (scaled logits), e = masked exp(s - max) and its
// sum z; returns max. e is zero exactly for tokens the warped target gives no mass.
struct WarpedRow {
  float max;
  float z;
};

WarpedRow warp_row(const RejectionSampleArgs& a, const RowSampling& rs, int64_t b, int64_t i,
                   Scratch& w) {
  const int64_t V = a.vocab;
  float* s = w.s.data();
  const int64_t offset = b * a.logits_stride_b + i * a.logits_stride_k;
  load_scaled_row(a.logits, a.logits_dtype, offset, a.logits_stride_v, V, rs.top_k,
                  rs.temperature, s);
  const float max = row_max(s, V);
  float* e = w.e.data();
  float z = exp_and_sum(s, max, V, e);
  if (rs.top_p < 1.0f) {
    const float inv_z = 1.0f / z;
    const uint32_t keep = top_p_key(e, V, inv_z, rs.top_p);
    for (int64_t v = 0; v < V; ++v) e[v] = radix_key(e[v] * inv_z) < keep ? 0.0f : e[v];
    z = row_sum(e, V);
  }
  return WarpedRow{max, z};
}

// Sample the emitted token of row j from the residual (after a rejection of draft x) or
// from p_j (bonus), by the exponential race with the row's Philox noise.
int64_t race_row(const RejectionSampleArgs& a, const RowSampling& rs, int64_t b, int64_t j,
                 bool rejected, int64_t x, const WarpedRow& row, Scratch& w) {
  const int64_t V = a.vocab;
  float* e = w.e.data();
  float* r = w.s.data();  // s is no longer needed
  const float inv_z = 1.0f / row.z;
  for (int64_t v = 0; v < V; ++v) r[v] = e[v] * inv_z;
  if (rejected) {
    float* d = w.t.data();
    bool any = false;
    if (a.draft_probs != nullptr) {
      const int64_t base = b * a.draft_probs_stride_b + j * a.draft_probs_stride_k;
      load_row_any(a.draft_probs, a.draft_probs_dtype, base, a.draft_probs_stride_v, V, 1.0f, d);
      residual_row(r, d, V);
      any = row_max(d, V) > 0.0f;
      if (any) std::copy(d, d + V, r);
    } else if (x >= 0 && x < V) {
      for (int64_t v = 0; v < V && !any; ++v) any = v != x && r[v] > 0.0f;
      if (any) r[x] = 0.0f;
    }
  }
  const uint32_t stream = philox_stream(static_cast<uint32_t>(j), kPhiloxSample);
  // top-p or top-k leave few positive rates: race those alone (the same winner)
  const int64_t sparse = race_sparse(r, V, rs.seed, rs.offset, stream);
  if (sparse >= 0) return sparse;
  float* u = w.t.data();
  const int64_t nblocks = (V + 3) / 4;
  philox_row(rs.seed, rs.offset, stream, 0, nblocks, u);
  race_keys(r, u, V);
  // r >= 0 and some r > 0, so the first maximal key has r > 0
  return row_argmax(u, V);
}

void sample_sequence(const RejectionSampleArgs& a, int64_t b, Scratch& w) {
  const RowSampling rs = row_sampling(a, b);
  const int64_t K1 = a.num_draft_max + 1;
  const int64_t V = a.vocab;
  int64_t* out = a.out_tokens + b * K1;
  for (int64_t i = 0; i < K1; ++i) out[i] = -1;
  const int64_t* drafts = a.draft_ids + b * a.draft_ids_stride_b;
  int64_t j = 0;
  if (rs.greedy) {
    const bool in_place = a.logits_dtype == DType::kFloat32 && a.logits_stride_v == 1;
    if (!in_place) w.ensure();
    int64_t token = 0;
    for (;; ++j) {
      const int64_t offset = b * a.logits_stride_b + j * a.logits_stride_k;
      const float* row = static_cast<const float*>(a.logits) + offset;
      if (!in_place) {
        load_row_any(a.logits, a.logits_dtype, offset, a.logits_stride_v, V, 1.0f, w.s.data());
        row = w.s.data();
      }
      token = row_argmax(row, V);
      if (j == rs.num_draft || drafts[j * a.draft_ids_stride_k] != token) break;
      out[j] = token;
    }
    out[j] = token;
    a.num_accepted[b] = static_cast<int32_t>(j);
    return;
  }
  w.ensure();
  WarpedRow row{};
  int64_t x = -1;
  bool rejected = false;
  for (;; ++j) {
    row = warp_row(a, rs, b, j, w);
    if (j == rs.num_draft) break;
    x = drafts[j * a.draft_ids_stride_k];
    const bool in_vocab = x >= 0 && x < V;
    const float log_p = (in_vocab && w.e[x] > 0.0f)
                            ? (w.s[x] - row.max) - std::log(row.z)
                            : kNegInf;
    float q = 1.0f;
    if (a.draft_probs != nullptr && in_vocab) {
      q = load_float(a.draft_probs, a.draft_probs_dtype,
                     b * a.draft_probs_stride_b + j * a.draft_probs_stride_k +
                         x * a.draft_probs_stride_v);
    }
    const float u = philox_uniform(rs.seed, rs.offset,
                                   philox_stream(static_cast<uint32_t>(j), kPhiloxAccept), 0);
    if (!accept_draft(u, q, log_p)) {
      rejected = true;
      break;
    }
    out[j] = x;
  }
  out[j] = race_row(a, rs, b, j, rejected, x, row, w);
  a.num_accepted[b] = static_cast<int32_t>(j);
}

}  // namespace

void rejection_sample_cpu(const RejectionSampleArgs& a, bool split) {
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    Scratch w(a.vocab);
    thread_local SplitScratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      if (!split || !rejection_sample_split_sequence(a, b, scratch)) sample_sequence(a, b, w);
    }
  });
}

namespace {

std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu_op(
    const at::Tensor& logits, const at::Tensor& draft_ids,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& num_draft,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& seed, const at::Tensor& offset) {
  OSD_CHECK(logits.device().is_cpu(), "rejection_sample CPU kernel got a ", logits.device(),
            " tensor");
  at::Tensor out, accepted;
  const auto a = make_rejection_sample_args(logits, draft_ids, draft_probs, num_draft,
                                            temperature, top_k, top_p, seed, offset, out,
                                            accepted);
  rejection_sample_cpu(a, sampler_split(false));
  return {out, accepted};
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("rejection_sample", &osd::rejection_sample_cpu_op); }
