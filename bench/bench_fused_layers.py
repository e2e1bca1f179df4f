"""The fused decode-layer ops against the unfused PyTorch ops they replace, on a 1.1B
Llama layer (hidden 2048, MLP 5632, 32 query and 4 KV heads of 64), bfloat16, CUDA.

Cases (``rows`` = tokens in the forward: 1 = decode at batch 1, 8 = the most
``decode_gemv`` serves in the models, 64 = batch 64 where the elementwise ops apply):

- ``qkv``: ``F.rms_norm`` + ``F.linear`` against ``decode_gemv`` with the norm prologue;
- ``wo``, ``down``: ``F.linear`` + the residual add against ``decode_gemv`` with the
  residual epilogue;
- ``gate_up``: ``F.rms_norm`` + ``F.linear`` + SiLU x up against ``decode_gemv`` gated;
- ``add_rms_norm``, ``silu_mul``, ``rope_kv_write``: the references (PyTorch ops on CUDA)
  against the Triton kernels.

Providers: ``torch-cuda`` (the unfused ops) and ``triton`` (the fused kernel), both
skipped without a CUDA device. Each round is ``CALLS`` calls then one synchronisation;
``extra_info`` has ``us_per_call`` and ``gbps`` (the weight, or the activations, read and
written once per call, over the median round). The two providers' outputs are checked to
agree first (bfloat16: within 2^-5 of the largest output).

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_fused_layers.py
"""

import pytest
import torch
import torch.nn.functional as F

from bench.common import FULL
from osd_kernels import (
    add_rms_norm,
    add_rms_norm_reference,
    decode_gemv,
    rope_kv_write,
    rope_kv_write_reference,
    silu_mul,
    silu_mul_reference,
)

HIDDEN, INTER, HQ, HKV, D, S = 2048, 5632, 32, 4, 64, 2048
GEMVS = ("qkv", "wo", "gate_up", "down")
CASES = GEMVS + ("add_rms_norm", "silu_mul", "rope_kv_write")
ROWS = (1, 2, 4, 8, 64) if FULL else (1, 8, 64)
CALLS = 100


def _case(name: str, rows: int, device: str, dtype=torch.bfloat16):
    """``(unfused, fused, bytes)``: two callables computing the same output, and the bytes
    one call must move at least."""
    gen = torch.Generator().manual_seed(rows)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)

    x, res = randn(rows, HIDDEN), randn(rows, HIDDEN, scale=3.0)
    norm = randn(HIDDEN, scale=0.1) + 1
    if name in GEMVS:
        n, k = {
            "qkv": ((HQ + 2 * HKV) * D, HIDDEN),
            "wo": (HIDDEN, HQ * D),
            "gate_up": (2 * INTER, HIDDEN),
            "down": (HIDDEN, INTER),
        }[name]
        w = randn(n, k, scale=k**-0.5)
        inp = randn(rows, k)
        nbytes = w.numel() * w.element_size()
        if name == "qkv":
            return (
                lambda: F.linear(F.rms_norm(inp, (k,), norm, 1e-5), w),
                lambda: decode_gemv(inp, w, norm_weight=norm, eps=1e-5, backend="triton"),
                nbytes,
            )
        if name == "gate_up":
            return (
                lambda: silu_mul_reference(F.linear(F.rms_norm(inp, (k,), norm, 1e-5), w)),
                lambda: decode_gemv(
                    inp, w, norm_weight=norm, eps=1e-5, gated=True, backend="triton"
                ),
                nbytes,
            )
        return (
            lambda: res + F.linear(inp, w),
            lambda: decode_gemv(inp, w, residual=res, backend="triton"),
            nbytes,
        )
    if name == "add_rms_norm":
        return (
            lambda: add_rms_norm_reference(x, res, norm, 1e-5)[1],
            lambda: add_rms_norm(x, res, norm, 1e-5, backend="triton")[1],
            4 * x.numel() * x.element_size(),
        )
    if name == "silu_mul":
        gu = randn(rows, 2 * INTER)
        return (
            lambda: silu_mul_reference(gu),
            lambda: silu_mul(gu, backend="triton"),
            3 * gu.numel() // 2 * gu.element_size(),
        )
    qkv = randn(rows, 1, HQ + 2 * HKV, D)
    q, k, v = qkv[:, :, :HQ], qkv[:, :, HQ : HQ + HKV], qkv[:, :, HQ + HKV :]
    angles = torch.rand(rows, 1, D // 2, generator=gen) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype).to(device)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype).to(device)
    kv = randn(2, rows, HKV, S, D)
    slots = torch.full((rows, 1), S // 2, dtype=torch.int64, device=device)
    return (
        lambda: rope_kv_write_reference(q, k, v, cos, sin, kv, slots),
        lambda: rope_kv_write(q, k, v, cos, sin, kv, slots, backend="triton"),
        2 * qkv.numel() * qkv.element_size(),
    )


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("provider", ["torch-cuda", "triton"])
def test_fused_layer_op(benchmark, provider, case, rows):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if case in GEMVS and rows > 8:
        pytest.skip("decode_gemv serves at most 8 rows in the models")
    unfused, fused, nbytes = _case(case, rows, "cuda")
    want, got = unfused(), fused()
    assert (got.float() - want.float()).abs().max() <= 2**-5 * want.float().abs().max()
    fn = fused if provider == "triton" else unfused

    def run():
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    info = dict(provider=provider, case=case, rows=rows)
    if benchmark.stats is not None:
        median = benchmark.stats.stats.median / CALLS
        info.update(us_per_call=median * 1e6, gbps=nbytes / median / 1e9)
    benchmark.extra_info.update(info)
