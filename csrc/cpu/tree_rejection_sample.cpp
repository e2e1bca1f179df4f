// tree_rejection_sample: schema, argument checks, and the C++ CPU kernel.
// Semantics, randomness layout and the walk: kernels/tree_rejection_sample.h.
//
// One sequence per task (at::parallel_for over the batch), with four float scratch rows
// of V: the warped target p of the current node, its residual r, its draft row q and a
// selection buffer. Entering a node warps its logits row once (top-k by nth_element,
// top-p by a three-way quickselect on probability mass, no sort); a rejection costs one
// pass over V (residual update and its sum); the emitted token costs one race pass.
// Greedy rows only take the argmax of each row on the path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "cpu/glue.h"
#include "kernels/philox.h"
#include "kernels/tree_rejection_sample.h"

namespace osd {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kLanes = 16;

// dst[v] = src[v * stride] as float, divided by `temperature` (the reference's x / t).
template <typename T>
void load_row(const T* src, int64_t stride, int64_t n, float temperature, float* dst) {
  for (int64_t v = 0; v < n; ++v) dst[v] = static_cast<float>(src[v * stride]);
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

float row_max(const float* x, int64_t n) {
  float acc[kLanes];
  std::fill(acc, acc + kLanes, -kInf);
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] = std::max(acc[l], x[v + l]);
  }
  float m = -kInf;
  for (int l = 0; l < kLanes; ++l) m = std::max(m, acc[l]);
  for (; v < n; ++v) m = std::max(m, x[v]);
  return m;
}

float row_sum(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[v + l];
  }
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; v < n; ++v) s += x[v];
  return s;
}

// Index of the first maximum (lowest index on ties).
int64_t row_argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  for (int64_t v = 0; v < n; ++v) {
    if (x[v] == m) return v;
  }
  return 0;
}

// Top-p threshold of probabilities p (sum ~1): the smallest kept value, where value x is
// kept iff the mass of values strictly greater than x is < top_p. Three-way quickselect
// on a copy of the positive entries (expected O(n)); ties are kept or dropped together.
float top_p_threshold(const float* p, int64_t n, float top_p, float* tmp) {
  int64_t m = 0;
  for (int64_t v = 0; v < n; ++v) {
    if (p[v] > 0.0f) tmp[m++] = p[v];
  }
  double above = 0.0;  // mass of the values larger than everything left in [lo, lo + m)
  float best = kInf;
  float* lo = tmp;
  while (m > 0) {
    const float a = lo[0], b = lo[m / 2], c = lo[m - 1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    float* mid = std::partition(lo, lo + m, [pivot](float x) { return x > pivot; });
    float* low = std::partition(mid, lo + m, [pivot](float x) { return x == pivot; });
    double mass_gt = 0.0, mass_eq = 0.0;
    for (float* q = lo; q < mid; ++q) mass_gt += *q;
    for (float* q = mid; q < low; ++q) mass_eq += *q;
    if (above + mass_gt >= top_p) {  // the pivot is dropped: look among the larger values
      m = mid - lo;
      continue;
    }
    best = pivot;  // the pivot and everything larger is kept: look among the smaller
    above += mass_gt + mass_eq;
    m = (lo + m) - low;
    lo = low;
  }
  return best;
}

struct Scratch {
  std::vector<float> p, r, q, t;
  std::vector<int64_t> rejected;  // tokens of the rejected siblings (without replacement)
  explicit Scratch(int64_t v) : p(v), r(v), q(v), t(4 * ((v + 3) / 4)) {}
};

// p = the warped target row (node `node` of sequence b), as osd_kernels.warp.warp_probs.
void warp_row(const TreeRejectionSampleArgs& a, const RowSampling& rs, int64_t b,
              int64_t node, Scratch& w) {
  const int64_t V = a.vocab;
  float* p = w.p.data();
  load_row_any(a.logits, a.logits_dtype, b * a.logits_stride_b + node * a.logits_stride_t,
               a.logits_stride_v, V, rs.temperature, p);
  if (rs.top_k > 0) {
    float* t = w.t.data();
    std::copy(p, p + V, t);
    std::nth_element(t, t + (rs.top_k - 1), t + V, std::greater<float>());
    const float kth = t[rs.top_k - 1];
    for (int64_t v = 0; v < V; ++v) p[v] = p[v] < kth ? -kInf : p[v];
  }
  const float max = row_max(p, V);
  for (int64_t v = 0; v < V; ++v) p[v] = std::exp(p[v] - max);
  const float inv = 1.0f / row_sum(p, V);
  for (int64_t v = 0; v < V; ++v) p[v] = p[v] * inv;
  if (rs.top_p < 1.0f) {
    const float tau = top_p_threshold(p, V, rs.top_p, w.t.data());
    for (int64_t v = 0; v < V; ++v) p[v] = p[v] < tau ? 0.0f : p[v];
    const float z = row_sum(p, V);
    for (int64_t v = 0; v < V; ++v) p[v] = p[v] / z;
  }
}

// Exponential race over weights w > 0 with the noise of node `node`.
int64_t race(const RowSampling& rs, int64_t node, const float* w, int64_t V, float* u) {
  const uint32_t stream = philox_stream(static_cast<uint32_t>(node), kPhiloxSample);
  for (int64_t blk = 0; blk < (V + 3) / 4; ++blk) {
    const Philox4 x = philox_block(rs.seed, rs.offset, stream, static_cast<uint32_t>(blk));
    for (int i = 0; i < 4; ++i) u[4 * blk + i] = philox_to_uniform(x.x[i]);
  }
  float best = -1.0f;
  int64_t best_v = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (w[v] > 0.0f) race_update(race_key(w[v], u[v]), v, best, best_v);
  }
  return best_v;
}

