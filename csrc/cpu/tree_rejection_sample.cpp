// tree_rejection_sample: the C++ CPU kernel (shared checks:
// tree_rejection_sample_checks.h).
// Semantics, randomness layout and the walk: kernels/tree_rejection_sample.h.
//
// One sequence per task (at::parallel_for over the batch), with four float scratch rows
// of V: the warped target p of the current node, its residual r, its draft row q and the
// race's uniforms. Entering a node warps its logits row once (top-k and top-p thresholds
// by the GPU's radix selection: cpu/warp_cpu.h); a rejection costs one pass over V
// (residual update and its sum); the emitted token costs one race pass. Greedy rows only
// take the argmax of each row on the path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/warp_cpu.h"
#include "kernels/philox.h"
#include "kernels/tree_rejection_sample.h"
#include "tree_rejection_sample_checks.h"

namespace osd {
namespace {

// Per-thread rows of V floats, allocated on first use: greedy rows over float32 logits
// with a contiguous vocab read the logits in place and need none.
struct Scratch {
  int64_t v;
  std::vector<float> p, r, q, t;
  std::vector<int64_t> rejected;  // tokens of the rejected siblings (without replacement)
  explicit Scratch(int64_t vocab) : v(vocab) {}
  void ensure() {
    if (p.empty()) {
      p.resize(v);
      r.resize(v);
      q.resize(v);
      t.resize(4 * ((v + 3) / 4));
    }
  }
};

// p = the warped target row (node `node` of sequence b), as osd_kernels.warp.warp_probs.
void warp_row(const TreeRejectionSampleArgs& a, const RowSampling& rs, int64_t b,
              int64_t node, Scratch& w) {
  const int64_t V = a.vocab;
  float* p = w.p.data();
  const int64_t offset = b * a.logits_stride_b + node * a.logits_stride_t;
  load_scaled_row(a.logits, a.logits_dtype, offset, a.logits_stride_v, V, rs.top_k,
                  rs.temperature, p);
  const float max = row_max(p, V);
  for (int64_t v = 0; v < V; ++v) p[v] = std::exp(p[v] - max);
  const float inv = 1.0f / row_sum(p, V);
  for (int64_t v = 0; v < V; ++v) p[v] = p[v] * inv;
  if (rs.top_p < 1.0f) {
    const uint32_t keep = top_p_key(p, V, 1.0f, rs.top_p);
    for (int64_t v = 0; v < V; ++v) p[v] = radix_key(p[v]) < keep ? 0.0f : p[v];
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
  const bool in_place = a.logits_dtype == DType::kFloat32 && a.logits_stride_v == 1;
  if (!in_place) w.ensure();
  auto argmax_of = [&](int64_t node) {
    const int64_t offset = b * a.logits_stride_b + node * a.logits_stride_t;
    if (in_place) return row_argmax(static_cast<const float*>(a.logits) + offset, V);
    load_row_any(a.logits, a.logits_dtype, offset, a.logits_stride_v, V, 1.0f, w.p.data());
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
  w.ensure();
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
      const RowSampling rs = sequence_sampling(a, b);
      if (rs.greedy) {
        greedy_walk(a, b, w);
      } else {
        stochastic_walk(a, rs, b, w);
      }
    }
  });
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

TORCH_LIBRARY_IMPL(osd, CPU, m) {
  m.impl("tree_rejection_sample", &osd::tree_rejection_sample_cpu_op);
}
