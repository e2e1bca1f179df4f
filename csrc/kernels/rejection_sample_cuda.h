// CUDA launcher declarations for rejection_sample (torch-free; included by the CUDA glue).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/chunk_stats.h"
#include "kernels/rejection_sample.h"

namespace osd {

// Workspace of the split-vocabulary path for B sequences, K1 = K + 1 rows and V tokens:
// `bytes` of records (offsets in bytes, 16-byte aligned) and `counters` int32 that must be
// zero when the kernels start (the glue allocates them zeroed per call).
struct SplitLayout {
  int64_t chunks;      // ChunkSummary [B, K1, C]
  int64_t candidates;  // Candidate [B, K1, C, kSplitTopKMax]
  int64_t rows;        // RowResult [B, K1]
  int64_t resid;       // Best [B, C] (the residual pass)
  int64_t bytes;
  // int32 counters: per row [B, K1], then per sequence: rows merged [B], residual chunks
  // done [B], state [B] (kSeqDone, kSeqLegacy or kSeqPassBase + row)
  int64_t row_count, seq_count, resid_count, state, counters;
};

OSD_HD int64_t align16(int64_t x) { return (x + 15) / 16 * 16; }

OSD_HD SplitLayout split_layout(int64_t B, int64_t K1, int64_t V) {
  const int64_t C = chunk_count(V);
  SplitLayout l{};
  l.chunks = 0;
  l.candidates = align16(l.chunks + B * K1 * C * static_cast<int64_t>(sizeof(ChunkSummary)));
  l.rows = align16(l.candidates +
                   B * K1 * C * kSplitTopKMax * static_cast<int64_t>(sizeof(Candidate)));
  l.resid = align16(l.rows + B * K1 * static_cast<int64_t>(sizeof(RowResult)));
  l.bytes = align16(l.resid + B * C * static_cast<int64_t>(sizeof(Best)));
  l.row_count = 0;
  l.seq_count = B * K1;
  l.resid_count = l.seq_count + B;
  l.state = l.resid_count + B;
  l.counters = l.state + B;
  return l;
}

// Verifies a chain per sequence on `stream`: the split-vocabulary kernels when
// args.workspace is set (kernels/rejection_sample_split.cu), then the one-block-per-sequence
// kernel for the sequences they leave (kernels/rejection_sample.cu; every sequence when
// args.workspace is nullptr). args.out_tokens / num_accepted are written.
cudaError_t rejection_sample_cuda(const RejectionSampleArgs& args, cudaStream_t stream);

// The split-vocabulary kernels alone (first pass with the row merges and the walk, then the
// residual pass when draft_probs is given).
cudaError_t rejection_sample_split_cuda(const RejectionSampleArgs& args, cudaStream_t stream);

}  // namespace osd