void greedy_walk(const TreeRejectionSampleArgs& a, int64_t b, Scratch& w) {
  const int64_t V = a.vocab;
  int64_t cur = 0, depth = 0;
  auto argmax_of = [&](int64_t node) {
    load_row_any(a.logits, a.logits_dtype, b * a.logits_stride_b + node * a.logits_stride_t,
                 a.logits_stride_v, V, 1.0f, w.p.data());
    return row_argmax(w.p.data(), V);
  };
  int64_t best = argmax_of(cur);
  for (int64_t c = 1; c < a.num_nodes; ++c) {
    const int64_t x = tree_candidate(a, b, c, cur, depth);
    if (x < 0 || x != best) continue;
    tree_record_accept(a, b, depth, c, x);
    ++depth;
    cur = c;
    best = argmax_of(cur);
  }
  tree_record_emit(a, b, depth, best);
}

void stochastic_walk(const TreeRejectionSampleArgs& a, const RowSampling& rs, int64_t b,
                     Scratch& w) {
  const int64_t V = a.vocab;
  const bool has_q = a.draft_probs != nullptr;
  float* p = w.p.data();
  float* r = w.r.data();
  float* q = w.q.data();
  int64_t cur = 0, depth = 0, rank = 0;
  float s = 1.0f, z = 1.0f, tried = 0.0f, u_node = 0.0f;
  std::vector<int64_t>& rejected = w.rejected;
  auto enter = [&](int64_t node) {
    warp_row(a, rs, b, node, w);
    std::copy(p, p + V, r);
    if (has_q) {
      load_row_any(a.draft_probs, a.draft_probs_dtype,
                   b * a.draft_probs_stride_b + node * a.draft_probs_stride_t,
                   a.draft_probs_stride_v, V, 1.0f, q);
    } else {
      u_node = tree_accept_uniform(rs, node, 0);
    }
    s = 1.0f;
    z = 1.0f;
    tried = 0.0f;
    rank = 0;
    rejected.clear();
  };
  enter(cur);
  for (int64_t c = 1; c < a.num_nodes; ++c) {
    const int64_t x = tree_candidate(a, b, c, cur, depth);
    if (x < 0) continue;
    const int64_t j = rank++;
    bool ok;
    if (!has_q) {
      const float next = tried + r[x];
      ok = u_node < next;
      if (!ok) {
        tried = next;
        r[x] = 0.0f;
      }
    } else {
      if (a.without_replacement &&
          std::find(rejected.begin(), rejected.end(), x) != rejected.end()) {
        continue;  // q_j gives a repeated sibling no mass: skipped
      }
      const float scale = tree_draft_scale(s, z);
      ok = tree_accept_draft(tree_accept_uniform(rs, cur, j), scale, q[x], r[x]);
      if (!ok) {
        for (int64_t v = 0; v < V; ++v) r[v] = tree_residual(r[v], scale, q[v]);
        s = row_sum(r, V);
        if (a.without_replacement) {
          z = z - q[x];
          rejected.push_back(x);
        }
      }
    }
    if (ok) {
      tree_record_accept(a, b, depth, c, x);
      ++depth;
      cur = c;
      enter(cur);
    }
  }
  const bool empty = has_q ? s <= kTreeResidualEps : row_max(r, V) <= 0.0f;
  tree_record_emit(a, b, depth, race(rs, cur, empty ? p : r, V, w.t.data()));
}

}  // namespace

void tree_rejection_sample_cpu(const TreeRejectionSampleArgs& a) {
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    Scratch w(a.vocab);
    for (int64_t b = begin; b < end; ++b) {
      tree_init_row(a, b);
      const RowSampling rs = tree_row_sampling(a, b);
      if (rs.greedy) {
        greedy_walk(a, b, w);
      } else {
        stochastic_walk(a, rs, b, w);
      }
    }
  });
}

