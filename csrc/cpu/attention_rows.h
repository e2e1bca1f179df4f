// tree_attention's row-invariant path (AVX-512, float32 queries over a float32 or float16
// cache, head dims a multiple of 16 up to 256; any causal call, tree calls of T <= 64:
// decode, verify and prefill pieces). A float16 cache's keys and values are widened to
// float32 as they are loaded (exact), so every result equals the float32 path's over the
// same rounded values; decode reads half the bytes.
//
// A query's result depends only on its own visible keys, in position order, never on how
// many queries share the call, which of them are tree siblings, where the prefix ends, or
// how many threads run: so a token verified in a block of T gets bit for bit the logits
// it gets decoded alone after the same tokens (the KV rollback moves an accepted path to
// consecutive slots, in the same order). Decode and verify then agree exactly, which the
// int8-activation GEMVs (quant_linear_x16.cpp) need: there a rounding difference in the
// input can move a code by one and grow from layer to layer.
//
// Per (row b, KV head, query t), for each of its G query heads, over the n visible keys
// (index i = 0..n-1: the prefix, then the visible tree keys in slot order):
//   s_i = (q . k_i, as attention_avx512::scores_avx512 sums it) * scale;  m = max_i s_i;
//   p_i = exp(s_i - m) (16 lanes at a time, the same polynomial in every lane);
//   l = reduce_add(lane sums: lane i mod 16 adds p_i in ascending i);
//   acc_(i mod 2) += p_i v_i (two chains, ascending i);  out = (acc_0 + acc_1) / l.
// Every step is a function of the index i and the values, so equal inputs give equal
// outputs. A query that sees no key gets zeros.
#pragma once
#if defined(__x86_64__)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/tree_attention_task.h"  // TreeAttentionArgs, and attention_avx512.h

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace osd {
namespace attention_rows {

constexpr int64_t kMaxChunks = 16;  // head dims up to 256

// A (query, query head) pair of a task: its n visible keys, key i at slot i for i < L
// and for causal calls (query t sees slots [0, L + t]), at tree[i - L] past the prefix
// of a tree call.
struct Pair {
  int64_t t, h, n;
  int64_t tree[64];
};

struct Scratch {
  std::vector<Pair> pairs;
  std::vector<float> s;    // [pairs, L + T]: scores, then e^(s - m)
  std::vector<float> acc;  // [pairs, 2, D]: the two P.V chains
  std::vector<float> l;    // [pairs]
  std::vector<const float*> keys;      // a block's key or value rows (float32 cache)
  std::vector<const uint16_t*> hkeys;  // the same for a float16 cache
  std::vector<int64_t> ts, hs;  // the task's pairs
};

// One task: row b, KV head g, the pairs (t, h) listed (t ascending). The keys every pair
// sees (the prefix, and for causal calls up to the first query's own) go a block of
// kSubKeys at a time through all the pairs while the block is in L1: scores, then P.V,
// each pair's chains stored between blocks (exact); then each pair's own further keys. A
// pair's arithmetic is what it is alone.
constexpr int64_t kSubKeys = 32;

// The block's row pointers in w for a cache of element type KT.
template <typename KT>
inline const KT** rows_of(Scratch& w) {
  if constexpr (std::is_same_v<KT, float>) {
    return w.keys.data();
  } else {
    return w.hkeys.data();
  }
}

using attention_avx512::load16;

// Keys i0 .. i0 + cnt - 1 (values v[0 .. cnt)) into a pair's two chains ap [2, D] (key i
// into chain i mod 2), weights sh[i].
template <int C, typename KT>
OSD_AVX512 inline void pv_block(float* ap, const float* sh, int64_t D, const KT* const* v,
                                int64_t i0, int64_t cnt) {
  const int64_t chunks = C > 0 ? C : D / 16;
  __m512 acc0[C > 0 ? C : kMaxChunks], acc1[C > 0 ? C : kMaxChunks];
  for (int64_t c = 0; c < chunks; ++c) {
    acc0[c] = _mm512_loadu_ps(ap + 16 * c);
    acc1[c] = _mm512_loadu_ps(ap + D + 16 * c);
  }
  int64_t j = 0;
  if ((i0 & 1) && cnt > 0) {  // an odd first key: chain 1
    const __m512 p1 = _mm512_set1_ps(sh[i0]);
    for (int64_t c = 0; c < chunks; ++c) {
      acc1[c] = _mm512_fmadd_ps(p1, load16(v[0] + 16 * c), acc1[c]);
    }
    j = 1;
  }
  for (; j + 1 < cnt; j += 2) {  // keys i0 + j (even) and i0 + j + 1 (odd)
    const __m512 p0 = _mm512_set1_ps(sh[i0 + j]), p1 = _mm512_set1_ps(sh[i0 + j + 1]);
    for (int64_t c = 0; c < chunks; ++c) {
      acc0[c] = _mm512_fmadd_ps(p0, load16(v[j] + 16 * c), acc0[c]);
      acc1[c] = _mm512_fmadd_ps(p1, load16(v[j + 1] + 16 * c), acc1[c]);
    }
  }
  if (j < cnt) {  // an even last key: chain 0
    const __m512 p0 = _mm512_set1_ps(sh[i0 + j]);
    for (int64_t c = 0; c < chunks; ++c) {
      acc0[c] = _mm512_fmadd_ps(p0, load16(v[j] + 16 * c), acc0[c]);
    }
  }
  for (int64_t c = 0; c < chunks; ++c) {
    _mm512_storeu_ps(ap + 16 * c, acc0[c]);
    _mm512_storeu_ps(ap + D + 16 * c, acc1[c]);
  }
}

// scores_avx512 for two queries over the same keys, each key loaded once: per query the
// very FMAs and sums scores_avx512 makes, so s0 and s1 are what it gives alone.
template <typename KT>
OSD_AVX512 inline void scores_pair(const float* q0, const float* q1, const KT* const* k,
                                   int64_t n, int64_t dim, float* s0, float* s1) {
  for (int64_t j = 0; j < n; j += 8) {
    const KT* kj[8];
    for (int i = 0; i < 8; ++i) kj[i] = k[std::min<int64_t>(j + i, n - 1)];
    __m512 a0[8], a1[8];
    for (int i = 0; i < 8; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 x0 = _mm512_loadu_ps(q0 + d), x1 = _mm512_loadu_ps(q1 + d);
      for (int i = 0; i < 8; ++i) {
        const __m512 kv = load16(kj[i] + d);
        a0[i] = _mm512_fmadd_ps(x0, kv, a0[i]);
        a1[i] = _mm512_fmadd_ps(x1, kv, a1[i]);
      }
    }
    float out0[8], out1[8];
    attention_avx512::sums8_avx512(a0, out0);
    attention_avx512::sums8_avx512(a1, out1);
    for (int64_t i = 0; i < std::min<int64_t>(8, n - j); ++i) {
      s0[j + i] = out0[i];
      s1[j + i] = out1[i];
    }
  }
}

// pv_block for two pairs over the same keys (head dims of 64: C = 4), each value loaded
// once: per pair the very FMAs pv_block makes.
template <typename KT>
OSD_AVX512 inline void pv_block_pair(float* ap0, const float* sh0, float* ap1, const float* sh1,
                                     const KT* const* v, int64_t i0, int64_t cnt) {
  constexpr int C = 4, D = 64;
  __m512 a00[C], a01[C], a10[C], a11[C];  // pair, chain
  for (int c = 0; c < C; ++c) {
    a00[c] = _mm512_loadu_ps(ap0 + 16 * c);
    a01[c] = _mm512_loadu_ps(ap0 + D + 16 * c);
    a10[c] = _mm512_loadu_ps(ap1 + 16 * c);
    a11[c] = _mm512_loadu_ps(ap1 + D + 16 * c);
  }
  for (int64_t j = 0; j < cnt; ++j) {
    const int64_t k = i0 + j;
    const __m512 p0 = _mm512_set1_ps(sh0[k]), p1 = _mm512_set1_ps(sh1[k]);
    if (k & 1) {
      for (int c = 0; c < C; ++c) {
        const __m512 vv = load16(v[j] + 16 * c);
        a01[c] = _mm512_fmadd_ps(p0, vv, a01[c]);
        a11[c] = _mm512_fmadd_ps(p1, vv, a11[c]);
      }
    } else {
      for (int c = 0; c < C; ++c) {
        const __m512 vv = load16(v[j] + 16 * c);
        a00[c] = _mm512_fmadd_ps(p0, vv, a00[c]);
        a10[c] = _mm512_fmadd_ps(p1, vv, a10[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    _mm512_storeu_ps(ap0 + 16 * c, a00[c]);
    _mm512_storeu_ps(ap0 + D + 16 * c, a01[c]);
    _mm512_storeu_ps(ap1 + 16 * c, a10[c]);
    _mm512_storeu_ps(ap1 + D + 16 * c, a11[c]);
  }
}

template <int C, typename KT>
OSD_AVX512 void task(const TreeAttentionArgs& a, int64_t b, int64_t g, const int64_t* ts, const int64_t* hs,
                     int64_t np, Scratch& w) {
  const int64_t D = a.head_dim, chunks = C > 0 ? C : D / 16;
  const int64_t L = a.lens[b];
  const int64_t stride = L + a.num_q;
  const bool causal = a.tree_mask == nullptr;
  w.pairs.resize(static_cast<size_t>(np));
  if (static_cast<int64_t>(w.s.size()) < np * stride) w.s.resize(static_cast<size_t>(np * stride));
  if (static_cast<int64_t>(w.acc.size()) < np * 2 * D) w.acc.resize(static_cast<size_t>(np * 2 * D));
  w.l.resize(static_cast<size_t>(np));
  w.keys.resize(static_cast<size_t>(kSubKeys));
  w.hkeys.resize(static_cast<size_t>(kSubKeys));
  const KT** keys = rows_of<KT>(w);
  const KT* kb = static_cast<const KT*>(a.k) + b * a.k_stride[0] + g * a.k_stride[1];
  const KT* vb = static_cast<const KT*>(a.v) + b * a.v_stride[0] + g * a.v_stride[1];
  auto qp = [&](const Pair& p) {
    return static_cast<const float*>(a.q) + b * a.q_stride[0] + p.t * a.q_stride[1] + p.h * a.q_stride[2];
  };
  for (int64_t i = 0; i < np; ++i) {
    Pair& p = w.pairs[i];
    p.t = ts[i];
    p.h = hs[i];
    if (causal) {
      p.n = L + p.t + 1;
    } else {
      const uint64_t bits =
          static_cast<uint64_t>(a.tree_mask[b * a.mask_stride_b + p.t * a.mask_stride_t]);
      int64_t nt = 0;
      for (int64_t j = 0; j < a.num_q; ++j) {
        if ((bits >> j) & 1) p.tree[nt++] = L + j;
      }
      p.n = L + nt;
    }
  }
  // keys [0, common) are seen by every pair of the task
  const int64_t common = causal ? L + ts[0] + 1 : L;
  // pointers to keys i0 .. i0 + cnt - 1 of pair p (rows of base, slot stride apart)
  auto fill = [&](const Pair& p, const KT* base, int64_t stride_s, int64_t i0, int64_t cnt) {
    for (int64_t j = 0; j < cnt; ++j) {
      const int64_t i = i0 + j;
      keys[j] = base + (causal || i < L ? i : p.tree[i - L]) * stride_s;
    }
  };
  // scores, eight keys at a time (scores_avx512: each key's sum takes the same additions
  // whichever slot of its group of eight it has): the common keys a block at a time for
  // every pair, then each pair's own
  for (int64_t i0 = 0; i0 < common; i0 += kSubKeys) {
    const int64_t cnt = std::min(kSubKeys, common - i0);
    fill(w.pairs[0], kb, a.k_stride[2], i0, cnt);
    int64_t i = 0;
    for (; i + 1 < np; i += 2) {  // two pairs at a time: each key loaded once for both
      scores_pair(qp(w.pairs[i]), qp(w.pairs[i + 1]), keys, cnt, D,
                  w.s.data() + i * stride + i0, w.s.data() + (i + 1) * stride + i0);
    }
    if (i < np) {
      attention_avx512::scores_avx512(qp(w.pairs[i]), keys, cnt, D,
                                      w.s.data() + i * stride + i0);
    }
  }
  for (int64_t i = 0; i < np; ++i) {
    const Pair& p = w.pairs[i];
    for (int64_t i0 = common; i0 < p.n; i0 += kSubKeys) {
      const int64_t cnt = std::min(kSubKeys, p.n - i0);
      fill(p, kb, a.k_stride[2], i0, cnt);
      attention_avx512::scores_avx512(qp(p), keys, cnt, D, w.s.data() + i * stride + i0);
    }
  }
  // the scale, the max, e^(s - m) and the sum (lane j adds keys j mod 16, in order)
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int64_t i = 0; i < np; ++i) {
    const int64_t n = w.pairs[i].n;
    float* sh = w.s.data() + i * stride;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = attention_avx512::first_lanes(n - j);
      _mm512_mask_storeu_ps(sh + j, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, sh + j), sc));
    }
    const float mx = attention_avx512::max_avx512(sh, n, -std::numeric_limits<float>::infinity());
    const __m512 m = _mm512_set1_ps(mx);
    __m512 lsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = attention_avx512::first_lanes(n - j);
      const __m512 e = _mm512_maskz_mov_ps(
          live, attention_avx512::exp_nonpos_avx512(
                    _mm512_sub_ps(_mm512_maskz_loadu_ps(live, sh + j), m)));
      _mm512_mask_storeu_ps(sh + j, live, e);
      lsum = _mm512_add_ps(lsum, e);
    }
    w.l[i] = _mm512_reduce_add_ps(lsum);
    std::fill(w.acc.begin() + i * 2 * D, w.acc.begin() + (i + 1) * 2 * D, 0.0f);
  }
  // P.V: two chains, key i into chain i mod 2 in ascending i; the common keys a block at a
  // time for every pair (the chains kept in memory between blocks), then each pair's own
  for (int64_t i0 = 0; i0 < common; i0 += kSubKeys) {
    const int64_t cnt = std::min(kSubKeys, common - i0);
    fill(w.pairs[0], vb, a.v_stride[2], i0, cnt);
    int64_t i = 0;
    if constexpr (C == 4) {  // two pairs at a time: each value loaded once for both
      for (; i + 1 < np; i += 2) {
        pv_block_pair(w.acc.data() + i * 2 * D, w.s.data() + i * stride,
                      w.acc.data() + (i + 1) * 2 * D, w.s.data() + (i + 1) * stride,
                      keys, i0, cnt);
      }
    }
    for (; i < np; ++i) {
      pv_block<C>(w.acc.data() + i * 2 * D, w.s.data() + i * stride, D, keys, i0, cnt);
    }
  }
  for (int64_t i = 0; i < np; ++i) {
    const Pair& p = w.pairs[i];
    float* ap = w.acc.data() + i * 2 * D;
    for (int64_t i0 = common; i0 < p.n; i0 += kSubKeys) {
      const int64_t cnt = std::min(kSubKeys, p.n - i0);
      fill(p, vb, a.v_stride[2], i0, cnt);
      pv_block<C>(ap, w.s.data() + i * stride, D, keys, i0, cnt);
    }
    float* o = static_cast<float*>(a.out) + ((b * a.num_q + p.t) * a.hq + p.h) * D;
    if (p.n == 0) {  // a query that sees no key
      std::fill(o, o + D, 0.0f);
      continue;
    }
    const __m512 lv = _mm512_set1_ps(w.l[i]);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(ap + 16 * c), _mm512_loadu_ps(ap + D + 16 * c));
      _mm512_storeu_ps(o + 16 * c, _mm512_div_ps(sum, lv));
    }
  }
}

