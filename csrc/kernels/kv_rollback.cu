// CUDA kernel for kv_rollback. Derivation and layout: kernels/kv_rollback.h.
// Grid: (B, L*2*H); block: threads over D in units of 4/8/16 bytes. Each thread walks the
// accepted path in order, so overlapping source/destination slots are safe (see header).
#include <cuda_runtime.h>

#include "kernels/kv_rollback.h"
#include "kernels/kv_rollback_cuda.h"

namespace osd {
namespace {

template <typename Vec>
__global__ void kv_rollback_kernel(KvRollbackArgs a, int64_t vecs_per_row) {
  const int64_t b = blockIdx.x;
  const int64_t lkh = blockIdx.y;
  const int64_t lk = lkh / a.num_heads;
  const int64_t h = lkh % a.num_heads;
  const int32_t n = a.keep[b];
  if (n <= 0) return;
  const int64_t base = a.lens[b];
  char* row = static_cast<char*>(a.kv) +
              (lk * a.stride_lk + b * a.stride_b + h * a.stride_h) * a.elem_size;
  const int64_t stride_s_bytes = a.stride_s * a.elem_size;
  const int64_t* slots = a.slots + b * a.slots_stride_b;
  for (int64_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
    for (int32_t j = 0; j < n; ++j) {
      const int64_t src = base + slots[j];
      const int64_t dst = base + j;
      if (src == dst) continue;
      const Vec x = reinterpret_cast<const Vec*>(row + src * stride_s_bytes)[v];
      reinterpret_cast<Vec*>(row + dst * stride_s_bytes)[v] = x;
    }
  }
}

__global__ void kv_rollback_lens_kernel(int32_t* lens, const int32_t* keep, int64_t batch) {
  const int64_t b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < batch && keep[b] > 0) lens[b] += keep[b];
}

template <typename Vec>
cudaError_t launch_typed(const KvRollbackArgs& a, cudaStream_t stream) {
  const int64_t row_bytes = a.head_dim * a.elem_size;
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int threads = static_cast<int>(vecs < 128 ? (vecs < 32 ? 32 : vecs) : 128);
  dim3 grid(static_cast<unsigned>(a.batch), static_cast<unsigned>(a.num_lk * a.num_heads));
  kv_rollback_kernel<Vec><<<grid, threads, 0, stream>>>(a, vecs);
  return cudaGetLastError();
}

}  // namespace

cudaError_t kv_rollback_cuda(const KvRollbackArgs& a, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  // Widest vector access that the base address, every stride and the row size allow.
  const auto aligned = [&a](int64_t n) {
    const int64_t e = a.elem_size;
    return reinterpret_cast<uintptr_t>(a.kv) % n == 0 && (a.head_dim * e) % n == 0 &&
           (a.stride_lk * e) % n == 0 && (a.stride_b * e) % n == 0 &&
           (a.stride_h * e) % n == 0 && (a.stride_s * e) % n == 0;
  };
  cudaError_t err;
  if (aligned(16)) {
    err = launch_typed<int4>(a, stream);
  } else if (aligned(8)) {
    err = launch_typed<int2>(a, stream);
  } else if (aligned(4)) {
    err = launch_typed<int>(a, stream);
  } else {
    err = launch_typed<short>(a, stream);
  }
  if (err != cudaSuccess) return err;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>((a.batch + threads - 1) / threads);
  kv_rollback_lens_kernel<<<blocks, threads, 0, stream>>>(a.lens, a.keep, a.batch);
  return cudaGetLastError();
}

}  // namespace osd
