// Block-wide helpers shared by the CUDA sampling kernels: reductions (each thread combines
// the per-warp partials in the same order, so every thread gets the same result), the row
// loop with 128-bit loads, the block-parallel radix selection of kernels/radix_select.h,
// and the pieces of a last-block merge (an atomic counter, records read past L1).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/philox.h"
#include "kernels/radix_select.h"

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

// The DType of a CUDA element type (radix_levels of its rows).
template <typename T>
struct DTypeOf {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct DTypeOf<__half> {
  static constexpr DType value = DType::kFloat16;
};
template <>
struct DTypeOf<__nv_bfloat16> {
  static constexpr DType value = DType::kBFloat16;
};

// Element l of a 128-bit load held as four 32-bit words, as float (bit operations on
// registers: viewing the load through a T pointer would move it to local memory).
template <typename T>
__device__ __forceinline__ float word_lane(const uint32_t (&words)[4], int l) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(words[l]);
  } else {
    const uint32_t w = words[l / 2];
    const uint32_t bits = (l & 1) ? w >> 16 : w & 0xFFFFu;
    if constexpr (DTypeOf<T>::value == DType::kBFloat16) return __uint_as_float(bits << 16);
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
}

// fn(v, float(row[v * stride])) for every v < n, shared by the kThreads threads of the
// block. A contiguous row on a 16-byte boundary is read in 128-bit loads (16 / sizeof(T)
// consecutive elements per thread and load, in increasing v), the tail and any other row
// element by element. Which thread sees which v depends only on (row, stride, n).
template <int kThreads, typename T, typename Fn>
__device__ __forceinline__ void for_each_in_row(const T* row, int64_t stride, int64_t n,
                                                Fn&& fn) {
  constexpr int kVec = 16 / sizeof(T);
  int64_t v0 = 0;
  if (stride == 1 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    const int64_t nvec = n / kVec;
    const uint4* vrow = reinterpret_cast<const uint4*>(row);
    for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
      const uint4 raw = __ldg(vrow + i);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int l = 0; l < kVec; ++l) fn(i * kVec + l, word_lane<T>(words, l));
    }
    v0 = nvec * kVec;
  }
  for (int64_t v = v0 + threadIdx.x; v < n; v += kThreads) fn(v, to_float(row[v * stride]));
}

// Word i (0..3) of a Philox block, without indexing the array (which would place it in
// local memory).
__device__ __forceinline__ uint32_t philox_word(const Philox4& w, int64_t i) {
  const uint32_t lo = (i & 1) ? w.x[1] : w.x[0];
  const uint32_t hi = (i & 1) ? w.x[3] : w.x[2];
  return (i & 2) ? hi : lo;
}

// Shared memory of block_radix_select: the histogram, bin d holding lo[d] + 2^32 * hi[d]
// (counts stay in lo), and the scan's per-warp sums and result.
struct RadixShared {
  uint32_t lo[kRadixBins];
  uint32_t hi[kRadixBins];
  unsigned long long warp_sum[kRadixBins / 32];
  unsigned long long greater;
  int digit;
};

__device__ __forceinline__ void radix_add_count(RadixShared& sh, uint32_t digit) {
  atomicAdd(sh.lo + digit, 1u);
}

// Adds a 64-bit mass with 32-bit atomics (a 64-bit shared atomicAdd is a compare-and-swap
// loop): the thread whose add wraps lo[d] carries one into hi[d], so the pair holds the
// exact sum whatever the order of the adds.
__device__ __forceinline__ void radix_add_mass(RadixShared& sh, uint32_t digit, uint64_t m) {
  const uint32_t lo = static_cast<uint32_t>(m);
  const uint32_t old = atomicAdd(sh.lo + digit, lo);
  const uint32_t hi = static_cast<uint32_t>(m >> 32) + (old + lo < old ? 1u : 0u);
  if (hi != 0) atomicAdd(sh.hi + digit, hi);
}

