// CUDA kernel for rejection_sample: the one-block-per-sequence path. Semantics, randomness
// and derivation: kernels/rejection_sample.h. rejection_sample_cuda runs the
// split-vocabulary kernels first (kernels/rejection_sample_split.cu) and this kernel for
// the sequences they leave: top-p without top-k, top-k > kSplitTopKMax, and top-k tails the
// chunk records cannot resolve (kSeqLegacy); with no workspace, for every sequence.
//
// Grid: one block per sequence (kThreads threads). The block walks the draft positions in
// order and stops at the first rejection, so rows after it are never read. For a visited
// row it computes, with block-wide passes over the row (128-bit loads when it is
// contiguous: for_each_in_row):
//   - the top-k set, only when top-k is on: the k-th largest raw logit by radix selection
//     (one histogram pass per significant 8-bit key digit: 2 for bfloat16, 3 for float16,
//     4 for float32; kernels/radix_select.h), turned into a floor on raw logit keys
//     (top_k_logit_floor), so the later passes skip dropped tokens by an integer compare;
//   - (max, sum exp) over the top-k set in one online pass;
//   - the top-p key (smallest probability key T with mass(p > T) < top_p) by radix
//     selection on fixed-point mass histograms (4 passes), only when top-p is on, then the
//     kept mass Z2.
// The accept test then needs one logit (thread 0). The rejected or bonus row runs the
// exponential race: each kept token's key uses the Philox block of its four-token group,
// each thread keeps its best (key, index) and the block reduces with the lowest index on
// ties. Nothing of size V is ever written; the only full-row work past the statistics is
// that one race row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/block_reduce.cuh"
#include "kernels/chunk_stats.h"
#include "kernels/rejection_sample.h"
#include "kernels/rejection_sample_cuda.h"

