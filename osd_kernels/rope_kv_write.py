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

The native kernel (``csrc/cpu/fused_layer_ops.cpp``, float32 CPU) rounds as the reference
does (``x * cos``, then one fused multiply-add, as ATen's ``addcmul``): its queries and
cache entries equal the reference's bit for bit. :func:`rope_kv_write_qkv` is the same op
on the qkv projection as it comes out of a GEMV, ``[B, T, (Hq + 2 Hkv) D]`` or its ``B T``
rows, so that a cached forward needs no views to split it (the fused CPU layers).

Backends: ``reference`` (PyTorch), ``native`` (the C++ kernel; float32 CPU tensors only),
``triton`` (on CPU tensors under ``TRITON_INTERPRET=1``); ``auto`` is Triton on CUDA, the
native kernel for float32 CPU tensors, and the reference otherwise (the op has no
backward: the cache write is not differentiable).
"""

from __future__ import annotations

import torch

from osd_kernels._ops import native_available, resolve_backend

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
    kv.permute(1, 3, 0, 2, 4).index_put_((rows, slots), torch.stack((k, v), dim=2).to(kv.dtype))
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
    half_kv = q.dtype == torch.float32 and kv.dtype == torch.float16
    if (
        q.dtype not in DTYPES
        or {k.dtype, v.dtype} != {q.dtype}
        or (kv.dtype != q.dtype and not half_kv)
    ):
        raise TypeError(
            f"q, k, v and kv must share one of {DTYPES} (or kv be float16 under float32 q), "
            f"got {q.dtype}, {k.dtype}, {v.dtype}, {kv.dtype}"
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
        kv: ``[2, B_max, Hkv, S, D]``, one layer of the cache, last dim contiguous, in
            the dtype of ``q`` or float16 under float32 ``q`` (``k``, ``v`` then rounded
            to nearest as they are written, as ``Tensor.half()`` rounds). Mutated.
        slots: ``[B, T]`` int64 cache slots, ``0 <= slots < S``, distinct within a row.
        backend: ``auto`` | ``reference`` | ``native`` | ``triton``.

    Returns:
        The rotated queries ``[B, T, Hq, D]`` (a new contiguous tensor from the kernels; the
        reference returns ``q`` itself when there is no RoPE).
    """
    _check(q, k, v, cos, sin, kv, slots)
    impl = resolve_backend(backend, q.device)
    if impl == "native" and _native_ok(q, kv, backend, "rope_kv_write"):
        # the kernel reads rows with a contiguous last dim (views of a projection are)
        q, k, v, cos, sin = (
            t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, cos, sin)
        )
        return torch.ops.osd.rope_kv_write(q, k, v, cos, sin, kv, slots)
    if impl != "triton":
        return rope_kv_write_reference(q, k, v, cos, sin, kv, slots)
    # imported on first use so that `import osd_kernels` does not import triton
    from osd_kernels.triton.rope_kv_write import rope_kv_write_triton

    return rope_kv_write_triton(q, k, v, cos, sin, kv, slots)


def _native_ok(x: torch.Tensor, kv: torch.Tensor, backend: str, name: str) -> bool:
    """Whether the C++ kernel takes these tensors (float32 CPU, a cache whose last dim is
    contiguous); an explicit ``native`` that it does not take is an error."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and kv.stride(-1) == 1:
        return True
    if backend == "native":
        raise ValueError(
            f"the native {name} kernel takes float32 CPU tensors and a cache with a "
            f"contiguous last dim, got {x.dtype} on {x.device}, kv strides {kv.stride()}"
        )
    return False


def rope_kv_write_qkv(
    qkv: torch.Tensor,
    num_heads: int,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    kv: torch.Tensor,
    slots: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`rope_kv_write` on the qkv projection: ``q``, ``k`` and ``v`` are its first
    ``num_heads`` heads, the next ``Hkv`` and the last ``Hkv`` (``Hkv`` and ``D`` those of
    ``kv``, ``B`` and ``T`` those of ``slots``).

    Args:
        qkv: ``[B, T, (Hq + 2 Hkv) D]``, or ``[B * T, (Hq + 2 Hkv) D]`` with row ``b T + t``
            token ``t`` of row ``b``; float32/float16/bfloat16.
        num_heads: ``Hq``.
        cos, sin, kv, slots, backend: as :func:`rope_kv_write`.

    Returns:
        The rotated queries ``[B, T, Hq, D]``.
    """
    if kv.dim() != 5 or slots.dim() != 2 or qkv.dim() not in (2, 3):
        raise ValueError(
            f"qkv must be [B, T, W] or [B * T, W], kv [2, B_max, Hkv, S, D] and slots "
            f"[B, T], got {tuple(qkv.shape)}, {tuple(kv.shape)}, {tuple(slots.shape)}"
        )
    (B, T), Hkv, D = slots.shape, kv.shape[2], kv.shape[4]
    width = (num_heads + 2 * Hkv) * D
    if qkv.shape[-1] != width or qkv.numel() != B * T * width or num_heads <= 0:
        raise ValueError(
            f"qkv must hold B * T = {B * T} rows of (Hq + 2 Hkv) D = {width} with Hq = "
            f"{num_heads}, got {tuple(qkv.shape)}"
        )
    impl = resolve_backend(backend, qkv.device)
    if impl == "native" and _native_ok(qkv, kv, backend, "rope_kv_write_qkv"):
        _check_tables(qkv, cos, sin, kv, slots, B, T, D)
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        cos, sin = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
        return torch.ops.osd.rope_kv_write_qkv(qkv, num_heads, cos, sin, kv, slots)
    heads = qkv.reshape(B, T, num_heads + 2 * Hkv, D)
    q, k, v = heads.split((num_heads, Hkv, Hkv), dim=2)
    return rope_kv_write(q, k, v, cos, sin, kv, slots, backend=backend)


def _check_tables(qkv, cos, sin, kv, slots, B, T, D) -> None:
    """:func:`_check`'s tests of everything but the query, key and value views."""
    heads = qkv.new_empty(()).expand(B, T, kv.shape[2], D)  # stands in for q, k and v
    _check(heads, heads, heads, cos, sin, kv, slots)


if native_available():

    @torch.library.register_fake("osd::rope_kv_write")
    def _rope_kv_write_fake(q, k, v, cos, sin, kv, slots):
        return q.new_empty(q.shape)

    @torch.library.register_fake("osd::rope_kv_write_qkv")
    def _rope_kv_write_qkv_fake(qkv, num_heads, cos, sin, kv, slots):
        return qkv.new_empty((slots.shape[0], slots.shape[1], num_heads, kv.shape[4]))
