"""Tree attention (``tree_attention``): time and GB/s per provider.

Each row has a prefix of L cached keys and T tree queries under a random tree mask. GB/s
counts the K and V cache rows read once: ``2 * B * Hkv * (L + T) * D * bytes``.

Providers: ``reference`` (SDPA with a boolean mask) and ``cpp`` on CPU (float32);
``triton`` and ``flashinfer`` on GPU (bfloat16), skipped without one. ``flashinfer`` is
FlashInfer's paged prefill with the tree as a custom mask (``bench.flashinfer_providers``;
skipped, naming what is missing, without the ``flashinfer-python`` package or a GPU), its
plan made once outside the timed call. Every provider's output is checked against the
reference before it is timed.

GPU goal: at T = 64, L = 4096 the Triton tree kernel within 1.3x of a plain
decode attention (SDPA, one query per row, no mask) over L + 64 keys;
``test_gpu_goal_triton`` reports ``decode_ms`` and ``ratio`` (skipped without a GPU);
``test_gpu_goal_flashinfer`` reports the same for FlashInfer on the same case.

Default sweep: B in {1, 8}, T in {1, 8, 64}, L = 1024, Hq/Hkv = 8/2, D = 64.
``test_windowed_attention``: the sliding-window / soft-capped path beside the C++ kernel.
``OSD_BENCH_FULL=1``: L in {1024, 4096}, B in {1, 8, 32}.

``test_chat_shapes`` (CPU): the chat target's heads (9 / 3, D = 64), causal, batch 1: decode
and verify blocks (T = 1, 5, 9 over L = 300 and 1,000 cached keys) and prefills (T = 300,
1,000 over none), for the C++ kernel's AVX-512 path (``cpp``, where the CPU has it), its
AVX2 path (``cpp-avx2``: ``OSD_NO_AVX512``) and the SDPA reference, side by side.

Split KV (``test_split_kv_triton``, GPU only): the Triton path as dispatched (split KV when
``split_kv_num_splits`` asks for it) at B in {1, 8}, L in {4096, 16384, 32768}, T = 1
(causal decode) and T = 8 (tree verify), Llama-8B heads (32 / 8, D = 128), bf16. Reports
``splits``, ``tree_ms`` (the path as dispatched), ``single_ms`` (the single-pass kernel,
``num_splits=0``), ``roofline_frac`` (K/V bytes read / ``H200_HBM_BYTES_PER_S`` / time)
and, for T = 8, ``ratio`` to a T = 1 decode over the same prefix (goal 1.3).
``test_long_prefix_flashinfer``: FlashInfer on the same cases (``tree_ms``,
``roofline_frac``), beside it.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_tree_attention.py
"""

import timeit

import pytest
import torch
import torch.nn.functional as F

from bench.common import BACKENDS, FULL, gbps, provider_device
from bench.flashinfer_providers import FlashInferTreeAttention, flashinfer_device
from osd_kernels import (
    tree_attention,
    tree_attention_reference,
    tree_mask_from_parents,
    use_avx512,
)
from osd_kernels.triton.tree_attention import split_kv_num_splits, tree_attention_triton

BATCHES = (1, 8, 32) if FULL else (1, 8)
TREES = (1, 8, 64)
PREFIXES = (1024, 4096) if FULL else (1024,)
HQ, HKV, D = 8, 2, 64
PROVIDERS = ("reference", "cpp", "triton", "flashinfer")


def _case(B, T, L, Hq, Hkv, dim, dtype, device):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + L)
    S = L + T
    q = torch.randn(B, T, Hq, dim, generator=gen).to(dtype).to(device)
    kv = torch.randn(1, 2, B, Hkv, S, dim, generator=gen).to(dtype).to(device)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    parents = torch.stack(
        [torch.full((B,), -1)] + [torch.randint(0, i, (B,), generator=gen) for i in range(1, T)], 1
    )
    mask = tree_mask_from_parents(parents).to(device)
    return q, kv[0, 0], kv[0, 1], lens, mask


CASES = [(B, T, L, p) for p in PROVIDERS for L in PREFIXES for T in TREES for B in BATCHES]