namespace osd {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

struct Shared {
  float f[kWarps];
  int64_t i[kWarps];
  int64_t bcast_i;
  RadixShared radix;
};

__device__ __forceinline__ float block_sum(float x, Shared& sh) {
  return block_reduce<kWarps>(x, 0.0f, sh.f, AddOp{});
}

__device__ __forceinline__ float block_max(float x, Shared& sh) {
  return block_reduce<kWarps>(x, -INFINITY, sh.f, MaxOp{});
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
  uint32_t floor;    // top-k: smallest kept raw logit key (0: off)
  float max;         // max scaled logit over the top-k set
  float inv_z1;      // 1 / sum exp(s - max) over the top-k set
  uint32_t p_key;    // top-p: smallest kept radix_key(p) (0: off)
  float z2;          // mass of the kept set, in units of exp(s - max)
};

template <typename T>
struct Row {
  const T* ptr;
  int64_t stride;
  float temperature;
  __device__ __forceinline__ float logit(int64_t v) const { return to_float(ptr[v * stride]); }
  template <typename Fn>
  __device__ __forceinline__ void for_each(int64_t V, Fn&& fn) const {
    for_each_in_row<kThreads>(ptr, stride, V, fn);
  }
};

// exp(s - max) of raw logit l (s = l / t) on the kept set (top-k and top-p), 0 elsewhere.
__device__ __forceinline__ float warped_mass(float l, float t, const RowStats& st) {
  if (radix_key(l) < st.floor) return 0.0f;
  const float e = expf(l / t - st.max);
  return radix_key(e * st.inv_z1) >= st.p_key ? e : 0.0f;
}

template <typename T>
__device__ RowStats row_stats(const Row<T>& row, int64_t V, const RowSampling& rs,
                              Shared& sh) {
  const float t = row.temperature;
  RowStats st{0u, -INFINITY, 0.0f, 0u, 0.0f};
  if (rs.top_k > 0) {
    const uint32_t kth = block_radix_select<kThreads>(
        radix_levels(DTypeOf<T>::value), static_cast<uint64_t>(rs.top_k), sh.radix,
        [&](const RadixState& s) {
          row.for_each(V, [&](int64_t, float l) {
            const uint32_t key = radix_key(l);
            if (radix_in_range(key, s)) radix_add_count(sh.radix, radix_digit(key, s));
          });
        });
    st.floor = top_k_logit_floor(kth, t);
  }
  LseState lse = lse_init();
  row.for_each(V, [&](int64_t, float l) {
    if (radix_key(l) >= st.floor) lse = lse_merge(lse, LseState{l / t, 1.0f});
  });
  lse = block_lse(lse, sh);
  st.max = lse.max;
  st.inv_z1 = 1.0f / lse.sum;
  st.z2 = lse.sum;
  if (rs.top_p < 1.0f) {
    st.p_key = block_radix_select<kThreads>(
        4, radix_mass_target(rs.top_p), sh.radix, [&](const RadixState& s) {
          row.for_each(V, [&](int64_t, float l) {
            if (radix_key(l) < st.floor) return;
            const float p = expf(l / t - st.max) * st.inv_z1;
            const uint64_t m = radix_mass(p);
            const uint32_t key = radix_key(p);
            if (m != 0 && radix_in_range(key, s)) radix_add_mass(sh.radix, radix_digit(key, s), m);
          });
        });
    float z2 = 0.0f;
    row.for_each(V, [&](int64_t, float l) { z2 += warped_mass(l, t, st); });
    st.z2 = block_sum(z2, sh);
  }
  return st;
}

template <typename T>
__device__ int64_t row_argmax_logits(const Row<T>& row, int64_t V, Shared& sh) {
  float best = -INFINITY;
  int64_t best_v = INT64_MAX;
  row.for_each(V, [&](int64_t v, float l) { argmax_update(l, v, best, best_v); });
  const int64_t w = block_argmax(best, best_v, sh);
  return w == INT64_MAX ? 0 : w;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rejection_sample_kernel(RejectionSampleArgs a) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  const RowSampling rs = row_sampling(a, b);
  if (a.workspace != nullptr && split_mode(rs) != SplitMode::kLegacy) {
    const SplitLayout l = split_layout(a.batch, a.num_draft_max + 1, a.vocab);
    if (a.counters[l.state + b] != kSeqLegacy) return;  // done by the split path
  }
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
      const Row<T> row{base + j * a.logits_stride_k, a.logits_stride_v, 1.0f};
      token = row_argmax_logits(row, V, sh);
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
    st = row_stats(row, V, rs, sh);
    if (j == rs.num_draft) break;
    x = drafts[j * a.draft_ids_stride_k];
    if (threadIdx.x == 0) {
      const bool in_vocab = x >= 0 && x < V;
      float log_p = -INFINITY;
      float q = 1.0f;
      if (in_vocab) {
        const float l = row.logit(x);
        if (warped_mass(l, rs.temperature, st) > 0.0f) {
          log_p = (l / rs.temperature - st.max) - logf(st.z2);
        }
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
  const float t = rs.temperature;
  bool use_residual = false;
  if (rejected) {
    float m = 0.0f;
    row.for_each(V, [&](int64_t v, float l) {
      m = fmaxf(m, residual(v, warped_mass(l, t, st) * inv_z2));
    });
    use_residual = block_max(m, sh) > 0.0f;
  }
  // A thread sees consecutive v within each 128-bit load, so one Philox block serves the
  // four tokens of its group; it is computed for groups with a kept token only.
  const uint32_t stream = philox_stream(static_cast<uint32_t>(j), kPhiloxSample);
  float best = -INFINITY;
  int64_t best_v = INT64_MAX;
  Philox4 w{};
  int64_t w_blk = -1;
  row.for_each(V, [&](int64_t v, float l) {
    float r = warped_mass(l, t, st) * inv_z2;
    if (use_residual) r = residual(v, r);
    if (r > 0.0f) {
      if (v / 4 != w_blk) {
        w_blk = v / 4;
        w = philox_block(rs.seed, rs.offset, stream, static_cast<uint32_t>(w_blk));
      }
      argmax_update(race_key(r, philox_to_uniform(philox_word(w, v))), v, best, best_v);
    }
  });
  const int64_t token = block_argmax(best, best_v, sh);
  if (threadIdx.x == 0) {
    out[j] = token == INT64_MAX ? 0 : token;
    a.num_accepted[b] = static_cast<int32_t>(j);
  }
}

}  // namespace

cudaError_t rejection_sample_cuda(const RejectionSampleArgs& a, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  if (a.workspace != nullptr) {
    const cudaError_t err = rejection_sample_split_cuda(a, stream);
    if (err != cudaSuccess) return err;
  }
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
