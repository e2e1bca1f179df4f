// tree_attention: argument checks and the C++ CPU kernel.
//
// Semantics (osd_kernels/tree_attention.py): query t of row b sees the prefix keys
// [0, lens[b]) unmasked and the tree key lens[b] + t' iff bit t' of tree_mask[b, t] is set
// (T <= 64). Without a mask it is causal for any T: key lens[b] + t' is seen iff t' <= t.
// GQA: query head h reads KV head h / (Hq / Hkv).
//
// One task per (row b, KV head, block of the G * T query rows that share that KV head;
// G = Hq / Hkv), or, for calls of at most kSplitRows such rows (decode, verify), per (row b,
// KV head, range of the row's keys). The task streams its keys in blocks of kKeyBlock:
// each block is converted to fp32 once (read in place for fp32 caches) and scored against
// all rows of the task, and every row keeps an online softmax (running max m, sum l, fp32
// accumulator):
//   m' = max(m, max_j s_j);  l' = l * e^(m - m') + sum_j e^(s_j - m');
//   acc' = acc * e^(m - m') + sum_j e^(s_j - m') v_j;  out = acc / l.
// Prefix blocks need no mask. With a tree mask, one last block (the T <= 64 tree keys)
// tests the bitmask; causal, the new keys lens[b] + [0, t_last] (t_last: the task's last
// query) follow in blocks of kKeyBlock that test t' <= t, so a task reads no key past its
// own diagonal.
// Scores, the softmax (max, exp, sum) and P.V use AVX-512 intrinsics (head dims that are a
// multiple of 16) or AVX2/FMA ones when the CPU has them (chosen at run time), else
// portable loops; each block's keys are prefetched while the block before is scored. On
// the AVX-512 path, calls of at least kLaneRows rows per KV head keep a task's rows in
// vector lanes (attention_avx512.h), decode goes one row at a time.
// Decode and short verify calls split each row's prefix into ranges of key blocks
// (split_keys), one task per (row, KV head, split), and merge the splits' softmax states
// afterwards; larger calls split the query rows into tasks (pick_row_block). Either way
// batch 1 with few KV heads keeps every thread busy.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "checks.h"
#include "cpu/attention_rows.h"
#include "cpu/fast_math.h"
#include "cpu/tree_attention_task.h"  // kKeyBlock, TreeAttentionArgs, Scratch, run_task, ...

namespace osd {
namespace {

constexpr int64_t kRowBlock = 32;  // query rows per task of larger calls (at most)
// Decode and short verify calls (at most kSplitRows query rows per KV head) split each
// row's prefix into up to kMaxSplits ranges of whole key blocks, one task each, so that a
// batch of one row with few KV heads still spreads evenly over the threads. Calls with
// more rows per KV head split the rows instead (pick_row_block), which measured faster
// from 27 rows on.
constexpr int64_t kSplitRows = 16;
// Calls with at least kLaneRows query rows per KV head (verify blocks, prefill) keep a
// task's rows in vector lanes on the AVX-512 path (attention_avx512.h); decode's few rows
// per KV head would leave most lanes empty and go one row at a time.
constexpr int64_t kLaneRows = 8;
// Fewest keys per split of a lanes call: each task transposes its queries and its split is
// merged afterwards, which a single key block does not pay for.
constexpr int64_t kLaneSplitKeys = 192;

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_* values, which its
// (maybe-)uninitialized warnings report in the task loops below, which inline them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

template <typename scalar_t>
void run_tasks_base(const TreeAttentionArgs& a, int64_t begin, int64_t end, Scratch& w) {
  for (int64_t task = begin; task < end; ++task) run_task<scalar_t, kPortable>(a, task, w);
}

#if defined(__x86_64__)
template <typename scalar_t>
OSD_AVX2 void run_tasks_avx2(const TreeAttentionArgs& a, int64_t begin, int64_t end,
                             Scratch& w) {
  for (int64_t task = begin; task < end; ++task) run_task<scalar_t, kAvx2>(a, task, w);
}

template <typename scalar_t>
OSD_AVX512 void run_tasks_avx512(const TreeAttentionArgs& a, int64_t begin, int64_t end,
                                 Scratch& w) {
  if (a.lanes) {
    for (int64_t task = begin; task < end; ++task) run_task<scalar_t, kAvx512Lanes>(a, task, w);
  } else {
    for (int64_t task = begin; task < end; ++task) run_task<scalar_t, kAvx512>(a, task, w);
  }
}
#endif
#if defined(__x86_64__)
#pragma GCC diagnostic pop
#endif

template <typename scalar_t>
void tree_attention_cpu_kernel(const TreeAttentionArgs& a, int64_t num_tasks) {
  const int isa = use_avx512() && a.head_dim % 16 == 0 ? kAvx512
                  : use_avx2_fma()                     ? kAvx2
                                                       : kPortable;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch w(a.row_block, a.head_dim);
#if defined(__x86_64__)
    if (isa == kAvx512) {
      run_tasks_avx512<scalar_t>(a, begin, end, w);
      return;
    }
    if (isa == kAvx2) {
      run_tasks_avx2<scalar_t>(a, begin, end, w);
      return;
    }
#endif
    (void)isa;
    run_tasks_base<scalar_t>(a, begin, end, w);
  });
  if (a.task_start == nullptr || a.part == nullptr) return;
  // The rows with split keys: one merge per (row, KV head) that has more than one split;
  // a few thousand multiply-adds (a batch of one) cost less than waking the threads.
  const int64_t grain = std::max<int64_t>(
      1, (int64_t{1} << 16) / ((a.task_start[a.batch] / a.hkv / a.batch + 1) * a.row_block *
                               a.head_dim));
  at::parallel_for(0, a.batch * a.hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(a.head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / a.hkv;
      if (a.task_start[b + 1] - a.task_start[b] > a.hkv) merge_splits<scalar_t>(a, b, i % a.hkv, acc);
    }
  });
}