@pytest.mark.parametrize("B,T,L,provider", CASES)
def test_tree_attention(benchmark, B, T, L, provider):
    fi = provider == "flashinfer"
    device, dtype = flashinfer_device() if fi else provider_device(provider)
    on_gpu = device == "cuda"
    q, k, v, lens, mask = _case(B, T, L, HQ, HKV, D, dtype, device)
    attend = FlashInferTreeAttention(q, k, v, lens, mask) if fi else None
    backend = BACKENDS.get(provider)

    def run():
        if fi:
            out = attend(q)
        else:
            out = tree_attention(q, k, v, lens, mask, max_kv_len=L + T, backend=backend)
        if on_gpu:
            torch.cuda.synchronize()
        return out

    want = tree_attention_reference(q.float(), k.float(), v.float(), lens, mask)
    torch.testing.assert_close(
        run().float(), want, rtol=2e-2 if on_gpu else 1e-4, atol=2e-2 if on_gpu else 1e-4
    )
    benchmark.pedantic(run, rounds=5 if provider == "reference" else 20, warmup_rounds=2)
    nbytes = 2 * B * HKV * (L + T) * D * k.element_size()
    benchmark.extra_info.update(
        provider=provider, B=B, T=T, L=L, Hq=HQ, Hkv=HKV, D=D, gbps=gbps(nbytes, benchmark)
    )


