// CUDA split-vocabulary chain sampler. Design, records and the shared decisions:
// kernels/chunk_stats.h (the C++ CPU kernel, cpu/rejection_sample_split.cpp, calls the
// same functions); semantics: kernels/rejection_sample.h.
//
// First pass, one block per (sequence b, row i, chunk c), B x (K + 1) x C blocks: the
// block stages its chunk of the row in shared memory (one 16-byte-load pass over global
// memory), writes the chunk's ChunkSummary (and, on top-k rows, its candidates, in index
// order from a block scan) and counts itself done on the row. The last block of a row
// merges the row's C records into its RowResult: greedy argmax; or the warped
// distribution (plain: max and Z; top-k: the exact k-th key by radix selection over the
// candidates, the floor, kept items compacted into shared memory, top-p by fixed-point
// radix selection over them), the draft's accept test and the races. The last row of a
// sequence to finish walks its rows and writes the outputs (emitted_row, write_sequence).
// Rows past num_draft and sequences of split_mode kLegacy exit at once.
//
// Residual pass, one block per (sequence, chunk), only with draft probabilities: a
// sequence whose rejected row's residual max(0, p - q) was not resolved by the merge
// (plain rows, or a kept tail group) reads that row's chunk of logits and of q, offers
// every token with residual mass to the race, and the last block writes the winner (p's
// bonus winner when the residual has no mass). Other sequences' blocks exit at once.
//
// Workspace counters are atomics on global memory, ordered by __threadfence: the blocks
// that merge read the others' records with __ldcg (bypassing L1). Float reductions have a
// fixed order (per-thread partials, then warp shuffles, then warps in order), so the
// outputs are reproducible.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/block_reduce.cuh"
#include "kernels/chunk_stats.h"
#include "kernels/rejection_sample_cuda.h"

namespace osd {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxItems = static_cast<int>(kChunkMax * sizeof(float) / sizeof(KeptItem));

struct Workspace {
  ChunkSummary* chunks;
  Candidate* cand;
  RowResult* rows;
  Best* resid;
  int32_t* row_count;
  int32_t* seq_count;
  int32_t* resid_count;
  int32_t* state;
};

__device__ __forceinline__ Workspace workspace(const RejectionSampleArgs& a) {
  const SplitLayout l = split_layout(a.batch, a.num_draft_max + 1, a.vocab);
  char* base = static_cast<char*>(a.workspace);
  return Workspace{reinterpret_cast<ChunkSummary*>(base + l.chunks),
                   reinterpret_cast<Candidate*>(base + l.candidates),
                   reinterpret_cast<RowResult*>(base + l.rows),
                   reinterpret_cast<Best*>(base + l.resid),
                   a.counters + l.row_count,
                   a.counters + l.seq_count,
                   a.counters + l.resid_count,
                   a.counters + l.state};
}

struct Shared {
  union {
    float vals[kChunkMax];      // the staged chunk
    KeptItem items[kMaxItems];  // a top-k row's kept items (the merge)
  };
  RadixShared radix;
  alignas(16) unsigned char slots[kWarps * 32];  // block_allreduce partials
  uint32_t scan[kWarps];
  int32_t last_eq;
  int32_t flag;
};

template <typename T, typename Op>
__device__ __forceinline__ T block_allreduce(T x, Op op, Shared& sh) {
  static_assert(sizeof(T) <= sizeof(sh.slots) / kWarps, "slot size");
  return osd::block_allreduce<kWarps>(x, op, sh.slots);
}

__device__ __forceinline__ float block_max(float x, Shared& sh) {
  return block_allreduce(x, [](float p, float q) { return fmaxf(p, q); }, sh);
}

__device__ __forceinline__ float block_sum(float x, Shared& sh) {
  return block_allreduce(x, [](float p, float q) { return p + q; }, sh);
}

__device__ __forceinline__ Best block_best(Best x, Shared& sh) {
  return block_allreduce(x, [](Best p, const Best& q) { return best_merge(p, q); }, sh);
}

__device__ __forceinline__ RowRaces block_races(RowRaces x, Shared& sh) {
  return block_allreduce(x, [](RowRaces p, const RowRaces& q) { return races_merge(p, q); }, sh);
}

__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t x, uint32_t& total,
                                                         Shared& sh) {
  return osd::block_exclusive_scan<kWarps>(x, total, sh.scan);
}

