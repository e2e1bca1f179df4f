// The split-vocabulary chain sampler on the CPU (kernels/chunk_stats.h): the row
// statistics come from per-chunk records merged by the functions the CUDA kernels use.
// Defined in cpu/rejection_sample_split.cpp.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/chunk_stats.h"
#include "kernels/rejection_sample.h"

namespace osd {

// Per-thread scratch, sized on first use for a vocabulary: a row of raw logits (float32
// rows with a contiguous vocabulary are read in place), the chunk-relative exponentials
// of a plain row, chunk-sized buffers, the chunk records, a top-k chunk's short list and
// a top-k row's candidates and kept items.
struct SplitScratch {
  int64_t vocab = -1;
  std::vector<float> l, e, p, d, u;
  std::vector<uint32_t> keys, short_keys, tail_t0, chunk_kth, merge_keys;
  std::vector<int32_t> short_list;
  std::vector<ChunkSummary> chunks;
  std::vector<Candidate> cand;
  std::vector<KeptItem> items;
  void ensure(int64_t V);
};

// Samples sequence b by the split-vocabulary path and writes its outputs; returns false,
// writing nothing, when the sequence must take the one-row path instead (split_mode
// kLegacy, or a top-k tail the chunk records cannot resolve).
bool rejection_sample_split_sequence(const RejectionSampleArgs& a, int64_t b, SplitScratch& w);

}  // namespace osd
