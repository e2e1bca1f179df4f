// rejection_sample: schema, argument checks, and the C++ CPU kernel.
// Semantics, randomness layout and the derivation: kernels/rejection_sample.h.
//
// One sequence per task (at::parallel_for over the batch). Each visited row is converted
// once into a float scratch row s = logits / temperature; (max, sum exp) come from two
// vectorisable passes, the accept test needs only the draft token's log-probability, and
// only the one rejected or bonus row runs the exponential race. Rows after the first
// rejection are never read. Top-k uses a size-k heap (nth_element for large k) and top-p a
// three-way quickselect on probability mass (expected O(V), no sort).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "cpu/glue.h"
#include "kernels/philox.h"
#include "kernels/rejection_sample.h"

namespace osd {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The vector loops are compiled twice, for AVX2 and for the baseline, and picked at load
// time. No FMA is enabled, so both clones round identically.
#define OSD_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))

// exp(x) in float for x <= 0 (the callers pass s - max), Cephes expf polynomial, within
// 1 ulp, written without float comparisons so the compiler vectorises the loops that
// call it. Below -104 (and for -inf) the result is exactly 0.
inline float fast_exp(float x) {
  // n = round(x / ln 2) by the 1.5 * 2^23 trick; its integer value sits in the low bits
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const int32_t ni = std::bit_cast<int32_t>(shifted) - 0x4B400000;
  const int32_t n1 = ni >> 1;
  const int32_t n2 = ni - n1;
  const float s1 = std::bit_cast<float>((n1 + 127) << 23);
  const float s2 = std::bit_cast<float>((n2 + 127) << 23);
  // zero below -104 (where the scale factors are no longer valid), by the sign of x + 104
  const int32_t keep = ~(std::bit_cast<int32_t>(x + 104.0f) >> 31);
  return std::bit_cast<float>(std::bit_cast<int32_t>(y * s1 * s2) & keep);
}

// log(u) for normal u > 0 (Cephes logf polynomial, within 2 ulp), branch-free.
inline float fast_log(float u) {
  const int32_t bits = std::bit_cast<int32_t>(u);
  const int32_t mant = bits & 0x007FFFFF;
  const float m = std::bit_cast<float>(mant | 0x3F000000);  // [0.5, 1)
  // 1 when m < sqrt(1/2), from the sign of an integer difference (a comparison would stop
  // the compiler from vectorising the loop)
  const float small = static_cast<float>(-((mant - 0x3504F3) >> 31));
  const float e = static_cast<float>((bits >> 23) - 126) - small;
  const float x = (m - 1.0f) + m * small;  // 2m - 1 below sqrt(1/2), else m - 1
  const float z = x * x;
  float y = 7.0376836292e-2f;
  y = y * x - 1.1514610310e-1f;
  y = y * x + 1.1676998740e-1f;
  y = y * x - 1.2420140846e-1f;
  y = y * x + 1.4249322787e-1f;
  y = y * x - 1.6668057665e-1f;
  y = y * x + 2.0000714765e-1f;
  y = y * x - 2.4999993993e-1f;
  y = y * x + 3.3333331174e-1f;
  y = y * x * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return (x + y) + 0.693359375f * e;
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// dst[v] = src[v * stride] (as float), divided by `temperature` when it is not 1.
template <typename T>
void load_row(const T* src, int64_t stride, int64_t n, float temperature, float* dst) {
  if (stride == 1) {
    for (int64_t v = 0; v < n; ++v) dst[v] = to_float(src[v]);
  } else {
    for (int64_t v = 0; v < n; ++v) dst[v] = to_float(src[v * stride]);
  }
  if (temperature != 1.0f) {
    for (int64_t v = 0; v < n; ++v) dst[v] = dst[v] / temperature;
  }
}

void load_row_any(const void* base, DType dtype, int64_t offset, int64_t stride, int64_t n,
                  float temperature, float* dst) {
  switch (dtype) {
    case DType::kFloat16:
      load_row(static_cast<const c10::Half*>(base) + offset, stride, n, temperature, dst);
      break;
    case DType::kBFloat16:
      load_row(static_cast<const c10::BFloat16*>(base) + offset, stride, n, temperature, dst);
      break;
    default:
      load_row(static_cast<const float*>(base) + offset, stride, n, temperature, dst);
  }
}

OSD_VECTOR_CLONES float row_max(const float* x, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = kNegInf;
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] = std::max(acc[l], x[v + l]);
  }
  float m = kNegInf;
  for (int l = 0; l < kLanes; ++l) m = std::max(m, acc[l]);
  for (; v < n; ++v) m = std::max(m, x[v]);
  return m;
}

// Index of the first maximum of x (lowest index on ties).
int64_t row_argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  for (int64_t v = 0; v < n; ++v) {
    if (x[v] == m) return v;
  }
  return 0;
}

OSD_VECTOR_CLONES float sum(const float* x, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[v + l];
  }
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  for (; v < n; ++v) total += x[v];
  return total;
}

// e[v] = exp(s[v] - max); returns sum e.
OSD_VECTOR_CLONES float exp_and_sum(const float* s, float max, int64_t n, float* e) {
  for (int64_t v = 0; v < n; ++v) e[v] = fast_exp(s[v] - max);
  return sum(e, n);
}

