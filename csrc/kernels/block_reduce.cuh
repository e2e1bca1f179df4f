// Block-wide reductions shared by the CUDA sampling kernels. Each thread combines the
// per-warp partials in the same order, so every thread gets the same result.
#pragma once
#include <cstdint>

namespace osd {

struct AddOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduce x over a block of kWarps full warps: within each warp by shuffles, then across
// the partials in `slots` (kWarps entries of shared memory).
template <int kWarps, typename T, typename Op>
__device__ __forceinline__ T block_reduce(T x, T init, T* slots, Op op) {
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = x;
  __syncthreads();
  T r = init;
  for (int w = 0; w < kWarps; ++w) r = op(r, slots[w]);
  return r;
}

}  // namespace osd