__device__ __forceinline__ bool last_to_arrive(int32_t* counter, int32_t target, Shared& sh) {
  return osd::last_to_arrive(counter, target, &sh.flag);
}

struct Chunk {
  int64_t b, i, c, v0, n;
};

// ---- first pass: one chunk -------------------------------------------------------------

__device__ void greedy_chunk(const Chunk& ch, Shared& sh, ChunkSummary& s) {
  Best best = best_none();
  for (int64_t v = threadIdx.x; v < ch.n; v += kThreads) {
    best_offer(best, sh.vals[v], static_cast<int32_t>(ch.v0 + v));
  }
  s.top = block_best(best, sh);
}

__device__ void plain_chunk(const RejectionSampleArgs& a, const RowSampling& rs,
                            const Chunk& ch, Shared& sh, ChunkSummary& s) {
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < ch.n; v += kThreads) m = fmaxf(m, sh.vals[v]);
  m = block_max(m, sh);
  s.top = Best{m, 0};
  s.sum = 0.0f;
  s.race = best_none();
  s.race_x = best_none();
  if (m == -INFINITY) return;
  const float c = exp2_scale(rs.temperature);
  const int64_t x = draft_token(a, rs, ch.b, ch.i);
  const uint32_t stream = philox_stream(static_cast<uint32_t>(ch.i), kPhiloxSample);
  float sum = 0.0f;
  Best race = best_none(), race_x = best_none();
  // four consecutive tokens per thread and Philox block (chunks start at multiples of 4)
  for (int64_t g = threadIdx.x; 4 * g < ch.n; g += kThreads) {
    const Philox4 w = philox_block(rs.seed, rs.offset, stream,
                                   static_cast<uint32_t>(ch.v0 / 4 + g));
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int64_t v = 4 * g + l;
      if (v >= ch.n) break;
      const float e = scaled_exp(sh.vals[v], m, c);
      sum += e;
      if (e > 0.0f) {
        const float key = race_key(e, philox_to_uniform(philox_word(w, l)));
        const int32_t id = static_cast<int32_t>(ch.v0 + v);
        best_offer(race, key, id);
        if (id != x) best_offer(race_x, key, id);
      }
    }
  }
  s.sum = block_sum(sum, sh);
  s.race = block_best(race, sh);
  s.race_x = block_best(race_x, sh);
}

// The chunk's min(k, n) largest keys (lowest indices first among equal keys) written to
// cand in index order, and its tail.
template <typename T>
__device__ void topk_chunk(const RowSampling& rs, const Chunk& ch, Candidate* cand, Shared& sh,
                           ChunkSummary& s) {
  const int64_t kk = rs.top_k < ch.n ? rs.top_k : ch.n;
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < ch.n; v += kThreads) m = fmaxf(m, sh.vals[v]);
  s.top = Best{block_max(m, sh), 0};
  const uint32_t kth = block_radix_select<kThreads>(
      radix_levels(DTypeOf<T>::value), static_cast<uint64_t>(kk), sh.radix,
      [&](const RadixState& st) {
        for (int64_t v = threadIdx.x; v < ch.n; v += kThreads) {
          const uint32_t key = radix_key(sh.vals[v]);
          if (radix_in_range(key, st)) radix_add_count(sh.radix, radix_digit(key, st));
        }
      });
  // each thread takes a contiguous run of the chunk; (greater, equal) counts scanned
  const int64_t per = (ch.n + kThreads - 1) / kThreads;
  const int64_t lo = threadIdx.x * per;
  const int64_t hi = lo + per < ch.n ? lo + per : ch.n;
  uint32_t greater = 0, equal = 0;
  for (int64_t v = lo; v < hi; ++v) {
    const uint32_t key = radix_key(sh.vals[v]);
    greater += key > kth ? 1u : 0u;
    equal += key == kth ? 1u : 0u;
  }
  if (threadIdx.x == 0) sh.last_eq = -1;
  uint32_t total = 0;
  const uint32_t before = block_exclusive_scan((greater << 16) | equal, total, sh);
  const int64_t need = kk - static_cast<int64_t>(total >> 16);  // equal keys stored
  int64_t g_before = before >> 16, e_before = before & 0xFFFFu;
  TopKTail tail = tail_none();
  for (int64_t v = lo; v < hi; ++v) {
    const uint32_t key = radix_key(sh.vals[v]);
    const int32_t id = static_cast<int32_t>(ch.v0 + v);
    if (key > kth) {
      cand[g_before + (e_before < need ? e_before : need)] = Candidate{key, id};
      ++g_before;
    } else if (key == kth && e_before < need) {
      cand[g_before + e_before] = Candidate{key, id};
      if (e_before == need - 1) sh.last_eq = id;
      ++e_before;
    } else {
      if (key == kth) ++e_before;
      tail_add(tail, key);
    }
  }
  const auto merge = [](const TopKTail& p, const TopKTail& q) { return tail_merge(p, q); };
  tail = block_allreduce(tail, merge, sh);
  tail.after = (tail.count > 0 && tail.key == kth) ? sh.last_eq : -1;
  s.tail = tail;
  s.num_cand = static_cast<int32_t>(kk);
}