// Query rows per task for `heads` (row, KV head) pairs of `rows` query rows each, on
// `threads` threads. at::parallel_for hands each thread ceil(tasks / threads) consecutive
// tasks; a task costs its rows plus kTaskCost for reading its keys and values. Few heads
// (batch 1: the KV heads alone) would leave threads idle or uneven with whole heads per
// task, so the block that minimises the busiest thread's cost is chosen (the largest on
// ties); with many heads every split is even enough and whole heads (up to kRowBlock rows)
// read each key once.
int64_t pick_row_block(int64_t heads, int64_t rows, int64_t threads) {
  constexpr int64_t kTaskCost = 2;
  const int64_t largest = std::min(kRowBlock, rows);
  if (heads >= 4 * threads || largest <= 1) return std::max<int64_t>(largest, 1);
  int64_t best = largest, best_cost = std::numeric_limits<int64_t>::max();
  for (int64_t block = largest; block >= 1; --block) {
    const int64_t blocks = (rows + block - 1) / block;
    const int64_t tasks = heads * blocks;
    const int64_t chunk = (tasks + std::min(threads, tasks) - 1) / std::min(threads, tasks);
    int64_t busiest = 0;
    for (int64_t t0 = 0; t0 < tasks; t0 += chunk) {
      int64_t cost = 0;
      for (int64_t t = t0; t < std::min(t0 + chunk, tasks); ++t) {
        cost += std::min(block, rows - (t % blocks) * block) + kTaskCost;
      }
      busiest = std::max(busiest, cost);
    }
    if (busiest < best_cost) {
      best = block;
      best_cost = busiest;
    }
  }
  return best;
}

at::Tensor tree_attention_cpu_op(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& cache_lens,
                                 const std::optional<at::Tensor>& tree_mask, double scale) {
  OSD_CHECK(q.device().is_cpu(), "tree_attention CPU kernel got a ", q.device(), " tensor");
  OSD_CHECK(q.dim() == 4, "q must be [B, T, Hq, D], got ", q.sizes());
  OSD_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
            "k_cache and v_cache must both be [B_max, Hkv, S, D], got ", k_cache.sizes(),
            " and ", v_cache.sizes());
  to_dtype(q, "q");
  // A float16 cache under float32 queries: a CPU engine's half cache (the K/V widened as
  // they are read).
  const bool half_kv = q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kHalf &&
                       v_cache.scalar_type() == at::kHalf;
  OSD_CHECK(half_kv || (k_cache.scalar_type() == q.scalar_type() &&
                        v_cache.scalar_type() == q.scalar_type()),
            "k_cache/v_cache dtype must match q (", q.scalar_type(),
            "), or be float16 with float32 q; got ", k_cache.scalar_type(), "/",
            v_cache.scalar_type());
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t B_max = k_cache.size(0), Hkv = k_cache.size(1), S = k_cache.size(2);
  OSD_CHECK(k_cache.size(3) == D, "head dim of q (", D, ") and of the cache (", k_cache.size(3),
            ") differ");
  OSD_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads (", Hq, ") must be a multiple of KV heads (",
            Hkv, ")");
  OSD_CHECK(B <= B_max, "q has ", B, " rows but the cache holds only ", B_max);
  check_dtype(cache_lens, at::kInt, "cache_lens");
  OSD_CHECK(cache_lens.dim() == 1 && cache_lens.size(0) == B_max && cache_lens.is_contiguous(),
            "cache_lens must be contiguous [B_max=", B_max, "], got ", cache_lens.sizes());
  check_same_device(q, k_cache, "q", "k_cache");
  check_same_device(q, v_cache, "q", "v_cache");
  check_same_device(q, cache_lens, "q", "cache_lens");
  TreeAttentionArgs a{};
  a.tree_mask = nullptr;
  if (tree_mask.has_value()) {
    const at::Tensor& tm = *tree_mask;
    check_dtype(tm, at::kLong, "tree_mask");
    OSD_CHECK(T <= kKeyBlock, "T=", T, " queries per row exceeds the bitmask limit 64 of a "
              "tree_mask (causal calls take any T)");
    OSD_CHECK(tm.dim() == 2 && tm.size(0) == B && tm.size(1) == T, "tree_mask must be [B=", B,
              ", T=", T, "], got ", tm.sizes());
    check_same_device(q, tm, "q", "tree_mask");
    a.tree_mask = tm.data_ptr<int64_t>();
    a.mask_stride_b = tm.stride(0);
    a.mask_stride_t = tm.stride(1);
  }
  const int32_t* lens = cache_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    OSD_CHECK(lens[b] >= 0 && lens[b] + T <= S, "cache_lens[", b, "]=", lens[b], " plus T=", T,
              " keys do not fit the cache capacity ", S);
  }
  at::Tensor out = at::empty({B, T, Hq, D}, q.options());
  if (out.numel() == 0) return out;
  const bool rows_path =
