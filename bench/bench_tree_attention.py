"""Tree attention (``tree_attention``): time and GB/s per provider.

Each row has a prefix of L cached keys and T tree queries under a random tree mask. GB/s
counts the K and V cache rows read once: ``2 * B * Hkv * (L + T) * D * bytes``.

Providers: ``reference`` (SDPA with a boolean mask) and ``cpp`` on CPU (float32);
``triton`` on GPU (bfloat16), skipped without one. Every provider's output is checked
against the reference before it is timed.

GPU goal (issue 3): at T = 64, L = 4096 the Triton tree kernel within 1.3x of a plain
decode attention (SDPA, one query per row, no mask) over L + 64 keys;
``test_gpu_goal_triton`` reports ``decode_ms`` and ``ratio`` (skipped without a GPU).

Default sweep: B in {1, 8}, T in {1, 8, 64}, L = 1024, Hq/Hkv = 8/2, D = 64.
``OSD_BENCH_FULL=1``: L in {1024, 4096}, B in {1, 8, 32}.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_tree_attention.py
"""
import pytest
import torch
import torch.nn.functional as F

from bench.common import BACKENDS, FULL, gbps, provider_device
from osd_kernels import tree_attention, tree_attention_reference, tree_mask_from_parents

BATCHES = (1, 8, 32) if FULL else (1, 8)
TREES = (1, 8, 64)
PREFIXES = (1024, 4096) if FULL else (1024,)
HQ, HKV, D = 8, 2, 64
PROVIDERS = ("reference", "cpp", "triton")


def _case(B, T, L, Hq, Hkv, dim, dtype, device):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + L)
    S = L + T
    q = torch.randn(B, T, Hq, dim, generator=gen).to(dtype).to(device)
    kv = torch.randn(1, 2, B, Hkv, S, dim, generator=gen).to(dtype).to(device)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    parents = torch.stack([torch.full((B,), -1)] + [torch.randint(0, i, (B,), generator=gen)
                                                    for i in range(1, T)], 1)
    mask = tree_mask_from_parents(parents).to(device)
    return q, kv[0, 0], kv[0, 1], lens, mask


CASES = [(B, T, L, p) for p in PROVIDERS for L in PREFIXES for T in TREES for B in BATCHES]


@pytest.mark.parametrize("B,T,L,provider", CASES)
def test_tree_attention(benchmark, B, T, L, provider):
    device, dtype = provider_device(provider)
    on_gpu = device == "cuda"
    q, k, v, lens, mask = _case(B, T, L, HQ, HKV, D, dtype, device)
    backend = BACKENDS[provider]

    def run():
        out = tree_attention(q, k, v, lens, mask, max_kv_len=L + T, backend=backend)
        if on_gpu:
            torch.cuda.synchronize()
        return out

    want = tree_attention_reference(q.float(), k.float(), v.float(), lens, mask)
    torch.testing.assert_close(run().float(), want, rtol=2e-2 if on_gpu else 1e-4,
                               atol=2e-2 if on_gpu else 1e-4)
    benchmark.pedantic(run, rounds=5 if provider == "reference" else 20, warmup_rounds=2)
    nbytes = 2 * B * HKV * (L + T) * D * k.element_size()
    benchmark.extra_info.update(provider=provider, B=B, T=T, L=L, Hq=HQ, Hkv=HKV, D=D,
                                gbps=gbps(nbytes, benchmark))


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
        return F.scaled_dot_product_attention(q1, k[:B, :, :L + T], v[:B, :, :L + T],
                                              enable_gqa=True)

    def run():
        out = tree_attention(q, k, v, lens, mask, backend="triton")
        torch.cuda.synchronize()
        return out

    decode_ms = _cuda_ms(decode)
    tree_ms = _cuda_ms(lambda: tree_attention(q, k, v, lens, mask, backend="triton"))
    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    benchmark.extra_info.update(provider="triton", B=B, T=T, L=L, tree_ms=tree_ms,
                                decode_ms=decode_ms, ratio=tree_ms / decode_ms, goal=1.3)
