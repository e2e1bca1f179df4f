// One tree_attention task (tree_attention.cpp describes the tasks and the online softmax):
// the call's arguments, a thread's scratch, the per-block update process_keys (portable,
// AVX2, AVX-512 one row at a time or rows in lanes), run_task and the merge of key splits.
//
// Private to tree_attention.cpp (included there and by its attention_rows.h, which reads
// the same TreeAttentionArgs): everything here has internal linkage, as the rest of that
// translation unit.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/attention_avx512.h"
#include "cpu/fast_math.h"
#include "cpu/tree_attention_loops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace osd {
namespace {

constexpr int64_t kKeyBlock = 64;  // also the largest masked tree (T <= 64 bits)
// Most key splits of a row in decode and short verify calls (split_keys).
constexpr int64_t kMaxSplits = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct TreeAttentionArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;                  // [B, T, Hq, D] contiguous
  const int32_t* lens;        // [B_max]
  const int64_t* tree_mask;   // [B, T] or nullptr (causal)
  int64_t mask_stride_b, mask_stride_t;
  int64_t batch, num_q, hq, hkv, head_dim;
  int64_t row_block;          // query rows (of one KV head's G * T) per task
  int64_t q_stride[4], k_stride[4], v_stride[4];
  float scale;
  // Split keys (decode and verify calls): row b's tasks are task_start[b] .. task_start[b +
  // 1), one per (KV head, key split); a row with more than one split writes each task's
  // running max, sum and accumulator to part (D + kPartExtra floats per query row), merged
  // after all tasks ran. nullptr: one task per (row, KV head, row block), no split.
  const int64_t* task_start;  // [B + 1] or nullptr
  float* part;                // [tasks, row_block, D + 2] or nullptr
  int64_t split_min;          // fewest keys per split (split_keys)
  bool lanes;                 // rows in lanes where the AVX-512 path runs (kLaneRows)
  bool half_kv;               // float32 queries over a float16 cache (attention_rows only)
};

#if defined(__x86_64__)
using namespace attention_avx512;

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_* values, which its
// (maybe-)uninitialized warnings report.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Points rows[j] at key/value row start + j as fp32: in place when the cache is fp32 with a
// contiguous head dim, else converted into buf.
template <typename scalar_t>
OSD_INLINE void fp32_rows(const scalar_t* base, int64_t stride_s, int64_t stride_d,
                          int64_t start, int64_t n, int64_t dim, float* buf,
                          const float** rows) {
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* src = base + (start + j) * stride_s;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (stride_d == 1) {
        rows[j] = src;
        continue;
      }
    }
    float* dst = buf + j * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d * stride_d]);
    rows[j] = dst;
  }
}

// Per-thread scratch of one task of up to `rows` query rows; the running max m, sum l and
// rescale corr have a slot per vector lane (rows rounded up to 16) for the lanes layout,
// whose transposed queries qt are [dim][16 or 32] and scores s [kKeyBlock][16 or 32].
struct Scratch {
  std::vector<float> q, qt, acc, kbuf, vbuf, s, m, l, corr;
  std::vector<const float*> krow, vrow;
  std::vector<uint64_t> bits;
  std::vector<int64_t> head, t;
  Scratch(int64_t rows, int64_t dim)
      : q(rows * dim), qt(lanes(rows) * dim), acc(rows * dim), kbuf(kKeyBlock * dim),
        vbuf(kKeyBlock * dim), s(lanes(rows) * kKeyBlock), m(lanes(rows)), l(lanes(rows)),
        corr(lanes(rows)), krow(kKeyBlock), vrow(kKeyBlock), bits(rows), head(rows), t(rows) {}
  static int64_t lanes(int64_t rows) { return (rows + 15) / 16 * 16; }
};

// Which of a block's keys each row sees: all (prefix), bit j of the row's tree mask, or
// causal (new key first + j is seen by query t iff first + j <= t).
enum class KeyMask { kNone, kBits, kCausal };

// Instruction sets of the task loops: AVX-512 needs a head dim that is a multiple of 16;
// kAvx512Lanes is AVX-512 with the task's rows in vector lanes.
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Lanes = 3 };