TreeRejectionSampleArgs make_tree_rejection_sample_args(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& seed,
    const at::Tensor& offset, int64_t max_depth, bool without_replacement,
    at::Tensor& accepted_nodes, at::Tensor& out_tokens, at::Tensor& num_accepted) {
  OSD_CHECK(logits.dim() == 3, "target_logits must be [B, T, V], got ", logits.sizes());
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  OSD_CHECK(T >= 1 && V >= 1, "target_logits needs T >= 1 and V >= 1, got ", logits.sizes());
  OSD_CHECK(V < (int64_t{1} << 31), "vocab size ", V, " does not fit the Philox index");
  OSD_CHECK(max_depth >= 0 && max_depth < T, "max_depth must be in [0, T=", T, "), got ",
            max_depth);
  check_dtype(tokens, at::kLong, "node_token_ids");
  check_dtype(parents, at::kInt, "parents");
  OSD_CHECK(tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) == T,
            "node_token_ids must be [B=", B, ", T=", T, "], got ", tokens.sizes());
  OSD_CHECK(parents.dim() == 2 && parents.size(0) == B && parents.size(1) == T,
            "parents must be [B=", B, ", T=", T, "], got ", parents.sizes());
  check_same_device(logits, tokens, "target_logits", "node_token_ids");
  check_same_device(logits, parents, "target_logits", "parents");
  const struct { const at::Tensor& t; at::ScalarType st; const char* name; } params[] = {
      {temperature, at::kFloat, "temperature"}, {top_k, at::kInt, "top_k"},
      {top_p, at::kFloat, "top_p"}, {seed, at::kLong, "seed"}, {offset, at::kLong, "offset"}};
  for (const auto& p : params) {
    check_dtype(p.t, p.st, p.name);
    OSD_CHECK(p.t.dim() == 1 && p.t.size(0) == B && p.t.is_contiguous(), p.name,
              " must be contiguous [B=", B, "], got ", p.t.sizes());
    check_same_device(logits, p.t, "target_logits", p.name);
  }
  TreeRejectionSampleArgs a{};
  a.logits = logits.data_ptr();
  a.logits_dtype = to_dtype(logits, "target_logits");
  a.logits_stride_b = logits.stride(0);
  a.logits_stride_t = logits.stride(1);
  a.logits_stride_v = logits.stride(2);
  a.tokens = tokens.data_ptr<int64_t>();
  a.tokens_stride_b = tokens.stride(0);
  a.tokens_stride_t = tokens.stride(1);
  a.parents = parents.data_ptr<int32_t>();
  a.parents_stride_b = parents.stride(0);
  a.parents_stride_t = parents.stride(1);
  a.draft_probs = nullptr;
  a.draft_probs_dtype = DType::kFloat32;
  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    OSD_CHECK(q.dim() == 3 && q.size(0) == B && q.size(1) == T && q.size(2) == V,
              "draft_probs must be [B=", B, ", T=", T, ", V=", V, "], got ", q.sizes());
    check_same_device(logits, q, "target_logits", "draft_probs");
    a.draft_probs = q.data_ptr();
    a.draft_probs_dtype = to_dtype(q, "draft_probs");
    a.draft_probs_stride_b = q.stride(0);
    a.draft_probs_stride_t = q.stride(1);
    a.draft_probs_stride_v = q.stride(2);
  }
  accepted_nodes = at::empty({B, max_depth + 1}, logits.options().dtype(at::kLong));
  out_tokens = at::empty({B, max_depth + 1}, logits.options().dtype(at::kLong));
  num_accepted = at::empty({B}, logits.options().dtype(at::kInt));
  a.temperature = temperature.data_ptr<float>();
  a.top_k = top_k.data_ptr<int32_t>();
  a.top_p = top_p.data_ptr<float>();
  a.seed = seed.data_ptr<int64_t>();
  a.offset = offset.data_ptr<int64_t>();
  a.accepted_nodes = accepted_nodes.data_ptr<int64_t>();
  a.out_tokens = out_tokens.data_ptr<int64_t>();
  a.num_accepted = num_accepted.data_ptr<int32_t>();
  a.workspace = nullptr;
  a.batch = B;
  a.num_nodes = T;
  a.vocab = V;
  a.max_depth = max_depth;
  a.without_replacement = without_replacement;
  return a;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_rejection_sample_cpu_op(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& seed,
    const at::Tensor& offset, int64_t max_depth, bool without_replacement) {
  OSD_CHECK(logits.device().is_cpu(), "tree_rejection_sample CPU kernel got a ",
            logits.device(), " tensor");
  at::Tensor nodes, out, accepted;
  const auto a = make_tree_rejection_sample_args(logits, tokens, parents, draft_probs,
                                                 temperature, top_k, top_p, seed, offset,
                                                 max_depth, without_replacement, nodes, out,
                                                 accepted);
  tree_rejection_sample_cpu(a);
  return {nodes, out, accepted};
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_FRAGMENT(osd, m) {
  // Token-tree verification: accepted path (node indices), its tokens + one emitted token.
  m.def(
      "tree_rejection_sample(Tensor target_logits, Tensor node_token_ids, Tensor parents, "
      "Tensor? draft_probs, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
      "Tensor offset, int max_depth, bool without_replacement) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(osd, CPU, m) {
  m.impl("tree_rejection_sample", &osd::tree_rejection_sample_cpu_op);
}
