// tree_attention: argument checks and the C++ CPU kernel.
//
// Semantics (osd_kernels/tree_attention.py): query t of row b sees the prefix keys
// [0, lens[b]) unmasked and the tree key lens[b] + t' iff bit t' of tree_mask[b, t] is set
// (T <= 64). Without a mask it is causal for any T: key lens[b] + t' is seen iff t' <= t.
// GQA: query head h reads KV head h / (Hq / Hkv).
//
// One task per (row b, KV head, block of the G * T query rows that share that KV head;
// G = Hq / Hkv), or, for calls of at most kSplitRows such rows (decode, verify), per (row b,
// KV head, range of the row's keys). The task streams its keys in blocks of kKeyBlock:
// each block is converted to fp32 once (read in place for fp32 caches) and scored against
// all rows of the task, and every row keeps an online softmax (running max m, sum l, fp32
// accumulator):
//   m' = max(m, max_j s_j);  l' = l * e^(m - m') + sum_j e^(s_j - m');
//   acc' = acc * e^(m - m') + sum_j e^(s_j - m') v_j;  out = acc / l.
// Prefix blocks need no mask. With a tree mask, one last block (the T <= 64 tree keys)
// tests the bitmask; causal, the new keys lens[b] + [0, t_last] (t_last: the task's last
// query) follow in blocks of kKeyBlock that test t' <= t, so a task reads no key past its
// own diagonal.
// Scores, the softmax (max, exp, sum) and P.V use AVX-512 intrinsics (head dims that are a
// multiple of 16) or AVX2/FMA ones when the CPU has them (chosen at run time), else
// portable loops; each block's keys are prefetched while the block before is scored. On
// the AVX-512 path, calls of at least kLaneRows rows per KV head keep a task's rows in
// vector lanes (attention_avx512.h), decode goes one row at a time.
// Decode and short verify calls split each row's prefix into ranges of key blocks
// (split_keys), one task per (row, KV head, split), and merge the splits' softmax states
// afterwards; larger calls split the query rows into tasks (pick_row_block). Either way
// batch 1 with few KV heads keeps every thread busy.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu/attention_avx512.h"
#include "cpu/fast_math.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace osd {
namespace {

constexpr int64_t kKeyBlock = 64;  // also the largest masked tree (T <= 64 bits)
constexpr int64_t kRowBlock = 32;  // query rows per task of larger calls (at most)
// Decode and short verify calls (at most kSplitRows query rows per KV head) split each
// row's prefix into up to kMaxSplits ranges of whole key blocks, one task each, so that a
// batch of one row with few KV heads still spreads evenly over the threads. Calls with
// more rows per KV head split the rows instead (pick_row_block), which measured faster
// from 27 rows on.
constexpr int64_t kSplitRows = 16;
constexpr int64_t kMaxSplits = 16;
// Calls with at least kLaneRows query rows per KV head (verify blocks, prefill) keep a
// task's rows in vector lanes on the AVX-512 path (attention_avx512.h); decode's few rows
// per KV head would leave most lanes empty and go one row at a time.
constexpr int64_t kLaneRows = 8;
// Fewest keys per split of a lanes call: each task transposes its queries and its split is
// merged afterwards, which a single key block does not pay for.
constexpr int64_t kLaneSplitKeys = 192;
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
  // running max, sum and accumulator to part (kPartStride floats per query row), merged
  // after all tasks ran. nullptr: one task per (row, KV head, row block), no split.
  const int64_t* task_start;  // [B + 1] or nullptr
  float* part;                // [tasks, row_block, D + 2] or nullptr
  int64_t split_min;          // fewest keys per split (split_keys)
  bool lanes;                 // rows in lanes where the AVX-512 path runs (kLaneRows)
};

// Dot product with sixteen independent partial sums, so it vectorises without reassociation.
OSD_INLINE float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    for (int u = 0; u < 16; ++u) part[u] += a[d + u] * b[d + u];
  }
  float s = 0.f;
  for (; d < n; ++d) s += a[d] * b[d];
  for (int u = 0; u < 16; ++u) s += part[u];
  return s;
}

