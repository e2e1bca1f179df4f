// kv_rollback: in-place compaction of accepted tree slots in a static KV cache.
//
// Cache layout (one tensor for all layers, K and V):
//   kv      [L, 2, B_max, H, S, D]   any element size, last dim contiguous
//   lens    [B_max] int32            committed length per sequence (device side)
// For every active row b < B:
//   base = lens[b]
//   for j in 0 .. keep[b]-1:  kv[:, :, b, :, base + j, :] = kv[:, :, b, :, base + slots[b, j], :]
//   lens[b] = base + keep[b]
// `slots[b, :keep[b]]` are tree-node indices relative to base (node i was written at
// base + i by the verify forward). They are strictly increasing (a root-to-leaf path in a
// topologically ordered tree), so slots[b, j] >= j: a destination never lies after its
// source, and copying in increasing j reads every source before anything overwrites it.
// Each thread owns one (layer, k/v, head, element) column and walks j in order, so the
// in-place copy is race-free with overlapping source and destination ranges and needs no
// scratch memory. The length update runs after the copy (a second, tiny launch on CUDA).
#pragma once
#include <cstdint>

#include "kernels/common.h"

namespace osd {

struct KvRollbackArgs {
  void* kv;               // base pointer of the cache
  int64_t elem_size;      // bytes per element (2 or 4)
  int64_t num_lk;         // L * 2 (flattened layer x {k, v})
  int64_t num_heads;      // H
  int64_t head_dim;       // D
  int64_t stride_lk;      // element strides of the flattened [L*2, B_max, H, S, D] view
  int64_t stride_b;
  int64_t stride_h;
  int64_t stride_s;
  int32_t* lens;          // [B_max]
  const int64_t* slots;   // [B, max_keep]
  int64_t slots_stride_b; // element stride of slots along B
  const int32_t* keep;    // [B]
  int64_t batch;          // B (active rows)
  int64_t max_keep;       // columns of slots
};

// CPU kernel (OpenMP over rows and heads). Defined in csrc/cpu/kv_rollback.cpp.
void kv_rollback_cpu(const KvRollbackArgs& args);

}  // namespace osd