// ---- first pass: the merge of a row ---------------------------------------------------------

__device__ RowResult merge_greedy(const RejectionSampleArgs& a, const RowSampling& rs,
                                  const Chunk& ch, const ChunkSummary* chunks, int64_t C,
                                  Shared& sh) {
  Best best = best_none();
  for (int64_t k = threadIdx.x; k < C; k += kThreads) {
    best = best_merge(best, load_cg(chunks + k).top);
  }
  best = block_best(best, sh);
  RowResult r{};
  r.token = best.index == kNoIndex ? 0 : best.index;
  r.accepted = ch.i < rs.num_draft && draft_token(a, rs, ch.b, ch.i) == r.token;
  return r;
}

__device__ RowResult merge_plain(const RejectionSampleArgs& a, const RowSampling& rs,
                                 const Chunk& ch, const ChunkSummary* chunks, int64_t C,
                                 Shared& sh) {
  float m = -INFINITY;
  for (int64_t k = threadIdx.x; k < C; k += kThreads) m = fmaxf(m, load_cg(chunks + k).top.value);
  m = block_max(m, sh);
  const float c = exp2_scale(rs.temperature);
  float z = 0.0f;
  RowRaces races = races_none();
  for (int64_t k = threadIdx.x; k < C; k += kThreads) {
    const ChunkSummary s = load_cg(chunks + k);
    const float scale = chunk_scale(s, m, c);
    z += s.sum * scale;
    races.bonus = best_merge(races.bonus, chunk_race_at(s.race, scale));
    races.resid_x = best_merge(races.resid_x, chunk_race_at(s.race_x, scale));
  }
  z = block_sum(z, sh);
  races = block_races(races, sh);
  RowResult r{};
  r.warp = RowWarp{m, c, rs.temperature, 0u, 0u, 1.0f / z, z};
  const bool has_q = a.draft_probs != nullptr;
  races_finish(races, has_q, has_q, r);
  return r;
}

