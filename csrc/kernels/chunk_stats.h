// Split-vocabulary chain sampler: chunk geometry, per-chunk records and the functions that
// build and merge them (torch-free, host and device). The CUDA kernels
// (kernels/rejection_sample_split.cu) and the C++ CPU kernel (cpu/rejection_sample_split.cpp)
// both call these, so the CPU tests exercise the decisions the GPU makes; only the loops
// around them differ (block-parallel on the GPU, serial or vectorised on the CPU).
//
// A row of V logits is cut into chunk_count(V) chunks of chunk_size(V) elements (the last
// one shorter). One pass over a chunk keeps a ChunkSummary:
//   - top: the largest raw logit and its lowest index (the greedy argmax);
//   - plain rows (temperature only): sum of scaled_exp(l, top, c) over the chunk, and the
//     exponential-race winner of the bonus draw, scaled_exp(l, top, c) / E_l with the
//     row's Philox noise (kernels/rejection_sample.h), with and without the row's draft;
//   - top-k rows: the chunk's top-k candidates (the min(k, n) largest raw logit keys, the
//     lowest indices first among equal keys) and a TopKTail describing what was not kept.
// The merge of a row's chunks gives its warped distribution (RowWarp):
//   - plain: M = max top, Z = sum of sum_c * scaled_exp(top_c, M, c), the race winner the
//     largest key_c * scaled_exp(top_c, M, c);
//   - top-k: the k-th largest raw key over at most chunks x k candidates (the union holds
//     the whole row's top k, so this is exact), its top_k_logit_floor, the kept candidates
//     and tail groups; top-p over those few items by fixed-point masses (radix selection,
//     exact and order-free); the race over the kept items.
// A tail whose unstored keys reach the floor in a way the record cannot count (two
// distinct unstored keys at or above it: only float32 logits with neighbours one ulp
// apart straddling the k-th value) sends the sequence to the one-row-per-block path
// (kernels/rejection_sample.cu), as do top-p without top-k and top-k > kSplitTopKMax.
//
// Scaled exponentials are exp((l - m) / t) computed as exp2((l - m) * c), c = log2(e) / t:
// a multiply instead of a division per element. Decisions that must match the reference
// exactly (the top-k set) are made on raw logit keys; masses agree with it to float
// rounding, as between every pair of backends.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/common.h"
#include "kernels/philox.h"
#include "kernels/radix_select.h"
#include "kernels/rejection_sample.h"