#if defined(__x86_64__)
      q.scalar_type() == at::kFloat && D % 16 == 0 && D <= 16 * attention_rows::kMaxChunks &&
      use_avx512() && q.stride(3) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1;
#else
      false;
#endif
  if (half_kv && !rows_path) {
    // Only the AVX-512 path reads a half cache as it goes: elsewhere the keys the call
    // sees are widened to float32 first.
    int64_t need = 0;
    for (int64_t b = 0; b < B; ++b) need = std::max<int64_t>(need, lens[b] + T);
    const at::Tensor k32 = k_cache.narrow(0, 0, B).narrow(2, 0, need).to(at::kFloat);
    const at::Tensor v32 = v_cache.narrow(0, 0, B).narrow(2, 0, need).to(at::kFloat);
    return tree_attention_cpu_op(q, k32, v32, cache_lens.narrow(0, 0, B), tree_mask, scale);
  }
  a.q = q.data_ptr();
  a.k = k_cache.data_ptr();
  a.v = v_cache.data_ptr();
  a.out = out.data_ptr();
  a.lens = lens;
  a.batch = B;
  a.num_q = T;
  a.hq = Hq;
  a.hkv = Hkv;
  a.head_dim = D;
  for (int i = 0; i < 4; ++i) {
    a.q_stride[i] = q.stride(i);
    a.k_stride[i] = k_cache.stride(i);
    a.v_stride[i] = v_cache.stride(i);
  }
  a.scale = static_cast<float>(scale);
  a.half_kv = half_kv;
#if defined(__x86_64__)
  // Float32 on AVX-512: the row-invariant path (attention_rows.h), so that a query's
  // result never depends on the call's other queries, nor on how a prompt was cut into
  // prefill pieces.
  if (rows_path) {
    attention_rows::run(a);
    return out;
  }
#endif
  const int64_t rows = (Hq / Hkv) * T;
  a.lanes = rows >= kLaneRows;
  a.split_min = a.lanes ? kLaneSplitKeys : kKeyBlock;
  std::vector<int64_t> task_start;
  at::Tensor part;
  int64_t num_tasks;
  if (rows <= kSplitRows) {
    // Decode and short verify: every query row of a KV head in one task per key split.
    a.row_block = rows;
    task_start.assign(B + 1, 0);
    for (int64_t b = 0; b < B; ++b) {
      task_start[b + 1] = task_start[b] + Hkv * (lens[b] / split_keys(lens[b], a.split_min) + 1);
    }
    num_tasks = task_start[B];
    a.task_start = task_start.data();
    if (num_tasks > B * Hkv) {
      part = at::empty({num_tasks * rows * (D + kPartExtra)}, q.options().dtype(at::kFloat));
      a.part = part.data_ptr<float>();
    }
  } else {
    // Longer verify blocks and prefill: blocks of rows, the whole prefix in each.
    a.row_block = pick_row_block(B * Hkv, rows, at::get_num_threads());
    num_tasks = B * Hkv * ((rows + a.row_block - 1) / a.row_block);
  }
  switch (q.scalar_type()) {
    case at::kFloat: tree_attention_cpu_kernel<float>(a, num_tasks); break;
    case at::kHalf: tree_attention_cpu_kernel<c10::Half>(a, num_tasks); break;
    default: tree_attention_cpu_kernel<c10::BFloat16>(a, num_tasks); break;
  }
  return out;
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("tree_attention", &osd::tree_attention_cpu_op); }