template <typename T>
__device__ RowResult merge_topk(const RejectionSampleArgs& a, const RowSampling& rs,
                                const Chunk& ch, const ChunkSummary* chunks,
                                const Candidate* cand, int64_t C, int64_t S, Shared& sh) {
  const int64_t V = a.vocab, k = rs.top_k;
  const auto num_cand = [&](int64_t chunk) {
    const int64_t n = V - chunk * S < S ? V - chunk * S : S;
    return n < k ? n : k;
  };
  float m = -INFINITY;
  for (int64_t q = threadIdx.x; q < C; q += kThreads) m = fmaxf(m, load_cg(chunks + q).top.value);
  m = block_max(m, sh);
  // the k-th largest key over every chunk's candidates (slot s of chunk q at q * kMax + s)
  const int64_t slots = C * k;
  const uint32_t kth = block_radix_select<kThreads>(
      radix_levels(DTypeOf<T>::value), static_cast<uint64_t>(k), sh.radix,
      [&](const RadixState& st) {
        for (int64_t f = threadIdx.x; f < slots; f += kThreads) {
          const int64_t q = f / k, s = f % k;
          if (s >= num_cand(q)) continue;
          const uint32_t key = load_cg(cand + q * kSplitTopKMax + s).key;
          if (radix_in_range(key, st)) radix_add_count(sh.radix, radix_digit(key, st));
        }
      });
  const float t = rs.temperature, c = exp2_scale(t);
  const uint32_t floor = top_k_logit_floor(kth, t);
  // kept candidates, then kept tail groups, compacted in order into shared memory
  const int64_t per = (slots + kThreads - 1) / kThreads;
  const int64_t lo = threadIdx.x * per, hi = lo + per < slots ? lo + per : slots;
  uint32_t mine = 0;
  for (int64_t f = lo; f < hi; ++f) {
    if (f % k < num_cand(f / k) && load_cg(cand + (f / k) * kSplitTopKMax + f % k).key >= floor) {
      ++mine;
    }
  }
  uint32_t kept = 0;
  uint32_t at = block_exclusive_scan(mine, kept, sh);
  __syncthreads();  // the staged chunk is no longer read: items reuse its memory
  for (int64_t f = lo; f < hi; ++f) {
    if (f % k >= num_cand(f / k)) continue;
    const Candidate cd = load_cg(cand + (f / k) * kSplitTopKMax + f % k);
    if (cd.key >= floor && at < kMaxItems) sh.items[at++] = kept_item(cd.key, cd.index, 1, m, c);
  }
  uint32_t groups = 0;
  int unknown = 0;
  for (int64_t q = threadIdx.x; q < C; q += kThreads) {
    const TailKind kind = tail_kind(load_cg(chunks + q).tail, floor);
    groups += kind == TailKind::kKept ? 1u : 0u;
    unknown |= kind == TailKind::kUnknown ? 1 : 0;
  }
  uint32_t num_groups = 0;
  at = kept + block_exclusive_scan(groups, num_groups, sh);
  for (int64_t q = threadIdx.x; q < C; q += kThreads) {
    const TopKTail tail = load_cg(chunks + q).tail;
    if (tail_kind(tail, floor) == TailKind::kKept && at < kMaxItems) {
      sh.items[at++] = kept_item(tail.key, static_cast<int32_t>(-1 - q), tail.count, m, c);
    }
  }
  const int64_t n_items = kept + num_groups;
  unknown = block_allreduce(unknown | (n_items > kMaxItems ? 1 : 0),
                            [](int p, int q) { return p | q; }, sh);
  RowResult r{};
  if (unknown) {
    r.unknown = 1;
    return r;
  }
  float z1 = 0.0f;
  for (int64_t it = threadIdx.x; it < n_items; it += kThreads) {
    z1 += sh.items[it].e * static_cast<float>(sh.items[it].mult);
  }
  z1 = block_sum(z1, sh);
  const float inv_z1 = 1.0f / z1;
  uint32_t p_key = 0;
  float z = z1;
  if (rs.top_p < 1.0f) {
    p_key = block_radix_select<kThreads>(
        4, radix_mass_target(rs.top_p), sh.radix, [&](const RadixState& st) {
          for (int64_t it = threadIdx.x; it < n_items; it += kThreads) {
            const uint32_t key = item_p_key(sh.items[it], inv_z1);
            const uint64_t mass = item_p_mass(sh.items[it], inv_z1);
            if (mass != 0 && radix_in_range(key, st)) {
              radix_add_mass(sh.radix, radix_digit(key, st), mass);
            }
          }
        });
    z = 0.0f;
    for (int64_t it = threadIdx.x; it < n_items; it += kThreads) {
      if (item_p_key(sh.items[it], inv_z1) >= p_key) {
        z += sh.items[it].e * static_cast<float>(sh.items[it].mult);
      }
    }
    z = block_sum(z, sh);
  }
  r.warp = RowWarp{m, c, t, floor, p_key, inv_z1, z};
  // races over the kept items; a tail group offers each of its members
  const float inv_z = 1.0f / z;
  const uint32_t stream = philox_stream(static_cast<uint32_t>(ch.i), kPhiloxSample);
  const int64_t x = draft_token(a, rs, ch.b, ch.i);
  const bool has_q = a.draft_probs != nullptr;
  const int64_t q_row = ch.b * a.draft_probs_stride_b + ch.i * a.draft_probs_stride_k;
  const auto offer = [&](RowRaces& races, const KeptItem& it, int64_t v) {
    const float u = philox_uniform(rs.seed, rs.offset, stream, static_cast<uint32_t>(v));
    const float q =
        has_q ? load_float(a.draft_probs, a.draft_probs_dtype, q_row + v * a.draft_probs_stride_v)
              : 0.0f;
    races_offer(races, it.e, inv_z, static_cast<int32_t>(v), x, u, has_q, q);
  };
  RowRaces races = races_none();
  bool group = false;
  for (int64_t it = threadIdx.x; it < n_items; it += kThreads) {
    const KeptItem item = sh.items[it];
    if (item.index >= 0 && item.e > 0.0f && item_p_key(item, inv_z1) >= p_key) {
      offer(races, item, item.index);
    }
  }
  const int64_t row = ch.b * a.logits_stride_b + ch.i * a.logits_stride_k;
  for (int64_t it = kept; it < n_items; ++it) {  // the tail groups, block-wide
    const KeptItem item = sh.items[it];
    if (!(item.e > 0.0f) || item_p_key(item, inv_z1) < p_key) continue;
    group = true;
    const int64_t q = -1 - item.index;
    const TopKTail tail = load_cg(chunks + q).tail;
    const int64_t n = V - q * S < S ? V - q * S : S;
    for (int64_t v = q * S + threadIdx.x; v < q * S + n; v += kThreads) {
      const float l = load_float(a.logits, a.logits_dtype, row + v * a.logits_stride_v);
      if (tail_member(tail, radix_key(l), v)) offer(races, item, v);
    }
  }
  races = block_races(races, sh);
  races_finish(races, has_q, group && has_q, r);
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 3) split_first_pass(RejectionSampleArgs a) {
  __shared__ Shared sh;
  const int64_t V = a.vocab, K1 = a.num_draft_max + 1;
  const int64_t S = chunk_size(V), C = chunk_count(V);
  Chunk ch;
  ch.c = blockIdx.x % C;
  ch.i = (blockIdx.x / C) % K1;
  ch.b = blockIdx.x / (C * K1);
  const RowSampling rs = row_sampling(a, ch.b);
  const SplitMode mode = split_mode(rs);
  if (mode == SplitMode::kLegacy || ch.i > rs.num_draft) return;
  const Workspace ws = workspace(a);
  ch.v0 = ch.c * S;
  ch.n = V - ch.v0 < S ? V - ch.v0 : S;
  const int64_t row = ch.b * K1 + ch.i;
  const T* logits = static_cast<const T*>(a.logits) + ch.b * a.logits_stride_b +
                    ch.i * a.logits_stride_k + ch.v0 * a.logits_stride_v;
  for_each_in_row<kThreads>(logits, a.logits_stride_v, ch.n,
                            [&](int64_t v, float l) { sh.vals[v] = l; });
  __syncthreads();
  ChunkSummary s{};
  Candidate* cand = ws.cand + (row * C) * kSplitTopKMax;
  if (mode == SplitMode::kGreedy) {
    greedy_chunk(ch, sh, s);
  } else if (mode == SplitMode::kPlain) {
    plain_chunk(a, rs, ch, sh, s);
  } else {
    topk_chunk<T>(rs, ch, cand + ch.c * kSplitTopKMax, sh, s);
  }
  if (threadIdx.x == 0) ws.chunks[row * C + ch.c] = s;
  if (!last_to_arrive(ws.row_count + row, static_cast<int32_t>(C), sh)) return;

  const ChunkSummary* chunks = ws.chunks + row * C;
  RowResult r;
  if (mode == SplitMode::kGreedy) {
    r = merge_greedy(a, rs, ch, chunks, C, sh);
  } else if (mode == SplitMode::kPlain) {
    r = merge_plain(a, rs, ch, chunks, C, sh);
  } else {
    r = merge_topk<T>(a, rs, ch, chunks, cand, C, S, sh);
  }
  if (threadIdx.x == 0) {
    if (mode != SplitMode::kGreedy && !r.unknown && ch.i < rs.num_draft) {
      r.accepted = draft_accepted(a, rs, ch.b, ch.i, r.warp) ? 1 : 0;
    }
    ws.rows[row] = r;
  }
  if (!last_to_arrive(ws.seq_count + ch.b, rs.num_draft + 1, sh)) return;

  if (threadIdx.x == 0) {
    const RowResult* rows = ws.rows + ch.b * K1;
    const int64_t j = emitted_row(rs, [&](int64_t i) { return load_cg(rows + i); });
    ws.state[ch.b] = j < 0 ? kSeqLegacy
                           : write_sequence(a, rs, ch.b, j, load_cg(rows + j),
                                            a.out_tokens + ch.b * K1);
  }
}

