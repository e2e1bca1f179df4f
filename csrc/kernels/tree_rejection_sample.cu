// CUDA kernel for tree_rejection_sample. Semantics and the walk: kernels/tree_rejection_sample.h.
//
// One block per sequence. Every thread runs the same scalar walk (node loads are broadcast
// reads and every reduction is broadcast back), and the threads share the passes over the
// vocabulary: warping a row (top-k by radix selection on the raw logits, one histogram
// pass per significant 8-bit key digit; online max / sum-exp; top-p by radix selection on
// fixed-point mass histograms of the stored p: kernels/radix_select.h), a residual update
// with its sum after a rejection, and the final exponential race (four vocab ids per
// Philox call). Logits rows are read with 128-bit loads when contiguous
// (for_each_in_row). The current node's warped target p and its residual r live in a
// [B, 2, V] float workspace.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/rejection_sample.h"
#include "kernels/block_reduce.cuh"
#include "kernels/tree_rejection_sample.h"
#include "kernels/tree_rejection_sample_cuda.h"

namespace osd {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct Shared {
  float f[kWarps];
  float g[kWarps];
  int64_t i[kWarps];
  RadixShared radix;
};

__device__ __forceinline__ float block_sum(float v, Shared& sh) {
  return block_reduce<kWarps>(v, 0.0f, sh.f, AddOp{});
}

__device__ __forceinline__ float block_max(float v, Shared& sh) {
  return block_reduce<kWarps>(v, -INFINITY, sh.f, MaxOp{});
}

__device__ LseState block_lse(LseState s, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const LseState other{__shfl_xor_sync(0xffffffffu, s.max, o),
                         __shfl_xor_sync(0xffffffffu, s.sum, o)};
    s = lse_merge(s, other);
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    sh.f[threadIdx.x / 32] = s.max;
    sh.g[threadIdx.x / 32] = s.sum;
  }
  __syncthreads();
  LseState t = lse_init();
  for (int w = 0; w < kWarps; ++w) t = lse_merge(t, LseState{sh.f[w], sh.g[w]});
  return t;
}

// Largest key with the lowest index on ties (argmax and race winners).
__device__ int64_t block_argmax(float key, int64_t idx, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const float k2 = __shfl_xor_sync(0xffffffffu, key, o);
    const int64_t i2 = __shfl_xor_sync(0xffffffffu, idx, o);
    if (k2 > key || (k2 == key && i2 < idx)) {
      key = k2;
      idx = i2;
    }
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    sh.f[threadIdx.x / 32] = key;
    sh.i[threadIdx.x / 32] = idx;
  }
  __syncthreads();
  float best = sh.f[0];
  int64_t best_i = sh.i[0];
  for (int w = 1; w < kWarps; ++w) {
    if (sh.f[w] > best || (sh.f[w] == best && sh.i[w] < best_i)) {
      best = sh.f[w];
      best_i = sh.i[w];
    }
  }
  return best_i;
}

// Logits row of `node` in sequence b.
template <typename T>
__device__ const T* logits_row(const TreeRejectionSampleArgs& a, int64_t b, int64_t node) {
  return static_cast<const T*>(a.logits) + b * a.logits_stride_b + node * a.logits_stride_t;
}

template <typename T>
__device__ int64_t row_argmax(const TreeRejectionSampleArgs& a, int64_t b, int64_t node,
                              Shared& sh) {
  float best = -INFINITY;
  int64_t best_v = 0;
  for_each_in_row<kThreads>(logits_row<T>(a, b, node), a.logits_stride_v, a.vocab,
                            [&](int64_t v, float l) { argmax_update(l, v, best, best_v); });
  return block_argmax(best, best_v, sh);
}

// p = r = the warped target row of `node` (osd_kernels.warp.warp_probs).
template <typename T>
__device__ void warp_row(const TreeRejectionSampleArgs& a, const RowSampling& rs, int64_t b,
                         int64_t node, float* p, float* r, Shared& sh) {
  const int64_t V = a.vocab;
  const T* row = logits_row<T>(a, b, node);
  const int64_t stride = a.logits_stride_v;
  const float t = rs.temperature;
  // top-k: l / t is kept iff radix_key(l) >= floor (kernels/radix_select.h)
  uint32_t floor = 0;
  if (rs.top_k > 0) {
    const uint32_t kth = block_radix_select<kThreads>(
        radix_levels(DTypeOf<T>::value), static_cast<uint64_t>(rs.top_k), sh.radix,
        [&](const RadixState& s) {
          for_each_in_row<kThreads>(row, stride, V, [&](int64_t, float l) {
            const uint32_t key = radix_key(l);
            if (radix_in_range(key, s)) radix_add_count(sh.radix, radix_digit(key, s));
          });
        });
    floor = top_k_logit_floor(kth, t);
  }
  LseState st = lse_init();
  for_each_in_row<kThreads>(row, stride, V, [&](int64_t, float l) {
    if (radix_key(l) >= floor) st = lse_merge(st, LseState{l / t, 1.0f});
  });
  st = block_lse(st, sh);
  const bool top_p = rs.top_p < 1.0f;
  for_each_in_row<kThreads>(row, stride, V, [&](int64_t v, float l) {
    const float x = radix_key(l) >= floor ? expf(l / t - st.max) / st.sum : 0.0f;
    p[v] = x;
    if (!top_p) r[v] = x;
  });
  __syncthreads();  // p is read below, and by the walk, in another thread layout
  if (!top_p) return;
  // top-p: the smallest key K with mass(p with key > K) < top_p; keep key >= K
  const uint32_t keep = block_radix_select<kThreads>(
      4, radix_mass_target(rs.top_p), sh.radix, [&](const RadixState& s) {
        for (int64_t v = threadIdx.x; v < V; v += kThreads) {
          const uint64_t m = radix_mass(p[v]);
          const uint32_t key = radix_key(p[v]);
          if (m != 0 && radix_in_range(key, s)) {
            radix_add_mass(sh.radix, radix_digit(key, s), m);
          }
        }
      });
  float kept = 0.0f;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    kept += radix_key(p[v]) >= keep ? p[v] : 0.0f;
  }
  const float z = block_sum(kept, sh);
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const float x = radix_key(p[v]) >= keep ? p[v] / z : 0.0f;
    p[v] = x;
    r[v] = x;
  }
  __syncthreads();
}

