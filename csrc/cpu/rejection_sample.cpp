// rejection_sample: the C++ CPU kernel (shared checks: rejection_sample_checks.h).
// Semantics, randomness layout and the derivation: kernels/rejection_sample.h.
//
// One sequence per task (at::parallel_for over the batch). Each visited row is converted
// once into a float scratch row s = logits / temperature; (max, sum exp) come from two
// vectorisable passes, the accept test needs only the draft token's log-probability, and
// only the one rejected or bonus row runs the exponential race. Rows after the first
// rejection are never read. The top-k and top-p thresholds come from the radix selection
// the CUDA kernel uses, with serial histograms (cpu/warp_cpu.h, kernels/radix_select.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cephes.h"
#include "cpu/warp_cpu.h"
#include "kernels/philox.h"
#include "kernels/rejection_sample.h"
#include "rejection_sample_checks.h"

namespace osd {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) in float for x <= 0 (the callers pass s - max), Cephes expf polynomial, within
// 1 ulp, written without float comparisons so the compiler vectorises the loops that
// call it. Below -104 (and for -inf) the result is exactly 0.
inline float fast_exp(float x) {
  // n = round(x / ln 2) by the 1.5 * 2^23 trick; its integer value sits in the low bits
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  const float y = exp_poly(r) * (r * r) + r + 1.0f;
  const int32_t ni = std::bit_cast<int32_t>(shifted) - 0x4B400000;
  const int32_t n1 = ni >> 1;
  const int32_t n2 = ni - n1;
  const float s1 = std::bit_cast<float>((n1 + 127) << 23);
  const float s2 = std::bit_cast<float>((n2 + 127) << 23);
  // zero below -104 (where the scale factors are no longer valid), by the sign of x + 104
  const int32_t keep = ~(std::bit_cast<int32_t>(x + 104.0f) >> 31);
  return std::bit_cast<float>(std::bit_cast<int32_t>(y * s1 * s2) & keep);
}

// e[v] = exp(s[v] - max); returns sum e.
OSD_VECTOR_CLONES float exp_and_sum(const float* s, float max, int64_t n, float* e) {
  for (int64_t v = 0; v < n; ++v) e[v] = fast_exp(s[v] - max);
  return row_sum(e, n);
}

// d[v] = residual_mass(p[v], d[v]) = max(0, p - q), zeroing the non-positive differences
// by their sign bit so the loop vectorises.
OSD_VECTOR_CLONES void residual_row(const float* p, float* d, int64_t n) {
  for (int64_t v = 0; v < n; ++v) {
    const int32_t diff = std::bit_cast<int32_t>(p[v] - d[v]);
    d[v] = std::bit_cast<float>(diff & ~(diff >> 31));
  }
}

// Uniforms u(seed, offset, stream, v) for v in [0, 4 * nblocks), four per Philox call.
// The rounds are spelled out on plain integers so the compiler vectorises across blocks.
OSD_VECTOR_CLONES
void philox_row(uint64_t seed, uint64_t offset, uint32_t stream, int64_t nblocks, float* u) {
  const uint32_t o0 = static_cast<uint32_t>(offset), o1 = static_cast<uint32_t>(offset >> 32);
  const uint32_t s0 = static_cast<uint32_t>(seed), s1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    uint32_t c0 = static_cast<uint32_t>(blk), c1 = stream, c2 = o0, c3 = o1;
    uint32_t k0 = s0, k1 = s1;
    for (int r = 0; r < 10; ++r) {
      const uint64_t pa = static_cast<uint64_t>(kPhiloxMulA) * c0;
      const uint64_t pb = static_cast<uint64_t>(kPhiloxMulB) * c2;
      c0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
      c1 = static_cast<uint32_t>(pb);
      c2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
      c3 = static_cast<uint32_t>(pa);
      k0 += kPhiloxWeylA;
      k1 += kPhiloxWeylB;
    }
    u[4 * blk + 0] = philox_to_uniform(c0);
    u[4 * blk + 1] = philox_to_uniform(c1);
    u[4 * blk + 2] = philox_to_uniform(c2);
    u[4 * blk + 3] = philox_to_uniform(c3);
  }
}

// Exponential-race keys in place: u[v] <- r[v] / -log(u[v]).
OSD_VECTOR_CLONES void race_keys(const float* r, float* u, int64_t n) {
  for (int64_t v = 0; v < n; ++v) u[v] = r[v] / -log_pos(u[v]);
}

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
  float* u = w.t.data();
  const int64_t nblocks = (V + 3) / 4;
  philox_row(rs.seed, rs.offset, philox_stream(static_cast<uint32_t>(j), kPhiloxSample),
             nblocks, u);
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

void rejection_sample_cpu(const RejectionSampleArgs& a) {
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    Scratch w(a.vocab);
    for (int64_t b = begin; b < end; ++b) sample_sequence(a, b, w);
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
  rejection_sample_cpu(a);
  return {out, accepted};
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("rejection_sample", &osd::rejection_sample_cpu_op); }