// ---- residual pass ---------------------------------------------------------------------------

template <typename T, typename Q>
__global__ void __launch_bounds__(kThreads) split_residual_pass(RejectionSampleArgs a) {
  __shared__ Shared sh;
  const int64_t V = a.vocab, K1 = a.num_draft_max + 1;
  const int64_t S = chunk_size(V), C = chunk_count(V);
  const int64_t c = blockIdx.x % C, b = blockIdx.x / C;
  const Workspace ws = workspace(a);
  const int32_t state = __ldcg(ws.state + b);
  if (state < kSeqPassBase) return;
  const RowSampling rs = row_sampling(a, b);
  const int64_t j = state - kSeqPassBase;
  const RowResult r = load_cg(ws.rows + b * K1 + j);
  const float inv_z = 1.0f / r.warp.z;
  const int64_t v0 = c * S, n = V - v0 < S ? V - v0 : S;
  const T* logits = static_cast<const T*>(a.logits) + b * a.logits_stride_b +
                    j * a.logits_stride_k + v0 * a.logits_stride_v;
  const Q* q = static_cast<const Q*>(a.draft_probs) + b * a.draft_probs_stride_b +
               j * a.draft_probs_stride_k + v0 * a.draft_probs_stride_v;
  const uint32_t stream = philox_stream(static_cast<uint32_t>(j), kPhiloxSample);
  Best best = best_none();
  for (int64_t g = threadIdx.x; 4 * g < n; g += kThreads) {
    float l[4], qv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // loads first, then the math
      const int64_t v = 4 * g + i < n ? 4 * g + i : n - 1;
      l[i] = to_float(logits[v * a.logits_stride_v]);
      qv[i] = to_float(q[v * a.draft_probs_stride_v]);
    }
    Philox4 w{};
    bool drawn = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t v = 4 * g + i;
      if (v >= n) break;
      const float e = warped_exp(l[i], r.warp);
      if (!(e > 0.0f)) continue;
      if (!drawn) {
        w = philox_block(rs.seed, rs.offset, stream, static_cast<uint32_t>(v0 / 4 + g));
        drawn = true;
      }
      const float u = philox_to_uniform(philox_word(w, i));
      best_offer(best, residual_race_key(e, inv_z, qv[i], u), static_cast<int32_t>(v0 + v));
    }
  }
  best = block_best(best, sh);
  if (threadIdx.x == 0) ws.resid[b * C + c] = best;
  if (!last_to_arrive(ws.resid_count + b, static_cast<int32_t>(C), sh)) return;
  Best all = best_none();
  for (int64_t k = threadIdx.x; k < C; k += kThreads) {
    all = best_merge(all, load_cg(ws.resid + b * C + k));
  }
  all = block_best(all, sh);
  if (threadIdx.x == 0) a.out_tokens[b * K1 + j] = race_found(all) ? all.index : r.token;
}

