// tree_rejection_sample: fused verification of a token tree (torch-free).
//
// Tree of sequence b: T nodes, parents[i] < i, node 0 the root (parent -1); a node i > 0
// whose parent is -1 (or out of range) is absent. Row i of the logits scores node i's
// children; row i of the draft probabilities is the distribution they were drawn from.
// The walk keeps a current node `cur` (starting at the root) and scans c = 1 .. T-1 once;
// node c is a candidate iff parents[c] == cur, depth(cur) < max_depth and its token x is
// in [0, V). Since children follow their parent, the scan visits every child of every node
// on the path in index order. Per candidate (j = its rank among cur's candidates):
//
//   greedy rows      accept iff x == argmax logits[cur] (lowest index on ties).
//   draft probs      a = s / z (0 if z <= 0); accept iff u_j * (a * q[x]) < r[x] with
//                    u_j = u(stream(cur, accept), j). This is u < p_j(x) / q_j(x) with
//                    p_j = r / s and q_j = q / z. On rejection r <- max(0, r - a * q)
//                    (= s * (p_j - q_j), so the residual stays unnormalised), s <- sum r,
//                    and without replacement z <- z - q[x] (q_j excludes the earlier
//                    siblings; a candidate repeating a rejected sibling's token is skipped).
//   point masses     one uniform u = u(stream(cur, accept), 0) per node: with t the mass
//                    of the siblings tried so far, accept iff u < t + r[x]; on rejection
//                    t <- t + r[x] and r[x] <- 0 (repeated tokens add nothing).
//
// Entering a node (the root, or an accepted child) sets r = p (the warped target row of
// the node, normalised, so s = 1), z = 1, t = 0. When the scan ends, the emitted token is
// the argmax of logits[cur] (greedy) or the exponential race argmax_v r_v / E_v over
// r_v > 0 with E_v = -log u(stream(cur, sample), v). It falls back to p when the residual
// has no mass: s <= kTreeResidualEps with draft probs (s is exactly the probability of
// having rejected every sibling, so this moves the output by at most 1e-5 in total
// variation and keeps round-off in max(0, p - q) from being sampled), no positive entry
// with point masses (whose residual has no round-off).
//
// Outputs (D = max_depth): accepted_nodes[b] = 0, then the accepted nodes; out_tokens[b] =
// their tokens, then the emitted token; both -1 padded to D + 1.
//
// Warping of p is osd_kernels.warp.warp_probs (see kernels/rejection_sample.h).
#pragma once
#include <cstdint>

#include "kernels/common.h"
#include "kernels/philox.h"
#include "kernels/rejection_sample.h"

namespace osd {

// Residual mass treated as round-off (draft-probability mode; see above).
constexpr float kTreeResidualEps = 1e-5f;

struct TreeRejectionSampleArgs {
  const void* logits;             // [B, T, V] target logits
  DType logits_dtype;
  int64_t logits_stride_b, logits_stride_t, logits_stride_v;
  const int64_t* tokens;          // [B, T] node tokens
  int64_t tokens_stride_b, tokens_stride_t;
  const int32_t* parents;         // [B, T]
  int64_t parents_stride_b, parents_stride_t;
  const void* draft_probs;        // [B, T, V] or nullptr (point-mass drafts)
  DType draft_probs_dtype;
  int64_t draft_probs_stride_b, draft_probs_stride_t, draft_probs_stride_v;
  const float* temperature;       // [B], 0 = greedy
  const int32_t* top_k;           // [B], <= 0 or >= V = off
  const float* top_p;             // [B], >= 1 = off
  const int64_t* seed;            // [B]
  const int64_t* offset;          // [B]
  int64_t* accepted_nodes;        // [B, D+1] contiguous
  int64_t* out_tokens;            // [B, D+1] contiguous
  int32_t* num_accepted;          // [B]
  float* workspace;               // [B, 2, V] warped target and residual rows (CUDA only)
  int64_t batch;
  int64_t num_nodes;              // T
  int64_t vocab;                  // V
  int64_t max_depth;              // D
  bool without_replacement;
};

// CPU kernel (parallel over the batch). Defined in csrc/cpu/tree_rejection_sample.cpp.
void tree_rejection_sample_cpu(const TreeRejectionSampleArgs& args);

// Token of node c if it is a candidate child of `cur` at depth `depth`, else -1.
OSD_HD int64_t tree_candidate(const TreeRejectionSampleArgs& a, int64_t b, int64_t c,
                              int64_t cur, int64_t depth) {
  if (depth >= a.max_depth) return -1;
  if (a.parents[b * a.parents_stride_b + c * a.parents_stride_t] != cur) return -1;
  const int64_t x = a.tokens[b * a.tokens_stride_b + c * a.tokens_stride_t];
  return (x >= 0 && x < a.vocab) ? x : -1;
}

// Multiplication that is never fused into an FMA, so every backend rounds alike.
OSD_HD float mul_rn(float x, float y) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(x, y);
#else
  return x * y;
#endif
}

// Scale of the draft against the residual: s / z (0 once the draft has no mass left).
OSD_HD float tree_draft_scale(float s, float z) { return z > 0.0f ? s / z : 0.0f; }

// Accept test with draft probabilities: u < p_j(x) / q_j(x), i.e. u * (a * q(x)) < r(x).
OSD_HD bool tree_accept_draft(float u, float a, float q_x, float r_x) {
  return mul_rn(u, mul_rn(a, q_x)) < r_x;
}

// Residual entry after a rejection: max(0, r - a * q).
OSD_HD float tree_residual(float r, float a, float q) {
  const float d = r - mul_rn(a, q);
  return d > 0.0f ? d : 0.0f;
}

// Philox uniform of the j-th candidate at node `node` (point masses use j = 0).
OSD_HD float tree_accept_uniform(const RowSampling& rs, int64_t node, int64_t j) {
  return philox_uniform(rs.seed, rs.offset,
                        philox_stream(static_cast<uint32_t>(node), kPhiloxAccept),
                        static_cast<uint32_t>(j));
}

// Output rows of sequence b: the root as the first accepted node, -1 everywhere else.
OSD_HD void tree_init_row(const TreeRejectionSampleArgs& a, int64_t b) {
  const int64_t w = a.max_depth + 1;
  for (int64_t i = 0; i < w; ++i) {
    a.accepted_nodes[b * w + i] = i == 0 ? 0 : -1;
    a.out_tokens[b * w + i] = -1;
  }
}

// Records the acceptance of node c (token x) at depth `depth` (before the step).
OSD_HD void tree_record_accept(const TreeRejectionSampleArgs& a, int64_t b, int64_t depth,
                               int64_t c, int64_t x) {
  const int64_t w = a.max_depth + 1;
  a.out_tokens[b * w + depth] = x;
  a.accepted_nodes[b * w + depth + 1] = c;
}

// Records the emitted token after `depth` accepted nodes.
OSD_HD void tree_record_emit(const TreeRejectionSampleArgs& a, int64_t b, int64_t depth,
                             int64_t token) {
  a.out_tokens[b * (a.max_depth + 1) + depth] = token;
  a.num_accepted[b] = static_cast<int32_t>(depth);
}

}  // namespace osd