// At least one block per SM is all a launch of one block per sequence needs, which lets
// ptxas keep the unrolled 128-bit row loops in registers.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    tree_rejection_sample_kernel(TreeRejectionSampleArgs a) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  const int64_t V = a.vocab;
  const bool lead = threadIdx.x == 0;
  if (lead) tree_init_row(a, b);
  const RowSampling rs = sequence_sampling(a, b);
  int64_t cur = 0, depth = 0;
  if (rs.greedy) {
    int64_t best = row_argmax<T>(a, b, cur, sh);
    for (int64_t c = 1; c < a.num_nodes; ++c) {
      const int64_t x = tree_candidate(a, b, c, cur, depth);
      if (x < 0 || x != best) continue;
      if (lead) tree_record_accept(a, b, depth, c, x);
      ++depth;
      cur = c;
      best = row_argmax<T>(a, b, cur, sh);
    }
    if (lead) tree_record_emit(a, b, depth, best);
    return;
  }
  const bool has_q = a.draft_probs != nullptr;
  float* p = a.workspace + b * 2 * V;
  float* r = p + V;
  warp_row<T>(a, rs, b, cur, p, r, sh);
  float s = 1.0f, z = 1.0f, tried = 0.0f;
  int64_t rank = 0;
  float u_node = tree_accept_uniform(rs, cur, 0);
  for (int64_t c = 1; c < a.num_nodes; ++c) {
    const int64_t x = tree_candidate(a, b, c, cur, depth);
    if (x < 0) continue;
    const int64_t j = rank++;
    const float rx = r[x];
    bool ok;
    if (!has_q) {
      const float next = tried + rx;
      ok = u_node < next;
      if (!ok) {
        tried = next;
        __syncthreads();  // every thread has read r[x]
        if (lead) r[x] = 0.0f;
        __syncthreads();
      }
    } else {
      if (a.without_replacement) {
        // every earlier candidate of `cur` was rejected: a repeated token is skipped
        bool repeat = false;
        for (int64_t c2 = 1; c2 < c && !repeat; ++c2) {
          repeat = tree_candidate(a, b, c2, cur, depth) == x;
        }
        if (repeat) continue;
      }
      const int64_t qbase = b * a.draft_probs_stride_b + cur * a.draft_probs_stride_t;
      const float qx = load_float(a.draft_probs, a.draft_probs_dtype,
                                  qbase + x * a.draft_probs_stride_v);
      const float scale = tree_draft_scale(s, z);
      ok = tree_accept_draft(tree_accept_uniform(rs, cur, j), scale, qx, rx);
      if (!ok) {
        __syncthreads();  // every thread has read r[x]
        float part = 0.0f;
        for (int64_t v = threadIdx.x; v < V; v += kThreads) {
          const float q = load_float(a.draft_probs, a.draft_probs_dtype,
                                     qbase + v * a.draft_probs_stride_v);
          r[v] = tree_residual(r[v], scale, q);
          part += r[v];
        }
        s = block_sum(part, sh);
        if (a.without_replacement) z = z - qx;
      }
    }
    if (ok) {
      if (lead) tree_record_accept(a, b, depth, c, x);
      ++depth;
      cur = c;
      __syncthreads();  // every thread has read r[x] before the rows are rewritten
      warp_row<T>(a, rs, b, cur, p, r, sh);
      s = 1.0f;
      z = 1.0f;
      tried = 0.0f;
      rank = 0;
      u_node = tree_accept_uniform(rs, cur, 0);
    }
  }
  bool empty;
  if (has_q) {
    empty = s <= kTreeResidualEps;
  } else {
    float m = 0.0f;
    for (int64_t v = threadIdx.x; v < V; v += kThreads) m = fmaxf(m, r[v]);
    empty = !(block_max(m, sh) > 0.0f);
  }
  const float* w = empty ? p : r;
  const uint32_t stream = philox_stream(static_cast<uint32_t>(cur), kPhiloxSample);
  float best = -1.0f;
  int64_t best_v = 0;
  for (int64_t blk = threadIdx.x; blk < (V + 3) / 4; blk += kThreads) {
    const Philox4 u = philox_block(rs.seed, rs.offset, stream, static_cast<uint32_t>(blk));
    for (int i = 0; i < 4; ++i) {
      const int64_t v = 4 * blk + i;
      if (v < V && w[v] > 0.0f) {
        race_update(race_key(w[v], philox_to_uniform(u.x[i])), v, best, best_v);
      }
    }
  }
  const int64_t token = block_argmax(best, best_v, sh);
  if (lead) tree_record_emit(a, b, depth, token);
}

}  // namespace

cudaError_t tree_rejection_sample_cuda(const TreeRejectionSampleArgs& a, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.batch));
  switch (a.logits_dtype) {
    case DType::kFloat16:
      tree_rejection_sample_kernel<__half><<<grid, kThreads, 0, stream>>>(a);
      break;
    case DType::kBFloat16:
      tree_rejection_sample_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a);
      break;
    default:
      tree_rejection_sample_kernel<float><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace osd