// Radix selection (kernels/radix_select.h) by a block of kThreads >= 256 threads. Per level
// `fill(state)` has every thread add its items in range to the shared histogram
// (radix_add_count or radix_add_mass); thread t < 256 then holds bin 255 - t, so an
// inclusive scan over threads gives each bin its G(d) and the one bin reaching `target`
// publishes its digit. Returns the selected key (0 when the row holds less than target),
// the same on every thread.
template <int kThreads, typename Fill>
__device__ uint32_t block_radix_select(int levels, uint64_t target, RadixShared& sh,
                                       Fill&& fill) {
  static_assert(kThreads >= kRadixBins && kThreads % 32 == 0, "one thread per bin");
  const int t = threadIdx.x, lane = t % 32;
  RadixState s = radix_init();
  while (s.level < levels) {
    if (t < kRadixBins) {
      sh.lo[t] = 0;
      sh.hi[t] = 0;
    }
    if (t == 0) sh.digit = -1;
    __syncthreads();
    fill(static_cast<const RadixState&>(s));
    __syncthreads();
    const int bin = kRadixBins - 1 - t;
    const uint64_t h =
        t < kRadixBins ? (static_cast<uint64_t>(sh.hi[bin]) << 32) | sh.lo[bin] : 0;
    uint64_t incl = h;
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (t < kRadixBins && lane == 31) sh.warp_sum[t / 32] = incl;
    __syncthreads();
    if (t < kRadixBins) {
      uint64_t greater = incl - h;
      for (int w = 0; w < t / 32; ++w) greater += sh.warp_sum[w];
      if (radix_bin_reaches(s.above, greater, h, target)) {
        sh.digit = bin;
        sh.greater = greater;
      }
    }
    __syncthreads();
    const int digit = sh.digit;
    const uint64_t greater = sh.greater;
    __syncthreads();  // every thread has read the result before the next level resets it
    if (digit < 0) return 0;
    radix_descend(s, static_cast<uint32_t>(digit), greater);
  }
  return radix_result(s, levels);
}

// ---- records shared between blocks -------------------------------------------------------

// A record written by another block, read past L1 (the block that merges after the others
// counted themselves done on an atomic counter).
template <typename T>
__device__ __forceinline__ T load_cg(const T* p) {
  static_assert(sizeof(T) % 4 == 0, "records are made of 32-bit words");
  uint32_t w[sizeof(T) / 4];
  const uint32_t* src = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i) w[i] = __ldcg(src + i);
  T x;
  memcpy(&x, w, sizeof(T));
  return x;
}

// Whether this block is the last of `target` to reach `counter`, the same on every thread
// (`flag`: one int of shared memory). Every thread's global writes before the call are
// visible to the last block after it.
__device__ __forceinline__ bool last_to_arrive(int32_t* counter, int32_t target, int32_t* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1) == target - 1;
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();
  return last;
}

template <typename T>
__device__ __forceinline__ T shfl_xor_words(const T& x, int o) {
  static_assert(sizeof(T) % 4 == 0, "shuffled as 32-bit words");
  uint32_t w[sizeof(T) / 4];
  memcpy(w, &x, sizeof(T));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i) {
    w[i] = __shfl_xor_sync(0xffffffffu, w[i], o);
  }
  T y;
  memcpy(&y, w, sizeof(T));
  return y;
}

// op (commutative) over a block of kWarps full warps for any record of 32-bit words; every
// thread gets the same result (warp partials combined in order). slots: kWarps * sizeof(T)
// bytes of shared memory, 16-byte aligned.
template <int kWarps, typename T, typename Op>
__device__ __forceinline__ T block_allreduce(T x, Op op, void* slots) {
  for (int o = 16; o > 0; o >>= 1) x = op(x, shfl_xor_words(x, o));
  T* part = static_cast<T*>(slots);
  __syncthreads();
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = x;
  __syncthreads();
  T r = part[0];
  for (int w = 1; w < kWarps; ++w) r = op(r, part[w]);
  return r;
}

// Exclusive prefix sum of x over the threads in order, and the block total (partials:
// kWarps words of shared memory).
template <int kWarps>
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t x, uint32_t& total,
                                                         uint32_t* partials) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t incl = x;
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  __syncthreads();
  if (lane == 31) partials[warp] = incl;
  __syncthreads();
  uint32_t before = 0;
  total = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += partials[w];
    total += partials[w];
  }
  return before + incl - x;
}

}  // namespace osd