// The k-th largest value of s (1 <= k < n). Small k: a size-k min-heap, where almost every
// element is rejected by one comparison with the heap's top; large k: nth_element on a copy.
float kth_largest(const float* s, int64_t n, int64_t k, float* tmp) {
  if (k > 1024) {
    std::copy(s, s + n, tmp);
    std::nth_element(tmp, tmp + (k - 1), tmp + n, std::greater<float>());
    return tmp[k - 1];
  }
  float* heap = tmp;
  std::copy(s, s + k, heap);
  std::make_heap(heap, heap + k, std::greater<float>());
  for (int64_t v = k; v < n; ++v) {
    if (s[v] > heap[0]) {
      std::pop_heap(heap, heap + k, std::greater<float>());
      heap[k - 1] = s[v];
      std::push_heap(heap, heap + k, std::greater<float>());
    }
  }
  return heap[0];
}

// Top-p threshold on probabilities p (normalised over the top-k set): the smallest value
// tau among the positive p such that the mass of values strictly greater than tau is
// < top_p. Three-way quickselect on a copy of the positive entries, expected O(n).
float top_p_threshold(const float* e, int64_t n, float inv_z, float top_p, float* tmp) {
  int64_t m = 0;
  for (int64_t v = 0; v < n; ++v) {
    if (e[v] > 0.0f) tmp[m++] = e[v] * inv_z;
  }
  const double target = top_p;
  double above = 0.0;  // mass of every value greater than those left in tmp[0, m)
  float best = 0.0f;
  float* lo = tmp;
  while (m > 0) {
    const float a = lo[0], b = lo[m / 2], c = lo[m - 1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    // [0, g): > pivot, [g, g + q): == pivot, [g + q, m): < pivot
    float* mid = std::partition(lo, lo + m, [pivot](float x) { return x > pivot; });
    float* low = std::partition(mid, lo + m, [pivot](float x) { return x == pivot; });
    double mass_g = 0.0, mass_e = 0.0;
    for (float* p = lo; p < mid; ++p) mass_g += *p;
    for (float* p = mid; p < low; ++p) mass_e += *p;
    if (above + mass_g >= target) {
      m = mid - lo;  // the pivot is dropped: the threshold lies among the larger values
      continue;
    }
    best = pivot;  // the pivot is kept; try the smaller values
    above += mass_g + mass_e;
    if (above >= target) break;
    m = (lo + m) - low;
    lo = low;
  }
  return best;
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
  for (int64_t v = 0; v < n; ++v) u[v] = r[v] / -fast_log(u[v]);
}

struct Scratch {
  std::vector<float> s, e, t;
  explicit Scratch(int64_t v) : s(v), e(v), t(4 * ((v + 3) / 4)) {}
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
  load_row_any(a.logits, a.logits_dtype, b * a.logits_stride_b + i * a.logits_stride_k,
               a.logits_stride_v, V, rs.temperature, s);
  if (rs.top_k > 0) {
    const float kth = kth_largest(s, V, rs.top_k, w.t.data());
    for (int64_t v = 0; v < V; ++v) s[v] = s[v] < kth ? kNegInf : s[v];
  }
  const float max = row_max(s, V);
  float* e = w.e.data();
  float z = exp_and_sum(s, max, V, e);
  if (rs.top_p < 1.0f) {
    const float inv_z = 1.0f / z;
    const float tau = top_p_threshold(e, V, inv_z, rs.top_p, w.t.data());
    for (int64_t v = 0; v < V; ++v) e[v] = e[v] * inv_z < tau ? 0.0f : e[v];
    z = sum(e, V);
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
    int64_t token = 0;
    for (;; ++j) {
      load_row_any(a.logits, a.logits_dtype, b * a.logits_stride_b + j * a.logits_stride_k,
                   a.logits_stride_v, V, 1.0f, w.s.data());
      token = row_argmax(w.s.data(), V);
      if (j == rs.num_draft || drafts[j * a.draft_ids_stride_k] != token) break;
      out[j] = token;
    }
    out[j] = token;
    a.num_accepted[b] = static_cast<int32_t>(j);
    return;
  }
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

RejectionSampleArgs make_rejection_sample_args(
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
  const struct { const at::Tensor& t; at::ScalarType st; const char* name; } params[] = {
      {num_draft, at::kInt, "num_draft_tokens"}, {temperature, at::kFloat, "temperature"},
      {top_k, at::kInt, "top_k"}, {top_p, at::kFloat, "top_p"}, {seed, at::kLong, "seed"},
      {offset, at::kLong, "offset"}};
  for (const auto& p : params) {
    check_dtype(p.t, p.st, p.name);
    OSD_CHECK(p.t.dim() == 1 && p.t.size(0) == B && p.t.is_contiguous(), p.name,
              " must be contiguous [B=", B, "], got ", p.t.sizes());
    check_same_device(logits, p.t, "target_logits", p.name);
  }
  RejectionSampleArgs a{};
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
  a.temperature = temperature.data_ptr<float>();
  a.top_k = top_k.data_ptr<int32_t>();
  a.top_p = top_p.data_ptr<float>();
  a.seed = seed.data_ptr<int64_t>();
  a.offset = offset.data_ptr<int64_t>();
  a.out_tokens = out.data_ptr<int64_t>();
  a.num_accepted = accepted.data_ptr<int32_t>();
  a.batch = B;
  a.num_draft_max = K;
  a.vocab = V;
  return a;
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

TORCH_LIBRARY_FRAGMENT(osd, m) {
  // Chain speculative-sampling verification: accepted drafts + one recovered/bonus token.
  m.def(
      "rejection_sample(Tensor target_logits, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor num_draft_tokens, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
      "Tensor offset) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("rejection_sample", &osd::rejection_sample_cpu_op); }