template <typename T>
cudaError_t launch_residual(const RejectionSampleArgs& a, dim3 grid, cudaStream_t stream) {
  switch (a.draft_probs_dtype) {
    case DType::kFloat16:
      split_residual_pass<T, __half><<<grid, kThreads, 0, stream>>>(a);
      break;
    case DType::kBFloat16:
      split_residual_pass<T, __nv_bfloat16><<<grid, kThreads, 0, stream>>>(a);
      break;
    default:
      split_residual_pass<T, float><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_split(const RejectionSampleArgs& a, cudaStream_t stream) {
  const int64_t C = chunk_count(a.vocab);
  const dim3 first(static_cast<unsigned>(a.batch * (a.num_draft_max + 1) * C));
  split_first_pass<T><<<first, kThreads, 0, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || a.draft_probs == nullptr) return err;
  return launch_residual<T>(a, dim3(static_cast<unsigned>(a.batch * C)), stream);
}

}  // namespace

cudaError_t rejection_sample_split_cuda(const RejectionSampleArgs& a, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  switch (a.logits_dtype) {
    case DType::kFloat16:
      return launch_split<__half>(a, stream);
    case DType::kBFloat16:
      return launch_split<__nv_bfloat16>(a, stream);
    default:
      return launch_split<float>(a, stream);
  }
}

}  // namespace osd
