"""The target's top-k distribution per row (``topk_probs``): time per call per provider.

Online learning keeps the target's top-32 at every verified position, on the serving
thread after each step, so this is serving time. Rows come from a pool of 64 x 7 rows
(the verify logits of a step are written just before, but a row is read once), one
torch thread, as the serving thread runs it beside a learner.

Providers: ``reference`` (softmax then ``torch.topk``) and ``cpp`` on CPU (float32); on
CUDA the op is the reference's two device ops. Each provider's ids and probabilities are
checked against the reference first.

Default sweep: V in {49,152 (SmolLM2), 262,144 (Gemma 3)}, rows in {1, 4}, k = 32.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_topk_probs.py
"""

import pytest
import torch

from bench.common import provider_device
from osd_kernels import topk_probs, topk_probs_reference

VOCABS = (49152, 262144)
ROWS = (1, 4)
PROVIDERS = ("reference", "cpp")
K = 32


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_topk_probs(benchmark, provider, V, rows):
    provider_device(provider)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pool = torch.randn(64, 7, V, generator=torch.Generator().manual_seed(V)) * 4
        fn = topk_probs_reference if provider == "reference" else topk_probs
        ids, probs = fn(pool[0, :rows], K)
        want = topk_probs_reference(pool[0, :rows], K)
        assert torch.equal(ids, want[0])
        torch.testing.assert_close(probs, want[1], rtol=2e-6, atol=1e-9)
        step = iter(range(10**9))
        benchmark(lambda: fn(pool[next(step) % 64, :rows], K))
    finally:
        torch.set_num_threads(threads)
    benchmark.extra_info.update(provider=provider, V=V, rows=rows, k=K)