// acc[0, dim) += sum_j p[j] * v[j][0, dim).
OSD_INLINE void accumulate_pv(const float* p, const float* const* v, int64_t n, int64_t dim,
                              float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* vj = v[j];
    for (int64_t d = 0; d < dim; ++d) acc[d] += pj * vj[d];
  }
}

#if defined(__x86_64__)
using namespace attention_avx512;

// AVX2 versions of scores / accumulate_pv; accumulators stay in registers.
// scores_avx2: four keys at a time, so each load of q feeds four independent FMA chains;
// the four 8-lane sums are reduced together with two rounds of hadd.
OSD_AVX2 inline void scores_avx2(const float* q, const float* const* k, int64_t n, int64_t dim,
                                 float* s) {
  const int64_t dv = dim - dim % 8;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (int64_t d = 0; d < dv; d += 8) {
      const __m256 x = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[j + i] + d), a[i]);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(s + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (int i = 0; i < 4; ++i) {
      for (int64_t d = dv; d < dim; ++d) s[j + i] += q[d] * k[j + i][d];
    }
  }
  for (; j < n; ++j) s[j] = dot(q, k[j], dim);
}

template <int kVecs>
OSD_AVX2 inline void accumulate_pv_avx2_cols(const float* p, const float* const* v, int64_t n,
                                             int64_t d0, float* acc) {
  __m256 a[kVecs];
  for (int i = 0; i < kVecs; ++i) a[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v[j] + d0;
    for (int i = 0; i < kVecs; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), a[i]);
  }
  for (int i = 0; i < kVecs; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
}

// e^x for x <= 0 in 8 lanes, exp_nonpos's Cephes polynomial; x < -87 (and -inf) gives 0.
OSD_AVX2 inline __m256 exp_nonpos_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

OSD_AVX2 inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

OSD_AVX2 inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// max(mx, s[0, n)).
OSD_AVX2 inline float max_avx2(const float* s, int64_t n, float mx) {
  __m256 m = _mm256_set1_ps(mx);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  mx = hmax8(m);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// s[j] = e^(s[j] - mx) for j < n (every s[j] <= mx); returns their sum.
OSD_AVX2 inline float exp_sum_avx2(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpos_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum8(acc);
  for (; j < n; ++j) {
    s[j] = exp_nonpos(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

OSD_AVX2 inline void accumulate_pv_avx2(const float* p, const float* const* v, int64_t n,
                                        int64_t dim, float* acc) {
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) accumulate_pv_avx2_cols<8>(p, v, n, d, acc);
  for (; d + 32 <= dim; d += 32) accumulate_pv_avx2_cols<4>(p, v, n, d, acc);
  for (; d + 8 <= dim; d += 8) accumulate_pv_avx2_cols<1>(p, v, n, d, acc);
  for (; d < dim; ++d) {
    float x = acc[d];
    for (int64_t j = 0; j < n; ++j) x += p[j] * v[j][d];
    acc[d] = x;
  }
}

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_* values, which its
// (maybe-)uninitialized warnings report (up to the AVX-512 task loop below).
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

template <typename scalar_t>
void run_tasks_base(const TreeAttentionArgs& a, int64_t begin, int64_t end, Scratch& w) {
  for (int64_t task = begin; task < end; ++task) run_task<scalar_t, kPortable>(a, task, w);
}

#if defined(__x86_64__)
template <typename scalar_t>
OSD_AVX2 void run_tasks_avx2(const TreeAttentionArgs& a, int64_t begin, int64_t end,
                             Scratch& w) {
  for (int64_t task = begin; task < end; ++task) run_task<scalar_t, kAvx2>(a, task, w);
}

template <typename scalar_t>
OSD_AVX512 void run_tasks_avx512(const TreeAttentionArgs& a, int64_t begin, int64_t end,
                                 Scratch& w) {
  if (a.lanes) {
    for (int64_t task = begin; task < end; ++task) run_task<scalar_t, kAvx512Lanes>(a, task, w);
  } else {
    for (int64_t task = begin; task < end; ++task) run_task<scalar_t, kAvx512>(a, task, w);
  }
}
#endif
#if defined(__x86_64__)
#pragma GCC diagnostic pop
#endif

template <typename scalar_t>
void tree_attention_cpu_kernel(const TreeAttentionArgs& a, int64_t num_tasks) {
  const int isa = use_avx512() && a.head_dim % 16 == 0 ? kAvx512
                  : use_avx2_fma()                     ? kAvx2
                                                       : kPortable;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch w(a.row_block, a.head_dim);
#if defined(__x86_64__)
    if (isa == kAvx512) {
      run_tasks_avx512<scalar_t>(a, begin, end, w);
      return;
    }
    if (isa == kAvx2) {
      run_tasks_avx2<scalar_t>(a, begin, end, w);
      return;
    }
#endif
    (void)isa;
    run_tasks_base<scalar_t>(a, begin, end, w);
  });
  if (a.task_start == nullptr || a.part == nullptr) return;
  // The rows with split keys: one merge per (row, KV head) that has more than one split;
  // a few thousand multiply-adds (a batch of one) cost less than waking the threads.
  const int64_t grain = std::max<int64_t>(
      1, (int64_t{1} << 16) / ((a.task_start[a.batch] / a.hkv / a.batch + 1) * a.row_block *
                               a.head_dim));
  at::parallel_for(0, a.batch * a.hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(a.head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / a.hkv;
      if (a.task_start[b + 1] - a.task_start[b] > a.hkv) merge_splits<scalar_t>(a, b, i % a.hkv, acc);
    }
  });
}

