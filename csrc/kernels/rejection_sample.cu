// CUDA kernel for rejection_sample. Semantics, randomness and derivation:
// kernels/rejection_sample.h.
//
// Grid: one block per sequence (kThreads threads). The block walks the draft positions in
// order and stops at the first rejection, so rows after it are never read. For a visited
// row it computes, with block-wide reductions over vocab strips:
//   - the top-k threshold (k-th largest scaled logit) by bisection on the float's ordered
//     bit pattern: 32 counting passes, only when top-k is on;
//   - (max, sum exp) over the top-k set in one online pass;
//   - the top-p key (smallest probability bit pattern T with mass(p > T) < top_p) by
//     bisection over [0, 1]: 31 mass passes, only when top-p is on, then the kept mass Z2.
// The accept test then needs one logit (thread 0). The rejected or bonus row runs the
// exponential race: each thread takes four consecutive tokens per Philox call, keeps its
// best (key, index) and the block reduces with the lowest index on ties. Nothing of size
// V is ever written; the only full-row work past the statistics is that one race row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/block_reduce.cuh"
#include "kernels/rejection_sample.h"
#include "kernels/rejection_sample_cuda.h"

namespace osd {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

struct Shared {
  float f[kWarps];
  int64_t i[kWarps];
  int64_t bcast_i;
};

__device__ __forceinline__ float block_sum(float x, Shared& sh) {
  return block_reduce<kWarps>(x, 0.0f, sh.f, AddOp{});
}

__device__ __forceinline__ float block_max(float x, Shared& sh) {
  return block_reduce<kWarps>(x, -INFINITY, sh.f, MaxOp{});
}

__device__ __forceinline__ int64_t block_count(int64_t x, Shared& sh) {
  return block_reduce<kWarps>(x, int64_t{0}, sh.i, AddOp{});
}

__device__ __forceinline__ LseState block_lse(LseState s, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    LseState other{__shfl_xor_sync(0xffffffffu, s.max, o), __shfl_xor_sync(0xffffffffu, s.sum, o)};
    s = lse_merge(s, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) sh.f[warp] = s.max;
  __syncthreads();
  // max first, then every warp's sum rescaled to it (same order on every thread)
  float m = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sh.f[w]);
  const float mine = (s.max == -INFINITY) ? 0.0f : s.sum * expf(s.max - m);
  const float total = block_sum(lane == 0 ? mine : 0.0f, sh);
  return LseState{m, total};
}

// (key, index) argmax with the lowest index on ties; returns the winning index.
__device__ __forceinline__ int64_t block_argmax(float key, int64_t idx, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const float k2 = __shfl_xor_sync(0xffffffffu, key, o);
    const int64_t i2 = __shfl_xor_sync(0xffffffffu, idx, o);
    argmax_update(k2, i2, key, idx);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    sh.f[warp] = key;
    sh.i[warp] = idx;
  }
  __syncthreads();
  float best = -INFINITY;
  int64_t best_i = INT64_MAX;
  for (int w = 0; w < kWarps; ++w) argmax_update(sh.f[w], sh.i[w], best, best_i);
  return best_i;
}

struct RowStats {
  float kth;     // top-k threshold on scaled logits (-inf: off)
  float max;     // max scaled logit
  float inv_z1;  // 1 / sum exp(s - max) over the top-k set
  int32_t p_key; // top-p threshold on float_order_key(p) (0: off)
  float z2;      // mass of the kept set, in units of exp(s - max)
};

template <typename T>
struct Row {
  const T* ptr;
  int64_t stride;
  float temperature;
  __device__ __forceinline__ float scaled(int64_t v) const {
    return to_float(ptr[v * stride]) / temperature;
  }
};

// exp(s - max) on the kept set (top-k and top-p), 0 elsewhere.
__device__ __forceinline__ float warped_mass(float s, const RowStats& st) {
  const float e = s >= st.kth ? expf(s - st.max) : 0.0f;
  return float_order_key(e * st.inv_z1) >= st.p_key ? e : 0.0f;
}

template <typename T>
__device__ RowStats row_stats(const Row<T>& row, int64_t V, int32_t top_k, float top_p,
                              Shared& sh) {
  RowStats st{-INFINITY, -INFINITY, 0.0f, 0, 0.0f};
  if (top_k > 0) {
    int64_t lo = INT32_MIN, hi = INT32_MAX;
    for (int it = 0; it < 32; ++it) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      int64_t count = 0;
      for (int64_t v = threadIdx.x; v < V; v += kThreads) {
        count += float_order_key(row.scaled(v) + 0.0f) >= mid;
      }
      if (block_count(count, sh) >= top_k) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    st.kth = float_from_order_key(static_cast<int32_t>(lo));
  }
  LseState lse = lse_init();
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const float s = row.scaled(v);
    if (s >= st.kth) lse = lse_merge(lse, LseState{s, 1.0f});
  }
  lse = block_lse(lse, sh);
  st.max = lse.max;
  st.inv_z1 = 1.0f / lse.sum;
  st.z2 = lse.sum;
  if (top_p < 1.0f) {
    int32_t lo = 0, hi = 0x3F800000;  // bit pattern of 1.0f
    for (int it = 0; it < 31; ++it) {
      const int32_t mid = lo + (hi - lo) / 2;
      float mass = 0.0f;
      for (int64_t v = threadIdx.x; v < V; v += kThreads) {
        const float s = row.scaled(v);
        const float p = (s >= st.kth ? expf(s - st.max) : 0.0f) * st.inv_z1;
        mass += float_order_key(p) > mid ? p : 0.0f;
      }
      if (block_sum(mass, sh) < top_p) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    st.p_key = lo;
    float z2 = 0.0f;
    for (int64_t v = threadIdx.x; v < V; v += kThreads) z2 += warped_mass(row.scaled(v), st);
    st.z2 = block_sum(z2, sh);
  }
  return st;
}