// Prefetches rows [start, start + n) of one KV head's keys or values into the caches (the
// first dim elements from each row's start: all of a row with a contiguous head dim).
template <typename scalar_t>
OSD_INLINE void prefetch_rows(const scalar_t* base, int64_t stride_s, int64_t start, int64_t n,
                              int64_t dim) {
#if defined(__x86_64__)
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t j = start; j < start + n; ++j) {
    const char* row = reinterpret_cast<const char*>(base + j * stride_s);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
  }
#else
  (void)base, (void)stride_s, (void)start, (void)n, (void)dim;
#endif
}

// Online-softmax update of R rows with keys [start, start + n) of one KV head; a block of
// new keys (start = L + first) is masked by `mask`. The next `ahead` keys (the task's next
// block) are prefetched while this one is scored.
template <typename scalar_t, int kIsa>
OSD_INLINE void process_keys(const TreeAttentionArgs& a, const scalar_t* kb, const scalar_t* vb,
                             int64_t start, int64_t n, int64_t ahead, int64_t R, KeyMask mask,
                             int64_t first, Scratch& w) {
  const int64_t D = a.head_dim;
  fp32_rows(kb, a.k_stride[2], a.k_stride[3], start, n, D, w.kbuf.data(), w.krow.data());
  fp32_rows(vb, a.v_stride[2], a.v_stride[3], start, n, D, w.vbuf.data(), w.vrow.data());
  prefetch_rows(kb, a.k_stride[2], start + n, ahead, D);
  prefetch_rows(vb, a.v_stride[2], start + n, ahead, D);
#if defined(__x86_64__)
  if constexpr (kIsa == kAvx512Lanes) {
    const int64_t W = Scratch::lanes(R);
    float* st = w.s.data();
    if (W == 16) {
      scores_lanes<1>(w.qt.data(), w.krow.data(), n, D, st);
    } else {
      scores_lanes<2>(w.qt.data(), w.krow.data(), n, D, st);
    }
    if (mask == KeyMask::kBits) {
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          if (!((w.bits[r] >> j) & 1)) st[j * W + r] = kNegInf;
        }
      }
    } else if (mask == KeyMask::kCausal) {
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t j = std::max<int64_t>(w.t[r] - first + 1, 0); j < n; ++j) {
          st[j * W + r] = kNegInf;
        }
      }
    }
    if (W == 16) {
      softmax_lanes<1>(st, n, w.m.data(), w.l.data(), w.corr.data());
    } else {
      softmax_lanes<2>(st, n, w.m.data(), w.l.data(), w.corr.data());
    }
    pv_lanes(st, W, w.vrow.data(), n, R, D, w.corr.data(), w.acc.data());
    return;
  }
#endif
  for (int64_t r = 0; r < R; ++r) {
    float* s = &w.s[r * kKeyBlock];
    const float* qr = &w.q[r * D];
    float mx = w.m[r];
#if defined(__x86_64__)
    if constexpr (kIsa == kAvx512) {
      scores_avx512(qr, w.krow.data(), n, D, s);
    } else if constexpr (kIsa == kAvx2) {
      scores_avx2(qr, w.krow.data(), n, D, s);
    } else {
      for (int64_t j = 0; j < n; ++j) s[j] = dot(qr, w.krow[j], D);
    }
#else
    for (int64_t j = 0; j < n; ++j) s[j] = dot(qr, w.krow[j], D);
#endif
    if (mask == KeyMask::kBits) {
      for (int64_t j = 0; j < n; ++j) {
        if (!((w.bits[r] >> j) & 1)) s[j] = kNegInf;
      }
    } else if (mask == KeyMask::kCausal) {
      for (int64_t j = std::max<int64_t>(w.t[r] - first + 1, 0); j < n; ++j) s[j] = kNegInf;
    }
    float sum = 0.f;
#if defined(__x86_64__)
    if constexpr (kIsa == kAvx512) {
      mx = max_avx512(s, n, mx);
    } else if constexpr (kIsa == kAvx2) {
      mx = max_avx2(s, n, mx);
    } else {
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    }
#else
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
#endif
    if (mx == kNegInf) continue;  // nothing visible to this row yet
    const float corr = exp_nonpos(w.m[r] - mx);
#if defined(__x86_64__)
    if constexpr (kIsa == kAvx512) {
      sum = exp_sum_avx512(s, n, mx);
    } else if constexpr (kIsa == kAvx2) {
      sum = exp_sum_avx2(s, n, mx);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        s[j] = exp_nonpos(s[j] - mx);
        sum += s[j];
      }
    }
