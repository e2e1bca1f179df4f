"""The greedy sampler and the logits check (``argmax_finite``): time per call per provider.

Every greedy step takes the argmax of the target's logits and every step checks them for
NaN and inf, on the serving thread: this is serving time. Shapes are a step's logits:
``[B, T, V]`` for a batch of ``B`` rows verifying ``T`` positions, from a pool of 16
(written just before in a real step, but read once), on the torch threads the bench runs
with (``OSD_BENCH_THREADS``, default 2, as serving on the 2-core VM).

Providers: ``reference`` (``torch.argmax`` and ``isfinite(...).all``) and ``cpp`` on CPU
(float32); on CUDA the op is the reference's device ops. Each provider's results are
checked against the reference first.

Default sweep: V in {49,152 (SmolLM2), 262,144 (Gemma 3)}, (B, T) in {(1, 1), (1, 5),
(8, 1), (8, 5)}.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_argmax_finite.py
"""

import os

import pytest
import torch

from bench.common import provider_device
from osd_kernels import argmax_finite, argmax_finite_reference

VOCABS = (49152, 262144)
SHAPES = ((1, 1), (1, 5), (8, 1), (8, 5))
PROVIDERS = ("reference", "cpp")


@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}xT{t}" for b, t in SHAPES])
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_argmax_finite(benchmark, provider, V, shape):
    provider_device(provider)
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OSD_BENCH_THREADS", "2")))
    try:
        B, T = shape
        pool = torch.randn(16, B, T, V, generator=torch.Generator().manual_seed(V)) * 4
        fn = argmax_finite_reference if provider == "reference" else argmax_finite
        got, want = fn(pool[0]), argmax_finite_reference(pool[0])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        step = iter(range(10**9))
        benchmark(lambda: fn(pool[next(step) % 16]))
    finally:
        torch.set_num_threads(threads)
    benchmark.extra_info.update(provider=provider, V=V, B=shape[0], T=shape[1])