def _cuda_ms(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.parametrize("B", (1, 8))
def test_gpu_goal_triton(benchmark, B):
    """T = 64, L = 4096, Llama-8B heads (32 / 8, D = 128), against SDPA decode over L + 64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    T, L, Hq, Hkv, dim = 64, 4096, 32, 8, 128
    q, k, v, lens, mask = _case(B, T, L, Hq, Hkv, dim, torch.bfloat16, "cuda")
    want = tree_attention_reference(q.float(), k.float(), v.float(), lens, mask)
    got = tree_attention(q, k, v, lens, mask, backend="triton")
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    q1 = q[:, :1].transpose(1, 2)

    def decode():
        return F.scaled_dot_product_attention(
            q1, k[:B, :, : L + T], v[:B, :, : L + T], enable_gqa=True
        )

    def run():
        out = tree_attention(q, k, v, lens, mask, backend="triton")
        torch.cuda.synchronize()
        return out

    decode_ms = _cuda_ms(decode)
    tree_ms = _cuda_ms(lambda: tree_attention(q, k, v, lens, mask, backend="triton"))
    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    benchmark.extra_info.update(
        provider="triton",
        B=B,
        T=T,
        L=L,
        tree_ms=tree_ms,
        decode_ms=decode_ms,
        ratio=tree_ms / decode_ms,
        goal=1.3,
    )


@pytest.mark.parametrize("B", (1, 8))
def test_gpu_goal_flashinfer(benchmark, B):
    """``test_gpu_goal_triton``'s case (T = 64, L = 4096, 32 / 8 heads, D = 128) through
    FlashInfer's paged prefill with the tree as a custom mask, against the same decode."""
    flashinfer_device()
    T, L, Hq, Hkv, dim = 64, 4096, 32, 8, 128
    q, k, v, lens, mask = _case(B, T, L, Hq, Hkv, dim, torch.bfloat16, "cuda")
    attend = FlashInferTreeAttention(q, k, v, lens, mask)
    want = tree_attention_reference(q.float(), k.float(), v.float(), lens, mask)
    torch.testing.assert_close(attend(q).float(), want, rtol=2e-2, atol=2e-2)
    q1 = q[:, :1].transpose(1, 2)
    decode_ms = _cuda_ms(
        lambda: F.scaled_dot_product_attention(
            q1, k[:B, :, : L + T], v[:B, :, : L + T], enable_gqa=True
        )
    )
    tree_ms = _cuda_ms(lambda: attend(q))

    def run():
        out = attend(q)
        torch.cuda.synchronize()
        return out

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    benchmark.extra_info.update(
        provider="flashinfer",
        B=B,
        T=T,
        L=L,
        tree_ms=tree_ms,
        decode_ms=decode_ms,
        ratio=tree_ms / decode_ms,
    )


# Peak HBM bandwidth of an H200 (bytes/s): the roofline the split-KV times are judged against.
H200_HBM_BYTES_PER_S = 4.8e12
SPLIT_CASES = [(B, L, T) for B in (1, 8) for L in (4096, 16384, 32768) for T in (1, 8)]


def _gpu_cache(B, L, Hkv, dim, T_max=8):
    """bf16 K/V ``[B, Hkv, L + T_max, D]`` drawn on the GPU (CPU randn of 1 GB is slow),
    kept for the next case with the same (B, L)."""
    key = (B, L, Hkv, dim)
    if _gpu_cache.key != key:
        _gpu_cache.kv = None
        gen = torch.Generator("cuda").manual_seed(B * 7 + L)
        _gpu_cache.kv = torch.randn(
            2, B, Hkv, L + T_max, dim, generator=gen, device="cuda", dtype=torch.bfloat16
        )
        _gpu_cache.key = key
    return _gpu_cache.kv


_gpu_cache.key = None


@pytest.mark.parametrize("B,L,T", SPLIT_CASES)
def test_split_kv_triton(benchmark, B, L, T):
    """Split-KV decode (T = 1, causal) and verify (T = 8, tree) over long prefixes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    Hq, Hkv, dim = 32, 8, 128
    kv = _gpu_cache(B, L, Hkv, dim)
    k, v = kv[0], kv[1]
    gen = torch.Generator("cuda").manual_seed(T)
    q = torch.randn(B, T, Hq, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    mask = None
    if T > 1:
        parents = torch.stack(
            [torch.full((B,), -1)] + [torch.randint(0, i, (B,)) for i in range(1, T)], 1
        )
        mask = tree_mask_from_parents(parents).cuda()
    scale = dim**-0.5

    def call(queries=q, tree=mask, **kw):
        return tree_attention_triton(
            queries, k, v, lens, tree, scale, max_kv_len=L + queries.shape[1], **kw
        )

    want = tree_attention_reference(
        q.float(), k.float(), v.float(), lens, mask, scale=scale, max_kv_len=L + T
    )
    torch.testing.assert_close(call().float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(call(num_splits=0).float(), want, rtol=2e-2, atol=2e-2)
    del want

    def run():
        out = call()
        torch.cuda.synchronize()
        return out

    tree_ms = _cuda_ms(call)
    single_ms = _cuda_ms(lambda: call(num_splits=0))
    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    nbytes = 2 * B * Hkv * (L + T) * dim * k.element_size()
    roofline_ms = nbytes / H200_HBM_BYTES_PER_S * 1e3
    splits = split_kv_num_splits(
        B, Hkv, T, Hq // Hkv, L + T, torch.cuda.get_device_properties(0).multi_processor_count
    )
    info = dict(
        provider="triton",
        B=B,
        T=T,
        L=L,
        Hq=Hq,
        Hkv=Hkv,
        D=dim,
        splits=splits,
        tree_ms=tree_ms,
        single_ms=single_ms,
        roofline_frac=roofline_ms / tree_ms,
    )
    if T > 1:
        q1 = q[:, :1].contiguous()
        decode_ms = _cuda_ms(lambda: call(q1, None))
        info.update(decode_ms=decode_ms, ratio=tree_ms / decode_ms, goal=1.3)
    benchmark.extra_info.update(info)
    print(
        f"split-KV B={B} L={L} T={T}: {splits} splits, {tree_ms * 1e3:.1f} us "
        f"(single pass {single_ms * 1e3:.1f} us), {roofline_ms / tree_ms:.0%} of the "
        f"{H200_HBM_BYTES_PER_S / 1e12:.1f} TB/s roofline ({roofline_ms * 1e3:.1f} us)"
        + (f", {info['ratio']:.2f}x a T=1 decode" if T > 1 else "")
    )


@pytest.mark.parametrize("B,L,T", SPLIT_CASES)
def test_long_prefix_flashinfer(benchmark, B, L, T):
    """``test_split_kv_triton``'s cases through FlashInfer: causal decode (T = 1) and a
    tree verify (T = 8, custom mask) over the same cache, time and fraction of the
    roofline."""
    flashinfer_device()
    Hq, Hkv, dim = 32, 8, 128
    kv = _gpu_cache(B, L, Hkv, dim)
    k, v = kv[0], kv[1]
    gen = torch.Generator("cuda").manual_seed(T)
    q = torch.randn(B, T, Hq, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    mask = None
    if T > 1:
        parents = torch.stack(
            [torch.full((B,), -1)] + [torch.randint(0, i, (B,)) for i in range(1, T)], 1
        )
        mask = tree_mask_from_parents(parents).cuda()
    attend = FlashInferTreeAttention(q, k, v, lens, mask)
    want = tree_attention_reference(q.float(), k.float(), v.float(), lens, mask, max_kv_len=L + T)
    torch.testing.assert_close(attend(q).float(), want, rtol=2e-2, atol=2e-2)
    del want

    def run():
        out = attend(q)
        torch.cuda.synchronize()
        return out

    tree_ms = _cuda_ms(lambda: attend(q))
    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    roofline_ms = 2 * B * Hkv * (L + T) * dim * k.element_size() / H200_HBM_BYTES_PER_S * 1e3
    benchmark.extra_info.update(
        provider="flashinfer",
        B=B,
        T=T,
        L=L,
        Hq=Hq,
        Hkv=Hkv,
        D=dim,
        tree_ms=tree_ms,
        roofline_frac=roofline_ms / tree_ms,
    )


WINDOW_CASES = [(B, T, cap) for B in (1, 8) for T in (1, 8) for cap in (None, 50.0)]


CHAT_CASES = [
    (T, L, p)
    for T, L in ((1, 300), (5, 300), (9, 300), (1, 1000), (5, 1000), (9, 1000), (300, 0), (1000, 0))
    for p in ("cpp", "cpp-avx2", "reference")
]


@pytest.mark.parametrize("T,L,provider", CHAT_CASES)
def test_chat_shapes(benchmark, monkeypatch, T, L, provider):
    if provider == "cpp" and not use_avx512():
        pytest.skip("the CPU has no AVX-512 (the cpp-avx2 rows are the kernel here)")
    if provider == "cpp-avx2":
        monkeypatch.setenv("OSD_NO_AVX512", "1")
    gen = torch.Generator().manual_seed(T * 7 + L)
    q = torch.randn(1, T, 9, 64, generator=gen)
    k, v = torch.randn(2, 1, 3, L + T, 64, generator=gen)
    lens = torch.tensor([L], dtype=torch.int32)
    backend = "reference" if provider == "reference" else "native"

    def run():
        return tree_attention(q, k, v, lens, None, max_kv_len=L + T, backend=backend)

    torch.testing.assert_close(
        run(), tree_attention_reference(q, k, v, lens, None), rtol=1e-4, atol=1e-4
    )
    benchmark.pedantic(run, rounds=20, warmup_rounds=3, iterations=5 if T < 300 else 1)
    benchmark.extra_info.update(provider=provider, T=T, L=L, Hq=9, Hkv=3, D=64)


@pytest.mark.parametrize("B,T,softcap", WINDOW_CASES)
def test_windowed_attention(benchmark, B, T, softcap):
    """The sliding-window path (``osd.models.attention.windowed_attention``: SDPA with the
    window in its mask, or explicit scores when soft-capped) over L = 1024 cached keys and
    a 512-key window, CPU float32, beside the C++ tree kernel's full attention over the same
    keys; reports ``cpp_ms`` and ``ratio`` (best windowed time / best C++ time)."""
    # The engine package (osd) for this test alone: the rest of the file needs only osd_kernels.
    from osd.models.attention import windowed_attention

    L, window = 1024, 512
    q, k, v, lens, mask = _case(B, T, L, HQ, HKV, D, torch.float32, "cpu")
    scale = D**-0.5

    def run():
        return windowed_attention(
            q, k, v, lens, mask, None, scale=scale, max_kv_len=L + T, window=window, softcap=softcap
        )

    def cpp():
        return tree_attention(q, k, v, lens, mask, scale=scale, max_kv_len=L + T, backend="native")

    run()
    cpp_s = min(timeit.repeat(cpp, number=20, repeat=3)) / 20
    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    benchmark.extra_info.update(
        B=B,
        T=T,
        L=L,
        window=window,
        softcap=softcap,
        cpp_ms=cpp_s * 1e3,
        ratio=benchmark.stats.stats.min / cpp_s,
    )