#else
    for (int64_t j = 0; j < n; ++j) {
      s[j] = exp_nonpos(s[j] - mx);
      sum += s[j];
    }
#endif
    w.l[r] = w.l[r] * corr + sum;
    w.m[r] = mx;
    float* acc = &w.acc[r * D];
    for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
#if defined(__x86_64__)
    if constexpr (kIsa == kAvx512) {
      accumulate_pv_avx512(s, w.vrow.data(), n, D, acc);
    } else if constexpr (kIsa == kAvx2) {
      accumulate_pv_avx2(s, w.vrow.data(), n, D, acc);
    } else {
      accumulate_pv(s, w.vrow.data(), n, D, acc);
    }
#else
    accumulate_pv(s, w.vrow.data(), n, D, acc);
#endif
  }
}

// Keys per split of a row with L cached keys: whole key blocks, at least min_keys (the
// call's layout: kKeyBlock one row at a time, kLaneSplitKeys in lanes), at most kMaxSplits
// splits; the row has L / split + 1 splits, the last holding the rest of the prefix and the
// new keys. A function of L and the layout alone, so a row's result depends neither on the
// other rows of the batch nor on the thread count.
OSD_INLINE int64_t split_keys(int64_t L, int64_t min_keys) {
  const int64_t per = (L + kMaxSplits - 1) / kMaxSplits;
  return std::max(min_keys, (per + kKeyBlock - 1) / kKeyBlock * kKeyBlock);
}

// The rows' running max, sum and accumulator of one task, kept for the merge.
constexpr int64_t kPartExtra = 2;

// Task = (row b, KV head hk, block of query rows r0 .. r0 + R of the G * T that share hk)
// without split keys; (row b, KV head hk, key split s) with them (all G * T rows).
template <typename scalar_t, int kIsa>
OSD_INLINE void run_task(const TreeAttentionArgs& a, int64_t task, Scratch& w) {
  const int64_t T = a.num_q, D = a.head_dim, group = a.hq / a.hkv;
  int64_t b, hk, r0 = 0, split = 0, splits = 1;
  if (a.task_start != nullptr) {
    b = std::upper_bound(a.task_start, a.task_start + a.batch + 1, task) - a.task_start - 1;
    splits = (a.task_start[b + 1] - a.task_start[b]) / a.hkv;
    hk = (task - a.task_start[b]) / splits;
    split = (task - a.task_start[b]) % splits;
  } else {
    const int64_t blocks = (group * T + a.row_block - 1) / a.row_block;
    b = task / (a.hkv * blocks);
    hk = (task / blocks) % a.hkv;
    r0 = (task % blocks) * a.row_block;
  }
  const int64_t R = std::min(a.row_block, group * T - r0);
  const int64_t L = a.lens[b];
  const auto* q = static_cast<const scalar_t*>(a.q);
  const auto* kb = static_cast<const scalar_t*>(a.k) + b * a.k_stride[0] + hk * a.k_stride[1];
  const auto* vb = static_cast<const scalar_t*>(a.v) + b * a.v_stride[0] + hk * a.v_stride[1];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = (r0 + r) / group, h = hk * group + (r0 + r) % group;
    w.t[r] = t;
    w.head[r] = h;
    const scalar_t* row = q + b * a.q_stride[0] + t * a.q_stride[1] + h * a.q_stride[2];
    for (int64_t d = 0; d < D; ++d) {
      w.q[r * D + d] = static_cast<float>(row[d * a.q_stride[3]]) * a.scale;
    }
    w.bits[r] = a.tree_mask == nullptr
                    ? 0
                    : static_cast<uint64_t>(a.tree_mask[b * a.mask_stride_b + t * a.mask_stride_t]);
    w.m[r] = kNegInf;
    w.l[r] = 0.f;
  }
  std::fill(w.acc.begin(), w.acc.begin() + R * D, 0.f);
  if constexpr (kIsa == kAvx512Lanes) {  // qt[d][r] = q[r][d]; empty lanes score zeros
    const int64_t W = Scratch::lanes(R);
    std::fill(w.qt.begin(), w.qt.begin() + W * D, 0.f);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t d = 0; d < D; ++d) w.qt[d * W + r] = w.q[r * D + d];
    }
    std::fill(w.m.begin() + R, w.m.begin() + W, kNegInf);
    std::fill(w.l.begin() + R, w.l.begin() + W, 0.f);
  }
  // This task's prefix keys [begin, stop); the last split also takes the tree's T keys or
  // the causal new keys up to the task's last query (rows are in query order: the last
  // sees the most), which end the keys at `end`.
  const int64_t per_split = splits > 1 ? split_keys(L, a.split_min) : L;
  const int64_t begin = split * per_split;
  const bool last = split == splits - 1;
  const int64_t stop = last ? L : begin + per_split;
  const int64_t end = !last ? stop : L + (a.tree_mask != nullptr ? T : w.t[R - 1] + 1);
  // Prefetching runs one block ahead, past a split's end into the next split's first block
  // (most often the next task of the same thread).
  const int64_t ahead_end = last ? end : std::min(stop + kKeyBlock, L);
  prefetch_rows(kb, a.k_stride[2], begin, std::min(kKeyBlock, end - begin), D);
  prefetch_rows(vb, a.v_stride[2], begin, std::min(kKeyBlock, end - begin), D);
  for (int64_t start = begin; start < stop; start += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, stop - start);
    process_keys<scalar_t, kIsa>(a, kb, vb, start, n,
                                 std::min(kKeyBlock, ahead_end - start - n), R,
                                 KeyMask::kNone, 0, w);
  }
  if (last && a.tree_mask != nullptr) {
    process_keys<scalar_t, kIsa>(a, kb, vb, L, T, 0, R, KeyMask::kBits, 0, w);
  } else if (last) {
    for (int64_t first = 0; L + first < end; first += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, end - L - first);
      process_keys<scalar_t, kIsa>(a, kb, vb, L + first, n,
                                   std::min(kKeyBlock, end - L - first - n), R,
                                   KeyMask::kCausal, first, w);
    }
  }
  if (splits > 1) {  // the merge finishes these rows
    float* part = a.part + task * a.row_block * (D + kPartExtra);
    for (int64_t r = 0; r < R; ++r) {
      float* p = part + r * (D + kPartExtra);
      p[0] = w.m[r];
      p[1] = w.l[r];
      std::copy(&w.acc[r * D], &w.acc[r * D] + D, p + kPartExtra);
    }
    return;
  }
  auto* out = static_cast<scalar_t*>(a.out);
  for (int64_t r = 0; r < R; ++r) {
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    scalar_t* row = out + ((b * T + w.t[r]) * a.hq + w.head[r]) * D;
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<scalar_t>(w.acc[r * D + d] * inv);
  }
}

