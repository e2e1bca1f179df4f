"""``KVCache``: the static, preallocated key/value cache of one model (docs/design.md).

- ``kv``: ``[L, 2, B_max, H_kv, S, D]`` (layer, K/V, row, KV head, capacity, head dim).
- ``lens``: ``[B_max]`` int32 **on the device**, the committed length of each row.
- ``bound``: a host-side upper bound of ``max(lens)`` over the rows in use, so a forward
  can size its key range without a host sync. Every commit raises it by the largest
  possible advance; a caller that knows the exact lengths may lower it (``set_bound``).

A forward of ``T`` tokens writes their K/V at ``lens[b] + i`` and never changes ``lens``;
the caller then commits with :meth:`KVCache.commit` (prefill, decode, chain verify: a
length update) or :meth:`KVCache.commit_tree` (tree verify: in-place compaction).
The active batch is always rows ``0 .. B-1``; :meth:`KVCache.move_row` fills the hole
left by a finished sequence.
"""

from __future__ import annotations

import torch

from osd_kernels import chain_rollback, kv_rollback


class KVCache:
    """Preallocated K/V for ``max_batch_size`` rows of up to ``max_seq_len`` tokens.

    Args:
        num_layers, num_kv_heads, head_dim: of the model.
        max_batch_size: rows ``B_max``.
        max_seq_len: capacity ``S`` per row.
        dtype, device: of the K/V (the model's).
        context: the longest sequence the owner serves (default: the capacity, which may
            hold a few more slots for speculative headroom); models whose RoPE depends on
            the context length (LongRoPE) read it as :attr:`context`.
    """

    def __init__(
        self,
        num_layers: int,
        max_batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        context: int | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("max_batch_size", max_batch_size),
            ("num_kv_heads", num_kv_heads),
            ("max_seq_len", max_seq_len),
            ("head_dim", head_dim),
        ):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.kv = torch.zeros(
            num_layers,
            2,
            max_batch_size,
            num_kv_heads,
            max_seq_len,
            head_dim,
            dtype=dtype,
            device=device,
        )
        self.lens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self.bound = 0
        self.context = int(max_seq_len if context is None else context)

    @classmethod
    def for_model(
        cls,
        config,
        max_batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        context: int | None = None,
    ) -> "KVCache":
        """A cache shaped for a model with ``config`` (an ``osd.models.ModelConfig``)."""
        return cls(
            config.num_layers,
            max_batch_size,
            config.num_kv_heads,
            max_seq_len,
            config.head_dim,
            dtype=dtype,
            device=device,
            context=context,
        )

    @property
    def max_batch_size(self) -> int:
        return self.kv.shape[2]

    @property
    def capacity(self) -> int:
        """Slots per row, ``S``."""
        return self.kv.shape[4]

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K, V)`` of layer ``index``, each ``[B_max, H_kv, S, D]``."""
        return self.kv[index, 0], self.kv[index, 1]

    def reset(self) -> None:
        """Empty every row (lengths to zero; the K/V memory is left as is)."""
        self.lens.zero_()
        self.bound = 0

    def set_bound(self, bound: int) -> None:
        """Set the host-side upper bound of ``max(lens)`` (a caller that knows the lengths)."""
        if not 0 <= bound <= self.capacity:
            raise ValueError(f"bound {bound} outside [0, {self.capacity}]")
        self.bound = int(bound)

    def commit(self, num_new: torch.Tensor, max_new: int) -> None:
        """Chain commit: ``lens[:B] += num_new`` on the device, no host sync.

        Args:
            num_new: ``[B]`` int32 on the cache's device, tokens to keep per row.
            max_new: host-side upper bound of ``num_new`` (raises :attr:`bound`).
        """
        chain_rollback(self.lens, num_new)
        self.bound = min(self.bound + int(max_new), self.capacity)

    def commit_tree(
        self, accepted_slots: torch.Tensor, num_keep: torch.Tensor, max_keep: int
    ) -> None:
        """Tree commit: move each row's accepted tree slots to ``lens[b] ..`` and advance.

        Args:
            accepted_slots: ``[B, N]`` int64, accepted node indices relative to ``lens[b]``,
                increasing, padded with -1 (see ``osd_kernels.kv_rollback``).
            num_keep: ``[B]`` int32, nodes kept per row.
            max_keep: host-side upper bound of ``num_keep``.
        """
        kv_rollback(self.kv, self.lens, accepted_slots, num_keep)
        self.bound = min(self.bound + int(max_keep), self.capacity)

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` (K/V up to :attr:`bound` and its length) into row ``dst``.

        Used to keep the active rows contiguous: when row ``dst`` finishes, the last active
        row moves into it. On the device, no host sync.
        """
        if src == dst:
            return
        n = self.bound
        self.kv[:, :, dst, :, :n].copy_(self.kv[:, :, src, :, :n])
        self.lens[dst].copy_(self.lens[src])

    def rows(self, start: int, count: int) -> "KVCache":
        """A cache over rows ``[start, start + count)`` that shares this one's storage.

        Its rows are numbered from 0 and it inherits this cache's :attr:`bound`. It serves
        to prefill new sequences into free rows (``rows(b, n).reset()`` empties just those)
        while the other rows keep their state; the caller raises this cache's bound
        afterwards (``set_bound``).
        """
        if start < 0 or count < 1 or start + count > self.max_batch_size:
            raise ValueError(f"rows [{start}, {start + count}) outside [0, {self.max_batch_size})")
        view = KVCache.__new__(KVCache)
        view.kv = self.kv[:, :, start : start + count]
        view.lens = self.lens[start : start + count]
        view.bound = self.bound
        view.context = self.context
        return view