template <typename T>
__device__ int64_t row_argmax_logits(const T* ptr, int64_t stride, int64_t V, Shared& sh) {
  float best = -INFINITY;
  int64_t best_v = INT64_MAX;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    argmax_update(to_float(ptr[v * stride]), v, best, best_v);
  }
  const int64_t w = block_argmax(best, best_v, sh);
  return w == INT64_MAX ? 0 : w;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rejection_sample_kernel(RejectionSampleArgs a) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  const RowSampling rs = row_sampling(a, b);
  const int64_t V = a.vocab;
  const int64_t K1 = a.num_draft_max + 1;
  int64_t* out = a.out_tokens + b * K1;
  for (int64_t i = threadIdx.x; i < K1; i += kThreads) out[i] = -1;
  __syncthreads();
  const T* base = static_cast<const T*>(a.logits) + b * a.logits_stride_b;
  const int64_t* drafts = a.draft_ids + b * a.draft_ids_stride_b;

  if (rs.greedy) {
    int64_t j = 0;
    int64_t token = 0;
    for (;; ++j) {
      token = row_argmax_logits(base + j * a.logits_stride_k, a.logits_stride_v, V, sh);
      if (j == rs.num_draft || drafts[j * a.draft_ids_stride_k] != token) break;
      if (threadIdx.x == 0) out[j] = token;
    }
    if (threadIdx.x == 0) {
      out[j] = token;
      a.num_accepted[b] = static_cast<int32_t>(j);
    }
    return;
  }

  int64_t j = 0;
  int64_t x = -1;
  bool rejected = false;
  RowStats st;
  for (;; ++j) {
    const Row<T> row{base + j * a.logits_stride_k, a.logits_stride_v, rs.temperature};
    st = row_stats(row, V, rs.top_k, rs.top_p, sh);
    if (j == rs.num_draft) break;
    x = drafts[j * a.draft_ids_stride_k];
    if (threadIdx.x == 0) {
      const bool in_vocab = x >= 0 && x < V;
      float log_p = -INFINITY;
      float q = 1.0f;
      if (in_vocab) {
        const float s = row.scaled(x);
        if (warped_mass(s, st) > 0.0f) log_p = (s - st.max) - logf(st.z2);
        if (a.draft_probs != nullptr) {
          q = load_float(a.draft_probs, a.draft_probs_dtype,
                         b * a.draft_probs_stride_b + j * a.draft_probs_stride_k +
                             x * a.draft_probs_stride_v);
        }
      }
      const float u = philox_uniform(rs.seed, rs.offset,
                                     philox_stream(static_cast<uint32_t>(j), kPhiloxAccept), 0);
      sh.bcast_i = accept_draft(u, q, log_p) ? 1 : 0;
    }
    __syncthreads();
    const bool accepted = sh.bcast_i != 0;
    __syncthreads();
    if (!accepted) {
      rejected = true;
      break;
    }
    if (threadIdx.x == 0) out[j] = x;
  }

  // The emitted token of row j: residual (after a rejection) or p_j, by exponential race.
  const Row<T> row{base + j * a.logits_stride_k, a.logits_stride_v, rs.temperature};
  const float inv_z2 = 1.0f / st.z2;
  const int64_t q_base = b * a.draft_probs_stride_b + j * a.draft_probs_stride_k;
  const bool has_q = a.draft_probs != nullptr;
  const auto residual = [&](int64_t v, float p) {
    if (has_q) return residual_mass(p, load_float(a.draft_probs, a.draft_probs_dtype,
                                                  q_base + v * a.draft_probs_stride_v));
    return v == x ? 0.0f : p;
  };
  bool use_residual = false;
  if (rejected) {
    float m = 0.0f;
    for (int64_t v = threadIdx.x; v < V; v += kThreads) {
      m = fmaxf(m, residual(v, warped_mass(row.scaled(v), st) * inv_z2));
    }
    use_residual = block_max(m, sh) > 0.0f;
  }
  const uint32_t stream = philox_stream(static_cast<uint32_t>(j), kPhiloxSample);
  float best = -INFINITY;
  int64_t best_v = INT64_MAX;
  const int64_t nblocks = (V + 3) / 4;
  for (int64_t blk = threadIdx.x; blk < nblocks; blk += kThreads) {
    const Philox4 w = philox_block(rs.seed, rs.offset, stream, static_cast<uint32_t>(blk));
    for (int l = 0; l < 4; ++l) {
      const int64_t v = 4 * blk + l;
      if (v >= V) break;
      float r = warped_mass(row.scaled(v), st) * inv_z2;
      if (use_residual) r = residual(v, r);
      if (r > 0.0f) argmax_update(race_key(r, philox_to_uniform(w.x[l])), v, best, best_v);
    }
  }
  const int64_t token = block_argmax(best, best_v, sh);
  if (threadIdx.x == 0) {
    out[j] = token == INT64_MAX ? 0 : token;
    a.num_accepted[b] = static_cast<int32_t>(j);
  }
}

}  // namespace

cudaError_t rejection_sample_cuda(const RejectionSampleArgs& a, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.batch));
  switch (a.logits_dtype) {
    case DType::kFloat16:
      rejection_sample_kernel<__half><<<grid, kThreads, 0, stream>>>(a);
      break;
    case DType::kBFloat16:
      rejection_sample_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a);
      break;
    default:
      rejection_sample_kernel<float><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace osd