// Query rows per task for `heads` (row, KV head) pairs of `rows` query rows each, on
// `threads` threads. at::parallel_for hands each thread ceil(tasks / threads) consecutive
// tasks; a task costs its rows plus kTaskCost for reading its keys and values. Few heads
// (batch 1: the KV heads alone) would leave threads idle or uneven with whole heads per
// task, so the block that minimises the busiest thread's cost is chosen (the largest on
// ties); with many heads every split is even enough and whole heads (up to kRowBlock rows)
// read each key once.
int64_t pick_row_block(int64_t heads, int64_t rows, int64_t threads) {
  constexpr int64_t kTaskCost = 2;
  const int64_t largest = std::min(kRowBlock, rows);
  if (heads >= 4 * threads || largest <= 1) return std::max<int64_t>(largest, 1);
  int64_t best = largest, best_cost = std::numeric_limits<int64_t>::max();
  for (int64_t block = largest; block >= 1; --block) {
    const int64_t blocks = (rows + block - 1) / block;
    const int64_t tasks = heads * blocks;
    const int64_t chunk = (tasks + std::min(threads, tasks) - 1) / std::min(threads, tasks);
    int64_t busiest = 0;
    for (int64_t t0 = 0; t0 < tasks; t0 += chunk) {
      int64_t cost = 0;
      for (int64_t t = t0; t < std::min(t0 + chunk, tasks); ++t) {
        cost += std::min(block, rows - (t % blocks) * block) + kTaskCost;
      }
      busiest = std::max(busiest, cost);
    }
    if (busiest < best_cost) {
      best = block;
      best_cost = busiest;
    }
  }
  return best;
}

