// The split-vocabulary chain sampler on the CPU; design and shared logic:
// kernels/chunk_stats.h.
//
// Rows are visited in order and the walk stops at the first rejection, as in the one-row
// path (cpu/rejection_sample.cpp). A visited row is cut into the CUDA kernel's chunks;
// each chunk's record (ChunkSummary) comes from vectorised passes over it (max, scaled
// exponentials and their sum) or, on top-k rows, from a radix selection over the chunk
// that keeps its candidates and tail. The records are merged by the shared functions into
// the row's RowWarp, the accept test is draft_accepted. Only the emitted row runs its
// races: plain rows per chunk (Philox noise and race keys over the chunk, as the GPU's
// first pass does for every row) merged by scale; top-k rows over their kept items; a
// draft distribution's residual on a plain row (or beside a kept tail group) by a pass
// over the row, as the GPU's second pass.
#include "cpu/rejection_sample_split.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "cpu/sample_vec.h"
#include "cpu/warp_cpu.h"
#include "kernels/philox.h"

namespace osd {

void SplitScratch::ensure(int64_t V) {
  if (vocab == V) return;
  vocab = V;
  const int64_t S = chunk_size(V);
  l.resize(V);
  e.resize(V);
  p.resize(S);
  d.resize(S);
  u.resize(S);
  keys.resize(S);
  short_keys.resize(S);
  short_list.resize(S);
  tail_t0.resize(chunk_count(V));
  chunk_kth.resize(chunk_count(V));
  chunks.resize(chunk_count(V));
}

namespace {

struct Geometry {
  int64_t V, S, C;
  int64_t begin(int64_t c) const { return c * S; }
  int64_t size(int64_t c) const { return std::min(S, V - c * S); }
};

// Row i of sequence b as raw float logits: in place for float32 with a contiguous
// vocabulary, else converted into w.l.
const float* load_logits(const RejectionSampleArgs& a, int64_t b, int64_t i, SplitScratch& w) {
  const int64_t offset = b * a.logits_stride_b + i * a.logits_stride_k;
  if (a.logits_dtype == DType::kFloat32 && a.logits_stride_v == 1) {
    return static_cast<const float*>(a.logits) + offset;
  }
  load_row_any(a.logits, a.logits_dtype, offset, a.logits_stride_v, a.vocab, 1.0f, w.l.data());
  return w.l.data();
}

// The greedy token: the chunk maxima, the first chunk holding the row maximum (the
// merge of the chunks' tops, lowest index on ties), then its first index there.
int32_t greedy_token(const float* l, const Geometry& g) {
  Best best = best_none();
  for (int64_t c = 0; c < g.C; ++c) {
    best_offer(best, row_max(l + g.begin(c), g.size(c)), static_cast<int32_t>(g.begin(c)));
  }
  if (best.index == kNoIndex) return 0;
  const int64_t end = std::min(g.V, static_cast<int64_t>(best.index) + g.S);
  for (int64_t v = best.index; v < end; ++v) {
    if (l[v] == best.value) return static_cast<int32_t>(v);
  }
  return best.index;  // every logit of the chunk NaN
}

// A plain row: chunk maxima, chunk-relative exponentials (kept in w.e for the races) and
// their sums, merged into the row's warp.
RowWarp plain_row(const float* l, const Geometry& g, float t, SplitScratch& w) {
  const float c = exp2_scale(t);
  float max = -INFINITY;
  for (int64_t k = 0; k < g.C; ++k) {
    ChunkSummary& s = w.chunks[k];
    const int64_t v0 = g.begin(k), n = g.size(k);
    s.top = Best{row_max(l + v0, n), 0};
    if (s.top.value == -INFINITY) {
      std::fill(w.e.begin() + v0, w.e.begin() + v0 + n, 0.0f);
      s.sum = 0.0f;
    } else {
      s.sum = exp2_and_sum(l + v0, s.top.value, c, n, w.e.data() + v0);
    }
    max = std::max(max, s.top.value);
  }
  float z = 0.0f;
  for (int64_t k = 0; k < g.C; ++k) z += w.chunks[k].sum * chunk_scale(w.chunks[k], max, c);
  return RowWarp{max, c, t, 0u, 0u, 1.0f / z, z};
}

// The first maximum of keys[0, n) offered as chunk-local index; keys <= 0 are no winner.
Best chunk_key_best(const float* keys, int64_t n, int64_t v0) {
  const float m = row_max(keys, n);
  if (!(m > 0.0f)) return best_none();
  int64_t v = 0;
  while (keys[v] != m) ++v;
  return Best{m, static_cast<int32_t>(v0 + v)};
}

// The bonus and one-hot residual races of a plain row, chunk by chunk (keys relative to
// the chunk maximum), merged at the row maximum.
RowRaces plain_races(const RowSampling& rs, int64_t j, int64_t x, const Geometry& g,
                     const RowWarp& warp, SplitScratch& w) {
  const uint32_t stream = philox_stream(static_cast<uint32_t>(j), kPhiloxSample);
  RowRaces r = races_none();
  float* keys = w.u.data();
  for (int64_t k = 0; k < g.C; ++k) {
    const ChunkSummary& s = w.chunks[k];
    const float scale = chunk_scale(s, warp.max, warp.c);
    if (!(scale > 0.0f)) continue;
    const int64_t v0 = g.begin(k), n = g.size(k);
    philox_row(rs.seed, rs.offset, stream, v0 / 4, (n + 3) / 4, keys);
    race_keys(w.e.data() + v0, keys, n);
    Best race = chunk_key_best(keys, n, v0);
    Best race_x = race;
    if (race.index == x) {
      keys[x - v0] = 0.0f;
      race_x = chunk_key_best(keys, n, v0);
    }
    r.bonus = best_merge(r.bonus, chunk_race_at(race, scale));
    r.resid_x = best_merge(r.resid_x, chunk_race_at(race_x, scale));
  }
  return r;
}

// Chunk [v0, v0 + n) of a top-k row: its min(k, n) candidates appended to w.cand (in
// index order) and its tail, as the GPU's radix selection over the chunk defines them.
// Found here from a short list: t0, the kk-th largest of the maxima of disjoint groups of
// the chunk, is at most the kk-th largest key (kk keys reach it), so the keys >= t0 hold
// the candidates and every key below t0 lies below all of them. Those keys can only be
// the tail's second key; returns t0 when they may be (the tail then needs
// complete_tail before its second key is read), else 0. kth_out: the chunk's kk-th key.
uint32_t collect_chunk(const float* x, int64_t n, int64_t v0, int32_t k, SplitScratch& w,
                       ChunkSummary& s, uint32_t& kth_out) {
  const int64_t kk = std::min<int64_t>(k, n);
  uint32_t* keys = w.keys.data();
  for (int64_t v = 0; v < n; ++v) keys[v] = radix_key(x[v]);
  // groups of gs keys, about 2 kk of them
  const int64_t gs = std::max<int64_t>(1, n / (2 * kk));
  const int64_t groups = n / gs;
  uint32_t* short_keys = w.short_keys.data();
  for (int64_t grp = 0; grp < groups; ++grp) {
    const int64_t end = grp == groups - 1 ? n : (grp + 1) * gs;
    uint32_t m = 0;
    for (int64_t v = grp * gs; v < end; ++v) m = std::max(m, keys[v]);
    short_keys[grp] = m;
  }
  std::nth_element(short_keys, short_keys + (kk - 1), short_keys + groups,
                   std::greater<uint32_t>());
  const uint32_t t0 = short_keys[kk - 1];
  int32_t* list = w.short_list.data();
  int64_t m = 0;
  for (int64_t v = 0; v < n; ++v) {  // branch-free append
    list[m] = static_cast<int32_t>(v);
    m += keys[v] >= t0 ? 1 : 0;
  }
  for (int64_t i = 0; i < m; ++i) short_keys[i] = keys[list[i]];
  std::nth_element(short_keys, short_keys + (kk - 1), short_keys + m, std::greater<uint32_t>());
  const uint32_t kth = short_keys[kk - 1];
  int64_t need = kk;  // keys equal to kth still to store, once the greater ones are counted
  for (int64_t i = 0; i < m; ++i) need -= keys[list[i]] > kth ? 1 : 0;
  TopKTail tail = tail_none();
  int32_t last_eq = -1;
  uint32_t top = 0;
  const size_t first = w.cand.size();
  for (int64_t i = 0; i < m; ++i) {
    const int64_t v = list[i];
    const uint32_t key = keys[v];
    if (key > kth || (key == kth && need > 0)) {
      if (key == kth) {
        --need;
        last_eq = static_cast<int32_t>(v0 + v);
      }
      w.cand.push_back(Candidate{key, static_cast<int32_t>(v0 + v)});
      top = std::max(top, key);
    } else {
      tail_add(tail, key);
    }
  }
  uint32_t incomplete = 0;
  if (m < n) {  // keys below t0
    if (tail.count == 0) {
      for (int64_t v = 0; v < n; ++v) {
        if (keys[v] < t0) tail_add(tail, keys[v]);
      }
    } else {
      incomplete = t0;
    }
  }
  tail.after = (tail.count > 0 && tail.key == kth) ? last_eq : -1;
  s.top = Best{radix_key_float(top), 0};
  s.num_cand = static_cast<int32_t>(w.cand.size() - first);
  s.tail = tail;
  kth_out = kth;
  return incomplete;
}

// Completes a tail's second key with the chunk's keys below t0 (collect_chunk).
void complete_tail(const float* x, int64_t n, uint32_t t0, TopKTail& tail) {
  uint32_t below = 0;
  for (int64_t v = 0; v < n; ++v) {
    const uint32_t key = radix_key(x[v]);
    if (key < t0) below = std::max(below, key);
  }
  tail.key2 = std::max(tail.key2, below);
}

// A top-k row: chunk candidates, the exact k-th key and floor, the kept items and tail
// groups, top-p over them. Returns false when a tail is unknown (kUnknown).
bool topk_row(const float* l, const Geometry& g, const RowSampling& rs, int levels,
              SplitScratch& w, RowWarp& warp) {
  w.cand.clear();
  float max = -INFINITY;
  for (int64_t k = 0; k < g.C; ++k) {
    w.tail_t0[k] = collect_chunk(l + g.begin(k), g.size(k), g.begin(k), rs.top_k, w,
                                 w.chunks[k], w.chunk_kth[k]);
    max = std::max(max, w.chunks[k].top.value);
  }
  // The k-th largest candidate key. A chunk holding k candidates puts k keys at or above
  // its own k-th, so the largest such bound lies at or below the row's k-th and the
  // selection needs only the candidates reaching it.
  uint32_t bound = 0;
  for (int64_t k = 0; k < g.C; ++k) {
    if (w.chunks[k].num_cand == rs.top_k) bound = std::max(bound, w.chunk_kth[k]);
  }
  w.merge_keys.clear();
  for (const Candidate& cd : w.cand) {
    if (cd.key >= bound) w.merge_keys.push_back(cd.key);
  }
  const uint32_t kth = radix_select_serial(
      static_cast<int64_t>(w.merge_keys.size()), levels, static_cast<uint64_t>(rs.top_k),
      [&w](int64_t v, uint32_t& key, uint64_t& weight) {
        key = w.merge_keys[v];
        weight = 1;
      });
  const float t = rs.temperature, c = exp2_scale(t);
  const uint32_t floor = top_k_logit_floor(kth, t);
  w.items.clear();
  for (const Candidate& cd : w.cand) {
    if (cd.key >= floor) w.items.push_back(kept_item(cd.key, cd.index, 1, max, c));
  }
  for (int64_t k = 0; k < g.C; ++k) {
    TopKTail& tail = w.chunks[k].tail;
    if (tail.count > 0 && tail.key >= floor && w.tail_t0[k] != 0) {
      complete_tail(l + g.begin(k), g.size(k), w.tail_t0[k], tail);
    }
    const TailKind kind = tail_kind(tail, floor);
    if (kind == TailKind::kUnknown) return false;
    if (kind == TailKind::kKept) {
      w.items.push_back(kept_item(tail.key, static_cast<int32_t>(-1 - k), tail.count, max, c));
    }
  }
  float z1 = 0.0f;
  for (const KeptItem& it : w.items) z1 += it.e * static_cast<float>(it.mult);
  const float inv_z1 = 1.0f / z1;
  uint32_t p_key = 0;
  float z = z1;
  if (rs.top_p < 1.0f) {
    p_key = radix_select_serial(
        static_cast<int64_t>(w.items.size()), 4, radix_mass_target(rs.top_p),
        [&w, inv_z1](int64_t v, uint32_t& key, uint64_t& weight) {
          key = item_p_key(w.items[v], inv_z1);
          weight = item_p_mass(w.items[v], inv_z1);
        });
    std::erase_if(w.items, [&](const KeptItem& it) { return item_p_key(it, inv_z1) < p_key; });
    z = 0.0f;
    for (const KeptItem& it : w.items) z += it.e * static_cast<float>(it.mult);
  }
  warp = RowWarp{max, c, t, floor, p_key, inv_z1, z};
  return true;
}

float draft_prob(const RejectionSampleArgs& a, int64_t b, int64_t j, int64_t v) {
  return load_float(a.draft_probs, a.draft_probs_dtype,
                    b * a.draft_probs_stride_b + j * a.draft_probs_stride_k +
                        v * a.draft_probs_stride_v);
}

// The races of a top-k row over its kept items; tail groups offer each member. Returns
// whether a tail group was kept (then q's residual needs the pass over the row).
bool topk_races(const RejectionSampleArgs& a, const RowSampling& rs, int64_t b, int64_t j,
                int64_t x, const float* l, const Geometry& g, const RowWarp& warp,
                const SplitScratch& w, RowRaces& r) {
  const uint32_t stream = philox_stream(static_cast<uint32_t>(j), kPhiloxSample);
  const bool has_q = a.draft_probs != nullptr;
  const float inv_z = 1.0f / warp.z;
  bool group = false;
  const auto offer = [&](const KeptItem& it, int64_t v) {
    const float u = philox_uniform(rs.seed, rs.offset, stream, static_cast<uint32_t>(v));
    const float q = has_q ? draft_prob(a, b, j, v) : 0.0f;
    races_offer(r, it.e, inv_z, static_cast<int32_t>(v), x, u, has_q, q);
  };
  for (const KeptItem& it : w.items) {
    if (!(it.e > 0.0f)) continue;
    if (it.index >= 0) {
      offer(it, it.index);
      continue;
    }
    group = true;
    const int64_t k = -1 - it.index;
    const TopKTail& tail = w.chunks[k].tail;
    for (int64_t v = g.begin(k); v < g.begin(k) + g.size(k); ++v) {
      if (tail_member(tail, radix_key(l[v]), v)) offer(it, v);
    }
  }
  return group;
}

// The residual max(0, p - q) race of row j over the whole row (the GPU's second pass); a
// plain row reads its exponentials from plain_row's w.e.
Best residual_pass(const RejectionSampleArgs& a, const RowSampling& rs, int64_t b, int64_t j,
                   const float* l, const Geometry& g, const RowWarp& warp, bool plain,
                   SplitScratch& w) {
  const uint32_t stream = philox_stream(static_cast<uint32_t>(j), kPhiloxSample);
  const float inv_z = 1.0f / warp.z;
  const int64_t q_base = b * a.draft_probs_stride_b + j * a.draft_probs_stride_k;
  Best best = best_none();
  if (!plain) {  // a kept tail group beside top-k / top-p: element by element
    for (int64_t v = 0; v < g.V; ++v) {
      const float e = warped_exp(l[v], warp);
      if (!(e > 0.0f)) continue;
      const float u = philox_uniform(rs.seed, rs.offset, stream, static_cast<uint32_t>(v));
      best_offer(best, residual_race_key(e, inv_z, draft_prob(a, b, j, v), u),
                 static_cast<int32_t>(v));
    }
    return best;
  }
  for (int64_t k = 0; k < g.C; ++k) {
    const int64_t v0 = g.begin(k), n = g.size(k);
    float* p = w.p.data();
    float* d = w.d.data();
    float* keys = w.u.data();
    // p from the chunk-relative exponentials plain_row kept for this row
    const float scale = chunk_scale(w.chunks[k], warp.max, warp.c);
    if (!(scale > 0.0f)) continue;
    scale_row(w.e.data() + v0, scale * inv_z, n, p);
    load_row_any(a.draft_probs, a.draft_probs_dtype, q_base + v0 * a.draft_probs_stride_v,
                 a.draft_probs_stride_v, n, 1.0f, d);
    residual_row(p, d, n);
    philox_row(rs.seed, rs.offset, stream, v0 / 4, (n + 3) / 4, keys);
    race_keys(d, keys, n);
    best = best_merge(best, chunk_key_best(keys, n, v0));
  }
  return best;
}

}  // namespace

bool rejection_sample_split_sequence(const RejectionSampleArgs& a, int64_t b, SplitScratch& w) {
  const RowSampling rs = row_sampling(a, b);
  const SplitMode mode = split_mode(rs);
  if (mode == SplitMode::kLegacy) return false;
  w.ensure(a.vocab);
  const Geometry g{a.vocab, chunk_size(a.vocab), chunk_count(a.vocab)};
  int64_t* out = a.out_tokens + b * (a.num_draft_max + 1);
  RowResult row{};
  int64_t j = 0;
  const float* l = nullptr;
  if (mode == SplitMode::kGreedy) {
    for (;; ++j) {
      row.token = greedy_token(load_logits(a, b, j, w), g);
      if (j == rs.num_draft || draft_token(a, rs, b, j) != row.token) break;
    }
    write_sequence(a, rs, b, j, row, out);
    return true;
  }
  const int levels = radix_levels(a.logits_dtype);
  for (;; ++j) {
    l = load_logits(a, b, j, w);
    if (mode == SplitMode::kPlain) {
      row.warp = plain_row(l, g, rs.temperature, w);
    } else if (!topk_row(l, g, rs, levels, w, row.warp)) {
      return false;
    }
    if (j == rs.num_draft) break;
    if (!draft_accepted(a, rs, b, j, row.warp)) break;
  }
  const int64_t x = draft_token(a, rs, b, j);
  const bool has_q = a.draft_probs != nullptr;
  const bool rejected = j < rs.num_draft;
  const bool plain = mode == SplitMode::kPlain;
  RowRaces races = races_none();
  bool need_pass = false;
  if (plain && has_q && rejected) {
    // the residual's own pass; the bonus race only when the residual has no mass
    const Best best = residual_pass(a, rs, b, j, l, g, row.warp, true, w);
    if (race_found(best)) {
      row.resid = best.index;
      write_sequence(a, rs, b, j, row, out);
      return true;
    }
    races = plain_races(rs, j, x, g, row.warp, w);
  } else if (plain) {
    races = plain_races(rs, j, x, g, row.warp, w);
  } else {
    need_pass = topk_races(a, rs, b, j, x, l, g, row.warp, w, races) && has_q;
  }
  races_finish(races, has_q, need_pass, row);
  if (row.resid < 0 && rejected) {
    const Best best = residual_pass(a, rs, b, j, l, g, row.warp, false, w);
    row.resid = race_found(best) ? best.index : row.token;
  }
  write_sequence(a, rs, b, j, row, out);
  return true;
}

}  // namespace osd
