// tree_attention's row-invariant path (AVX-512, float32, head dims a multiple of 16 up to
// 256, T <= 64 queries a row: decode and verify).
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
#include <vector>

#include "cpu/attention_avx512.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace osd {
namespace attention_rows {

constexpr int64_t kMaxChunks = 16;  // head dims up to 256

struct Args {
  const float* q;    // [B, T, Hq, D] with strides q_stride (the last 1)
  const float* k;    // [B_max, Hkv, S, D], k_stride (the last 1)
  const float* v;    // like k
  float* out;        // [B, T, Hq, D] contiguous
  const int32_t* lens;
  const int64_t* tree_mask;  // [B, T] or nullptr (causal)
  int64_t mask_stride_b, mask_stride_t;
  int64_t T, hq, hkv, D;
  int64_t q_stride[4], k_stride[4], v_stride[4];
  float scale;
};

// One task: row b, query t, the query heads h0 .. h0 + G - 1 of KV head g (all of its
// heads, or one). s: scratch of G * (len + T).
template <int C>
OSD_AVX512 void query(const Args& a, int64_t b, int64_t g, int64_t h0, int64_t G, int64_t t,
                      std::vector<float>& s) {
  const int64_t D = a.D, chunks = C > 0 ? C : D / 16;
  const int64_t L = a.lens[b];
  int64_t tree[64];
  int64_t nt = 0;
  if (a.tree_mask != nullptr) {
    const uint64_t bits =
        static_cast<uint64_t>(a.tree_mask[b * a.mask_stride_b + t * a.mask_stride_t]);
    for (int64_t j = 0; j < a.T; ++j) {
      if ((bits >> j) & 1) tree[nt++] = L + j;
    }
  } else {
    for (int64_t j = 0; j <= t; ++j) tree[nt++] = L + j;
  }
  const int64_t n = L + nt;
  const float* kb = a.k + b * a.k_stride[0] + g * a.k_stride[1];
  const float* vb = a.v + b * a.v_stride[0] + g * a.v_stride[1];
  const float* qb = a.q + b * a.q_stride[0] + t * a.q_stride[1];
  float* ob = a.out + ((b * a.T + t) * a.hq) * D;
  if (n == 0) {
    for (int64_t h = h0; h < h0 + G; ++h) std::fill(ob + h * D, ob + (h + 1) * D, 0.0f);
    return;
  }
  if (static_cast<int64_t>(s.size()) < G * n) s.resize(static_cast<size_t>(G * n));
  thread_local std::vector<const float*> keys;
  keys.resize(static_cast<size_t>(n));
  auto pos = [&](int64_t i) { return i < L ? i : tree[i - L]; };
  for (int64_t i = 0; i < n; ++i) keys[i] = kb + pos(i) * a.k_stride[2];
  // scores eight keys at a time (scores_avx512: each key's sum takes the same additions
  // whichever slot of its group of eight it has), then the scale
  for (int64_t h = 0; h < G; ++h) {
    float* sh = s.data() + h * n;
    attention_avx512::scores_avx512(qb + (h0 + h) * a.q_stride[2], keys.data(), n, D, sh);
    const __m512 sc = _mm512_set1_ps(a.scale);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = attention_avx512::first_lanes(n - j);
      _mm512_mask_storeu_ps(sh + j, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, sh + j), sc));
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    float* sh = s.data() + h * n;
    const float mx = attention_avx512::max_avx512(sh, n, -std::numeric_limits<float>::infinity());
    const __m512 m = _mm512_set1_ps(mx);
    __m512 lsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = attention_avx512::first_lanes(n - j);
      const __m512 e = _mm512_maskz_mov_ps(
          live, attention_avx512::exp_nonpos_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sh + j), m)));
      _mm512_mask_storeu_ps(sh + j, live, e);
      lsum = _mm512_add_ps(lsum, e);
    }
    const float l = _mm512_reduce_add_ps(lsum);
    __m512 acc0[C > 0 ? C : kMaxChunks], acc1[C > 0 ? C : kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) acc0[c] = acc1[c] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 1 < n; i += 2) {
      const float* v0 = vb + pos(i) * a.v_stride[2];
      const float* v1 = vb + pos(i + 1) * a.v_stride[2];
      const __m512 p0 = _mm512_set1_ps(sh[i]), p1 = _mm512_set1_ps(sh[i + 1]);
      for (int64_t c = 0; c < chunks; ++c) {
        acc0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), acc0[c]);
        acc1[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), acc1[c]);
      }
    }
    if (i < n) {
      const float* v0 = vb + pos(i) * a.v_stride[2];
      const __m512 p0 = _mm512_set1_ps(sh[i]);
      for (int64_t c = 0; c < chunks; ++c) {
        acc0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), acc0[c]);
      }
    }
    const __m512 lv = _mm512_set1_ps(l);
    float* o = ob + (h0 + h) * D;
    for (int64_t c = 0; c < chunks; ++c) {
      _mm512_storeu_ps(o + 16 * c, _mm512_div_ps(_mm512_add_ps(acc0[c], acc1[c]), lv));
    }
  }
}

// Every (row, KV head, query) of a call, spread over the threads; with fewer than four
// such tasks a thread, one task per query head instead (the keys are then read once per
// head, from cache), so that batch 1 with few KV heads keeps the threads evenly busy.
inline void run(const Args& a, int64_t batch) {
  const int64_t G = a.hq / a.hkv;
  const int64_t per = batch * a.hkv * a.T < 4 * at::get_num_threads() ? 1 : G;
  const int64_t parts = G / per, tasks = batch * a.hkv * a.T * parts;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> s;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t part = task % parts, t = (task / parts) % a.T;
      const int64_t g = (task / (parts * a.T)) % a.hkv, b = task / (parts * a.T * a.hkv);
      const int64_t h0 = g * G + part * per;
      switch (a.D / 16) {
        case 4: query<4>(a, b, g, h0, per, t, s); break;
        case 8: query<8>(a, b, g, h0, per, t, s); break;
        default: query<0>(a, b, g, h0, per, t, s); break;
      }
    }
  });
}

}  // namespace attention_rows
}  // namespace osd

#pragma GCC diagnostic pop
#endif