// Merges the key splits of (row b, KV head hk) into its output rows, split by split in
// order: m = max_s m_s, l = sum_s l_s e^(m_s - m), acc = sum_s acc_s e^(m_s - m).
template <typename scalar_t>
void merge_splits(const TreeAttentionArgs& a, int64_t b, int64_t hk, std::vector<float>& acc) {
  const int64_t T = a.num_q, D = a.head_dim, group = a.hq / a.hkv;
  const int64_t splits = (a.task_start[b + 1] - a.task_start[b]) / a.hkv;
  const int64_t first = a.task_start[b] + hk * splits;
  const int64_t stride = a.row_block * (D + kPartExtra);
  auto* out = static_cast<scalar_t*>(a.out);
  for (int64_t r = 0; r < group * T; ++r) {
    const float* p0 = a.part + first * stride + r * (D + kPartExtra);
    float m = kNegInf;
    for (int64_t s = 0; s < splits; ++s) m = std::max(m, p0[s * stride]);
    float l = 0.f;
    std::fill(acc.begin(), acc.begin() + D, 0.f);
    if (m != kNegInf) {
      for (int64_t s = 0; s < splits; ++s) {
        const float* p = p0 + s * stride;
        const float c = exp_nonpos(p[0] - m);
        l += p[1] * c;
        for (int64_t d = 0; d < D; ++d) acc[d] += p[kPartExtra + d] * c;
      }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t t = r / group, h = hk * group + r % group;
    scalar_t* row = out + ((b * T + t) * a.hq + h) * D;
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<scalar_t>(acc[d] * inv);
  }
}

#if defined(__x86_64__)
#pragma GCC diagnostic pop
#endif

}  // namespace
}  // namespace osd