// The pairs (query, query head) of each (row, KV head) in tasks of `per` consecutive pairs
// (queries in order), enough tasks to keep every thread busy and none of more than
// kTaskPairs pairs (causal prefill pieces: later queries see more keys); a pair's result
// does not depend on its task.
constexpr int64_t kTaskPairs = 48;

inline void run(const TreeAttentionArgs& a) {
  const int64_t batch = a.batch;
  const int64_t G = a.hq / a.hkv, pairs = a.num_q * G;
  const int64_t want = std::max<int64_t>(1, (2 * at::get_num_threads() + batch * a.hkv - 1) /
                                                (batch * a.hkv));
  const int64_t split = std::min(want, pairs);
  const int64_t per = std::min((pairs + split - 1) / split, kTaskPairs);
  const int64_t parts = (pairs + per - 1) / per, tasks = batch * a.hkv * parts;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch w;
    w.ts.resize(static_cast<size_t>(per));
    w.hs.resize(static_cast<size_t>(per));
    int64_t* ts = w.ts.data();
    int64_t* hs = w.hs.data();
    for (int64_t id = begin; id < end; ++id) {
      const int64_t part = id % parts, g = (id / parts) % a.hkv, b = id / (parts * a.hkv);
      const int64_t first = part * per, np = std::min(per, pairs - first);
      for (int64_t i = 0; i < np; ++i) {  // pair index -> (query, head of KV head g)
        ts[i] = (first + i) / G;
        hs[i] = g * G + (first + i) % G;
      }
      if (a.half_kv) {
        switch (a.head_dim / 16) {
          case 4: task<4, uint16_t>(a, b, g, ts, hs, np, w); break;
          case 8: task<8, uint16_t>(a, b, g, ts, hs, np, w); break;
          default: task<0, uint16_t>(a, b, g, ts, hs, np, w); break;
        }
      } else {
        switch (a.head_dim / 16) {
          case 4: task<4, float>(a, b, g, ts, hs, np, w); break;
          case 8: task<8, float>(a, b, g, ts, hs, np, w); break;
          default: task<0, float>(a, b, g, ts, hs, np, w); break;
        }
      }
    }
  });
}

}  // namespace attention_rows
}  // namespace osd

#pragma GCC diagnostic pop
#endif
