"""``kv_rollback``: in-place KV-cache compaction after tree verification.

After a verify forward, node ``i`` of sequence ``b``'s token tree sits in the cache at
slot ``cache_lens[b] + i``. Once the accepted root-to-leaf path is known, its nodes'
K/V must become the consecutive positions ``cache_lens[b] .. cache_lens[b] + keep - 1``,
for every layer, and the sequence length must advance. A chain is the special case
``accepted_slots[b] = [0, 1, ..., keep - 1]``: nothing moves, only the length changes
(use :func:`chain_rollback`, which is only that length update).

Cache layout: ``kv_cache`` is one tensor ``[L, 2, B_max, H, S, D]`` (layers, K/V, rows,
KV heads, capacity, head dim) and ``cache_lens`` is ``[B_max]`` int32 on the same device.
Both are mutated in place; nothing is allocated, so the op is safe in CUDA graphs.
"""

from __future__ import annotations

import torch

from osd_kernels._ops import native_available, resolve_backend


def _check(
    kv_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_slots: torch.Tensor,
    num_keep: torch.Tensor,
) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [L, 2, B_max, H, S, D], got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"kv_cache must be float32, float16 or bfloat16, got {kv_cache.dtype}")
    if cache_lens.dtype != torch.int32 or cache_lens.shape != (kv_cache.shape[2],):
        raise ValueError(
            f"cache_lens must be int32 [B_max={kv_cache.shape[2]}], got "
            f"{cache_lens.dtype} {tuple(cache_lens.shape)}"
        )
    if accepted_slots.dtype != torch.int64 or accepted_slots.dim() != 2:
        raise ValueError(
            f"accepted_slots must be int64 [B, N], got {accepted_slots.dtype} "
            f"{tuple(accepted_slots.shape)}"
        )
    batch = accepted_slots.shape[0]
    if batch > kv_cache.shape[2]:
        raise ValueError(f"accepted_slots has {batch} rows but the cache holds {kv_cache.shape[2]}")
    if num_keep.dtype != torch.int32 or num_keep.shape != (batch,):
        raise ValueError(
            f"num_keep must be int32 [B={batch}], got {num_keep.dtype} {tuple(num_keep.shape)}"
        )
    for name, t in (
        ("cache_lens", cache_lens),
        ("accepted_slots", accepted_slots),
        ("num_keep", num_keep),
    ):
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")


def kv_rollback_reference(
    kv_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_slots: torch.Tensor,
    num_keep: torch.Tensor,
) -> None:
    """Gather-then-scatter reference: correct for any slot order, allocates a copy."""
    for b in range(accepted_slots.shape[0]):
        n = int(num_keep[b])
        if n <= 0:
            continue
        base = int(cache_lens[b])
        src = base + accepted_slots[b, :n].to(torch.long)
        rows = kv_cache[:, :, b].index_select(3, src).clone()  # [L, 2, H, n, D]
        kv_cache[:, :, b, :, base : base + n] = rows
        cache_lens[b] += n


def kv_rollback(
    kv_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_slots: torch.Tensor,
    num_keep: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Compact each sequence's accepted tree slots in place and advance its length.

    Args:
        kv_cache: ``[L, 2, B_max, H, S, D]`` float32/float16/bfloat16, last dim contiguous.
            Mutated.
        cache_lens: ``[B_max]`` int32, committed length per row. Rows ``< B`` advance by
            ``num_keep``. Mutated.
        accepted_slots: ``[B, N]`` int64. Row ``b`` holds the accepted path's node indices
            (relative to ``cache_lens[b]``), strictly increasing; entries past
            ``num_keep[b]`` are ignored (pad with -1).
        num_keep: ``[B]`` int32, how many nodes of each row to keep (0 leaves the row as is).
        backend: ``auto`` | ``reference`` | ``native`` | ``triton``.

    Example:
        >>> # node 0 (root) and nodes 2, 5 accepted: move slots 2->1 and 5->2
        >>> kv_rollback(kv, lens, torch.tensor([[0, 2, 5]]), torch.tensor([3], dtype=torch.int32))
    """
    _check(kv_cache, cache_lens, accepted_slots, num_keep)
    impl = resolve_backend(backend, kv_cache.device)
    if impl == "reference":
        kv_rollback_reference(kv_cache, cache_lens, accepted_slots, num_keep)
    elif impl == "triton":
        # imported on first use so that `import osd_kernels` does not import triton
        from osd_kernels.triton.kv_rollback import kv_rollback_triton

        kv_rollback_triton(kv_cache, cache_lens, accepted_slots, num_keep)
    else:
        torch.ops.osd.kv_rollback(kv_cache, cache_lens, accepted_slots, num_keep)


def chain_rollback(cache_lens: torch.Tensor, num_keep: torch.Tensor) -> None:
    """Chain rollback: the accepted K/V are already in place, only the lengths advance.

    ``cache_lens[:B] += num_keep`` on the device, no host sync.
    """
    cache_lens[: num_keep.shape[0]] += num_keep.to(cache_lens.dtype)


if native_available():

    @torch.library.register_fake("osd::kv_rollback")
    def _kv_rollback_fake(kv_cache, cache_lens, accepted_slots, num_keep):
        return None
