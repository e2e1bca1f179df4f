"""``rope_kv_write``: RoPE on the queries and keys of a cached forward, and the write of
the rotated keys and the values into the KV cache, in one pass.

A cached forward of ``T`` tokens per row projects ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv,
D]``, rotates ``q`` and ``k`` by the RoPE tables at each token's position and writes ``k``
and ``v`` at ``[row b, slot slots[b, t]]`` of the layer's cache. Unfused that is a few
elementwise kernels for the rotation, a stack and an ``index_put``; the fused kernel reads
each head once and writes the rotated query and the cache entries.

RoPE (half-split, as ``osd.models.llama.apply_rope``): ``cos, sin [B, T, R]`` are the
tables ``[c, c]`` and ``[-s, s]`` already taken at each token's position (a tree token's
position is its depth past the row's length, not its slot), ``R <= D`` even; the leading
``R`` dims of a head rotate, ``x * cos + roll(x, R / 2) * sin``, and the rest pass through
(partial rotary). ``cos = sin = None``: no rotation (a layer without RoPE).

Cache layout: ``kv`` is one layer of ``osd.cache.KVCache.kv``, ``[2, B_max, Hkv, S, D]``
(K/V, row, KV head, slot, head dim); rows ``0 .. B - 1`` are written, each token at its
own slot (slots distinct within a row).

Rounding: ``x * cos`` is rounded to the dtype before the sum, as the reference rounds it;
the rest is summed in float32 and rounded once (the reference's ``addcmul``).
Values are copied exactly.

Backends: ``reference`` (PyTorch, product code: the CPU path), ``triton`` (on CPU tensors
under ``TRITON_INTERPRET=1``); ``auto`` is Triton on CUDA and the reference elsewhere. This
op has no native kernel.
"""

from __future__ import annotations

import torch

from osd_kernels._ops import resolve_backend

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, T, H, D]`` rotated by ``cos, sin [B, T, 1, R]``; dims past ``R`` unchanged."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    return torch.addcmul(x * cos, x.roll(rot // 2, dims=-1), sin)


def rope_kv_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    kv: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write ``k, v`` at ``kv[:, b, :, slots[b, t]]``; returns the
    rotated ``q`` (``q`` itself without RoPE)."""
    if cos is not None:
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        q, k = _rope(q, c, s), _rope(k, c, s)
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    # a [B_max, S, 2, Hkv, D] view of the cache, indexed by (row, slot)
    kv.permute(1, 3, 0, 2, 4).index_put_((rows, slots), torch.stack((k, v), dim=2))
    return q


def _check(q, k, v, cos, sin, kv, slots) -> None:
    if (
        q.dim() != 4
        or k.dim() != 4
        or v.shape != k.shape
        or q.shape[:2] != k.shape[:2]
        or q.shape[3] != k.shape[3]
    ):
        raise ValueError(
            f"q must be [B, T, Hq, D] and k, v [B, T, Hkv, D], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, T, _, D = q.shape
    Hkv = k.shape[2]
    if (
        kv.dim() != 5
        or kv.shape[0] != 2
        or kv.shape[1] < B
        or kv.shape[2] != Hkv
        or kv.shape[4] != D
    ):
        raise ValueError(
            f"kv must be [2, B_max >= {B}, Hkv={Hkv}, S, D={D}], got {tuple(kv.shape)}"
        )
    if q.dtype not in DTYPES or {k.dtype, v.dtype, kv.dtype} != {q.dtype}:
        raise TypeError(
            f"q, k, v and kv must share one of {DTYPES}, got {q.dtype}, {k.dtype}, "
            f"{v.dtype}, {kv.dtype}"
        )
    if slots.dtype != torch.int64 or slots.shape != (B, T):
        raise ValueError(
            f"slots must be int64 [B={B}, T={T}], got {slots.dtype} {tuple(slots.shape)}"
        )
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin are both given or both None")
    if cos is not None:
        R = cos.shape[-1]
        if cos.shape != (B, T, R) or sin.shape != cos.shape or R % 2 or not 0 < R <= D:
            raise ValueError(
                f"cos and sin must be [B={B}, T={T}, R] with R even, "
                f"0 < R <= {D}, got {tuple(cos.shape)}, {tuple(sin.shape)}"
            )
        if cos.dtype != q.dtype or sin.dtype != q.dtype:
            raise TypeError(f"cos and sin must be {q.dtype}, got {cos.dtype}, {sin.dtype}")
    tensors = [t for t in (q, k, v, cos, sin, kv, slots) if t is not None]
    if len({t.device for t in tensors}) > 1:
        raise ValueError("q, k, v, cos, sin, kv and slots must be on one device")


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    kv: torch.Tensor,
    slots: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """RoPE on ``q`` and ``k``; ``k`` and ``v`` written into ``kv`` at ``[b, slots[b, t]]``.

    Args:
        q: ``[B, T, Hq, D]`` float32/float16/bfloat16, any strides (views of one
            projection are fine).
        k, v: ``[B, T, Hkv, D]``, same dtype.
        cos, sin: ``[B, T, R]`` RoPE tables at each token's position (``R`` even,
            ``<= D``), or both None for a layer without RoPE.
        kv: ``[2, B_max, Hkv, S, D]``, one layer of the cache, last dim contiguous. Mutated.
        slots: ``[B, T]`` int64 cache slots, ``0 <= slots < S``, distinct within a row.
        backend: ``auto`` | ``reference`` | ``triton``.

    Returns:
        The rotated queries ``[B, T, Hq, D]`` (a new tensor from Triton; the reference
        returns ``q`` itself when there is no RoPE).
    """
    if backend == "native":
        raise ValueError("rope_kv_write has no native kernel (backends: auto, reference, triton)")
    _check(q, k, v, cos, sin, kv, slots)
    if resolve_backend(backend, q.device) != "triton":
        return rope_kv_write_reference(q, k, v, cos, sin, kv, slots)
    # imported on first use so that `import osd_kernels` does not import triton
    from osd_kernels.triton.rope_kv_write import rope_kv_write_triton

    return rope_kv_write_triton(q, k, v, cos, sin, kv, slots)