namespace osd {

// ---- geometry -----------------------------------------------------------------------

constexpr int64_t kChunkTarget = 48;    // chunks per row aimed at
constexpr int64_t kChunkAlign = 256;    // chunk sizes are multiples (16-byte loads, Philox)
constexpr int64_t kChunkMax = 4096;     // largest chunk (a GPU block stages it in shared memory)
constexpr int32_t kSplitTopKMax = 128;  // largest top-k kept as per-chunk candidates
constexpr int32_t kNoIndex = INT32_MAX;

// Elements per chunk: V / 48 rounded up to a multiple of 256, at most 4096 (V = 128,256:
// 2,816 elements, 46 chunks; V <= 12,288: one 256-element chunk per 256 tokens).
OSD_HD int64_t chunk_size(int64_t V) {
  int64_t s = (V + kChunkTarget - 1) / kChunkTarget;
  s = (s + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  return s > kChunkMax ? kChunkMax : s;
}

OSD_HD int64_t chunk_count(int64_t V) {
  const int64_t s = chunk_size(V);
  return (V + s - 1) / s;
}

// How a sequence is sampled. kLegacy: the one-block-per-sequence radix path.
enum class SplitMode : int32_t { kGreedy = 0, kPlain = 1, kTopK = 2, kLegacy = 3 };

OSD_HD SplitMode split_mode(const RowSampling& rs) {
  if (rs.greedy) return SplitMode::kGreedy;
  if (rs.top_k > 0) return rs.top_k <= kSplitTopKMax ? SplitMode::kTopK : SplitMode::kLegacy;
  return rs.top_p < 1.0f ? SplitMode::kLegacy : SplitMode::kPlain;
}

// ---- scaled exponentials -------------------------------------------------------------

constexpr float kLog2e = 1.44269504088896341f;

OSD_HD float exp2_scale(float temperature) { return kLog2e / temperature; }

// exp((l - m) / t) as exp2((l - m) * c), c = exp2_scale(t); 0 for l = -inf. m is a
// maximum the caller has taken (finite unless every l is -inf).
OSD_HD float scaled_exp(float l, float m, float c) { return exp2f((l - m) * c); }

// ---- best-of records -----------------------------------------------------------------

// A (value, index) maximum with the lowest index on ties; NaN never wins.
struct Best {
  float value;
  int32_t index;
};

OSD_HD Best best_none() { return Best{-INFINITY, kNoIndex}; }

OSD_HD void best_offer(Best& b, float value, int32_t index) {
  if (value > b.value || (value == b.value && index < b.index)) {
    b.value = value;
    b.index = index;
  }
}

OSD_HD Best best_merge(Best a, const Best& b) {
  best_offer(a, b.value, b.index);
  return a;
}

// A race winner exists: some candidate with positive residual mass was offered.
OSD_HD bool race_found(const Best& b) { return b.index != kNoIndex && b.value > 0.0f; }

// ---- top-k tails ---------------------------------------------------------------------

// The elements of a chunk not stored as candidates: their largest key, how many hold it,
// the largest key below it, and `after`: the last index stored with that key (-1: none),
// so the tail members with the largest key are the elements with that key past `after`.
struct TopKTail {
  uint32_t key;
  int32_t count;  // 0: no element left out
  uint32_t key2;  // 0: none
  int32_t after;
};

OSD_HD TopKTail tail_none() { return TopKTail{0u, 0, 0u, -1}; }

OSD_HD void tail_add(TopKTail& t, uint32_t key) {
  if (t.count > 0 && key == t.key) {
    ++t.count;
  } else if (t.count == 0 || key > t.key) {
    if (t.count > 0) t.key2 = t.key;
    t.key = key;
    t.count = 1;
  } else if (key > t.key2) {
    t.key2 = key;
  }
}

OSD_HD TopKTail tail_merge(const TopKTail& a, const TopKTail& b) {
  if (a.count == 0) return b;
  if (b.count == 0) return a;
  if (a.key == b.key) {
    return TopKTail{a.key, a.count + b.count, a.key2 > b.key2 ? a.key2 : b.key2, a.after};
  }
  const TopKTail& hi = a.key > b.key ? a : b;
  const TopKTail& lo = a.key > b.key ? b : a;
  return TopKTail{hi.key, hi.count, hi.key2 > lo.key ? hi.key2 : lo.key, hi.after};
}

// Whether element v with `key` belongs to the tail's largest-key group.
OSD_HD bool tail_member(const TopKTail& t, uint32_t key, int64_t v) {
  return t.count > 0 && key == t.key && v > t.after;
}

enum class TailKind : int32_t { kNone = 0, kKept = 1, kUnknown = 2 };

// What the warped target keeps of a tail, given the top-k floor: nothing, exactly its
// largest-key group (every unstored key below the floor but that group's), or an unknown
// set (a second unstored key at or above the floor).
OSD_HD TailKind tail_kind(const TopKTail& t, uint32_t floor) {
  if (t.count == 0 || t.key < floor) return TailKind::kNone;
  return t.key2 >= floor ? TailKind::kUnknown : TailKind::kKept;
}

// A stored top-k candidate: raw logit key and vocabulary index.
struct Candidate {
  uint32_t key;
  int32_t index;
};

// ---- per-chunk summary -----------------------------------------------------------------

struct ChunkSummary {
  Best top;        // largest raw logit, lowest index
  float sum;       // plain rows: sum of scaled_exp(l, top.value, c)
  Best race;       // plain rows: best scaled_exp(l, top.value, c) / E_l
  Best race_x;     // the same without the row's draft token
  int32_t num_cand;
  TopKTail tail;   // top-k rows
};

// The chunk's share of Z and its race keys relative to the row maximum m.
OSD_HD float chunk_scale(const ChunkSummary& s, float m, float c) {
  if (s.top.value == -INFINITY) return 0.0f;
  return s.top.value == m ? 1.0f : scaled_exp(s.top.value, m, c);
}

OSD_HD Best chunk_race_at(const Best& r, float scale) {
  return race_found(r) ? Best{r.value * scale, r.index} : best_none();
}

// ---- a row's warped distribution after the merge ---------------------------------------

struct RowWarp {
  float max;       // largest raw logit of the row
  float c;         // exp2_scale(temperature)
  float t;         // temperature
  uint32_t floor;  // top-k: smallest kept raw key (0: off)
  uint32_t p_key;  // top-p: smallest kept radix_key(p) (0: off)
  float inv_z1;    // 1 / top-k-kept mass (the p of top-p's keys)
  float z;         // kept mass, in units of scaled_exp(l, max, c)
};

// Unnormalised warped mass of raw logit l: scaled_exp on the kept set, 0 elsewhere.
OSD_HD float warped_exp(float l, const RowWarp& w) {
  if (radix_key(l) < w.floor) return 0.0f;
  const float e = scaled_exp(l, w.max, w.c);
  return radix_key(e * w.inv_z1) >= w.p_key ? e : 0.0f;
}

// log p(l) of the warped target (-inf off its support).
OSD_HD float warped_log_prob(float l, const RowWarp& w) {
  if (!(warped_exp(l, w) > 0.0f)) return -INFINITY;
  return (l - w.max) / w.t - logf(w.z);
}

// The accept test of draft i of sequence b against row i's warped target.
OSD_HD bool draft_accepted(const RejectionSampleArgs& a, const RowSampling& rs, int64_t b,
                           int64_t i, const RowWarp& w) {
  const int64_t x = a.draft_ids[b * a.draft_ids_stride_b + i * a.draft_ids_stride_k];
  float log_p = -INFINITY;
  float q = 1.0f;
  if (x >= 0 && x < a.vocab) {
    const float l = load_float(a.logits, a.logits_dtype,
                               b * a.logits_stride_b + i * a.logits_stride_k +
                                   x * a.logits_stride_v);
    log_p = warped_log_prob(l, w);
    if (a.draft_probs != nullptr) {
      q = load_float(a.draft_probs, a.draft_probs_dtype,
                     b * a.draft_probs_stride_b + i * a.draft_probs_stride_k +
                         x * a.draft_probs_stride_v);
    }
  }
  const float u = philox_uniform(rs.seed, rs.offset,
                                 philox_stream(static_cast<uint32_t>(i), kPhiloxAccept), 0);
  return accept_draft(u, q, log_p);
}

// Draft token i of sequence b (-1 when i is past the sequence's drafts).
OSD_HD int64_t draft_token(const RejectionSampleArgs& a, const RowSampling& rs, int64_t b,
                           int64_t i) {
  if (i >= rs.num_draft) return -1;
  return a.draft_ids[b * a.draft_ids_stride_b + i * a.draft_ids_stride_k];
}

// The race key of a kept item with unnormalised mass e (> 0), uniform u.
OSD_HD float item_race_key(float e, float inv_z, float u) { return race_key(e * inv_z, u); }

// The race key of the residual max(0, p - q) at a token with unnormalised mass e, or a
// non-positive value when the residual is 0 there.
OSD_HD float residual_race_key(float e, float inv_z, float q, float u) {
  const float r = residual_mass(e * inv_z, q);
  return r > 0.0f ? race_key(r, u) : 0.0f;
}

// What the merge of a row decides. token: the greedy argmax, or the bonus race winner of
// p; resid: the race winner of the residual after this row's draft is rejected (the bonus
// winner when the residual has no mass), or -1 when a second pass over the row must find
// it (draft probabilities on a plain row or beside a kept tail group).
struct RowResult {
  RowWarp warp;
  int32_t token;
  int32_t resid;
  int32_t accepted;  // this row's draft passes its test (rows before num_draft)
  int32_t unknown;   // a tail the record cannot resolve: the sequence takes the legacy path
};

// ---- kept items of a top-k row ----------------------------------------------------------

// An element (or a group of equal elements) the top-k set keeps: a stored candidate
// (index >= 0, mult 1) or a tail's largest-key group of chunk ch (index -1 - ch, mult =
// its count). e = scaled_exp of its logit relative to the row maximum.
struct KeptItem {
  uint32_t key;
  int32_t index;
  int32_t mult;
  float e;
};

OSD_HD KeptItem kept_item(uint32_t key, int32_t index, int32_t mult, float max, float c) {
  return KeptItem{key, index, mult, scaled_exp(radix_key_float(key), max, c)};
}

// The item's probability key and fixed-point mass for top-p (p = e * inv_z1, as
// warped_exp forms it for a single logit).
OSD_HD uint32_t item_p_key(const KeptItem& it, float inv_z1) { return radix_key(it.e * inv_z1); }

OSD_HD uint64_t item_p_mass(const KeptItem& it, float inv_z1) {
  return radix_mass(it.e * inv_z1) * static_cast<uint64_t>(it.mult);
}

// The three races a row may need: the bonus draw from p, the residual of a one-hot draft
// (p without the draft token x) and the residual max(0, p - q) of a draft distribution.
struct RowRaces {
  Best bonus;
  Best resid_x;
  Best resid_q;
};

OSD_HD RowRaces races_none() { return RowRaces{best_none(), best_none(), best_none()}; }

OSD_HD RowRaces races_merge(RowRaces a, const RowRaces& b) {
  best_offer(a.bonus, b.bonus.value, b.bonus.index);
  best_offer(a.resid_x, b.resid_x.value, b.resid_x.index);
  best_offer(a.resid_q, b.resid_q.value, b.resid_q.index);
  return a;
}

// Offers token v with unnormalised warped mass e > 0 and uniform u to the races (q: the
// draft probability at v, read only when has_q).
OSD_HD void races_offer(RowRaces& r, float e, float inv_z, int32_t v, int64_t x, float u,
                        bool has_q, float q) {
  const float key = item_race_key(e, inv_z, u);
  best_offer(r.bonus, key, v);
  if (v != x) best_offer(r.resid_x, key, v);
  if (has_q) best_offer(r.resid_q, residual_race_key(e, inv_z, q, u), v);
}

// The row's emitted tokens from its races: token = the bonus winner; resid = the winner
// of the residual this row's draft leaves (one-hot or q), the bonus winner when that
// residual has no mass, or -1 when q is given and the races did not cover every token of
// the residual (need_pass).
OSD_HD void races_finish(const RowRaces& r, bool has_q, bool need_pass, RowResult& out) {
  out.token = r.bonus.index == kNoIndex ? 0 : r.bonus.index;
  const Best& res = has_q ? r.resid_q : r.resid_x;
  if (has_q && need_pass) {
    out.resid = -1;
  } else {
    out.resid = race_found(res) ? res.index : out.token;
  }
}

// ---- row results and the walk over a sequence's rows ------------------------------------

// Sequence states of the CUDA path after the walk.
constexpr int32_t kSeqDone = 0;
constexpr int32_t kSeqLegacy = 1;
constexpr int32_t kSeqPassBase = 2;  // kSeqPassBase + j: row j's residual needs the pass

// The row whose token is emitted: the first row that is unresolved (-1 - i for row i) or
// rejected, or the bonus row num_draft. row(i) returns row i's RowResult; rows past the
// returned one are not read.
template <typename Rows>
OSD_HD int64_t emitted_row(const RowSampling& rs, Rows&& row) {
  for (int64_t j = 0;; ++j) {
    const RowResult r = row(j);
    if (r.unknown) return -1 - j;
    if (j == rs.num_draft || !r.accepted) return j;
  }
}

// Writes sequence b's accepted drafts and emitted token into out (-1 padded, K + 1
// entries) and its accepted count, given the emitted row j >= 0 and that row's result;
// returns a sequence state (the emitted token is left to the residual pass when the
// state says so).
OSD_HD int32_t write_sequence(const RejectionSampleArgs& a, const RowSampling& rs, int64_t b,
                              int64_t j, const RowResult& r, int64_t* out) {
  const int64_t K1 = a.num_draft_max + 1;
  for (int64_t i = 0; i < K1; ++i) out[i] = i < j ? draft_token(a, rs, b, i) : -1;
  a.num_accepted[b] = static_cast<int32_t>(j);
  if (rs.greedy || j == rs.num_draft) {
    out[j] = r.token;
    return kSeqDone;
  }
  if (r.resid < 0) return kSeqPassBase + static_cast<int32_t>(j);
  out[j] = r.resid;
  return kSeqDone;
}

}  // namespace osd