at::Tensor tree_attention_cpu_op(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& cache_lens,
                                 const std::optional<at::Tensor>& tree_mask, double scale) {
  OSD_CHECK(q.device().is_cpu(), "tree_attention CPU kernel got a ", q.device(), " tensor");
  OSD_CHECK(q.dim() == 4, "q must be [B, T, Hq, D], got ", q.sizes());
  OSD_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
            "k_cache and v_cache must both be [B_max, Hkv, S, D], got ", k_cache.sizes(),
            " and ", v_cache.sizes());
  to_dtype(q, "q");
  OSD_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
            "k_cache/v_cache dtype must match q (", q.scalar_type(), ")");
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t B_max = k_cache.size(0), Hkv = k_cache.size(1), S = k_cache.size(2);
  OSD_CHECK(k_cache.size(3) == D, "head dim of q (", D, ") and of the cache (", k_cache.size(3),
            ") differ");
  OSD_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads (", Hq, ") must be a multiple of KV heads (",
            Hkv, ")");
  OSD_CHECK(B <= B_max, "q has ", B, " rows but the cache holds only ", B_max);
  check_dtype(cache_lens, at::kInt, "cache_lens");
  OSD_CHECK(cache_lens.dim() == 1 && cache_lens.size(0) == B_max && cache_lens.is_contiguous(),
            "cache_lens must be contiguous [B_max=", B_max, "], got ", cache_lens.sizes());
  check_same_device(q, k_cache, "q", "k_cache");
  check_same_device(q, v_cache, "q", "v_cache");
  check_same_device(q, cache_lens, "q", "cache_lens");
  TreeAttentionArgs a{};
  a.tree_mask = nullptr;
  if (tree_mask.has_value()) {
    const at::Tensor& tm = *tree_mask;
    check_dtype(tm, at::kLong, "tree_mask");
    OSD_CHECK(T <= kKeyBlock, "T=", T, " queries per row exceeds the bitmask limit 64 of a "
              "tree_mask (causal calls take any T)");
    OSD_CHECK(tm.dim() == 2 && tm.size(0) == B && tm.size(1) == T, "tree_mask must be [B=", B,
              ", T=", T, "], got ", tm.sizes());
    check_same_device(q, tm, "q", "tree_mask");
    a.tree_mask = tm.data_ptr<int64_t>();
    a.mask_stride_b = tm.stride(0);
    a.mask_stride_t = tm.stride(1);
  }
  const int32_t* lens = cache_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    OSD_CHECK(lens[b] >= 0 && lens[b] + T <= S, "cache_lens[", b, "]=", lens[b], " plus T=", T,
              " keys do not fit the cache capacity ", S);
  }
  at::Tensor out = at::empty({B, T, Hq, D}, q.options());
  if (out.numel() == 0) return out;
  a.q = q.data_ptr();
  a.k = k_cache.data_ptr();
  a.v = v_cache.data_ptr();
  a.out = out.data_ptr();
  a.lens = lens;
  a.batch = B;
  a.num_q = T;
  a.hq = Hq;
  a.hkv = Hkv;
  a.head_dim = D;
  for (int i = 0; i < 4; ++i) {
    a.q_stride[i] = q.stride(i);
    a.k_stride[i] = k_cache.stride(i);
    a.v_stride[i] = v_cache.stride(i);
  }
  a.scale = static_cast<float>(scale);
  const int64_t rows = (Hq / Hkv) * T;
  a.lanes = rows >= kLaneRows;
  a.split_min = a.lanes ? kLaneSplitKeys : kKeyBlock;
  std::vector<int64_t> task_start;
  at::Tensor part;
  int64_t num_tasks;
  if (rows <= kSplitRows) {
    // Decode and short verify: every query row of a KV head in one task per key split.
    a.row_block = rows;
    task_start.assign(B + 1, 0);
    for (int64_t b = 0; b < B; ++b) {
      task_start[b + 1] = task_start[b] + Hkv * (lens[b] / split_keys(lens[b], a.split_min) + 1);
    }
    num_tasks = task_start[B];
    a.task_start = task_start.data();
    if (num_tasks > B * Hkv) {
      part = at::empty({num_tasks * rows * (D + kPartExtra)}, q.options().dtype(at::kFloat));
      a.part = part.data_ptr<float>();
    }
  } else {
    // Longer verify blocks and prefill: blocks of rows, the whole prefix in each.
    a.row_block = pick_row_block(B * Hkv, rows, at::get_num_threads());
    num_tasks = B * Hkv * ((rows + a.row_block - 1) / a.row_block);
  }
  switch (q.scalar_type()) {
    case at::kFloat: tree_attention_cpu_kernel<float>(a, num_tasks); break;
    case at::kHalf: tree_attention_cpu_kernel<c10::Half>(a, num_tasks); break;
    default: tree_attention_cpu_kernel<c10::BFloat16>(a, num_tasks); break;
  }
  return out;
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("tree_attention", &osd::tree_attention_cpu_op); }
