"""Distillation loss (``distill_loss``): forward + backward time and peak memory per provider.

Each round computes the loss and the gradient w.r.t. the draft logits ``[N, V]``. Peak
memory is the extra memory the round needed above what existed before it (inputs
excluded): on CUDA from ``torch.cuda.max_memory_allocated``; on Linux CPUs from the
process's peak resident set (``/proc/self/status`` VmHWM, reset through
``/proc/self/clear_refs``); elsewhere it is not reported. The gradient itself is
``N * V * bytes`` of it.

Providers: ``autograd`` (``distill_loss_reference`` + ``backward``, several fp32 ``[N, V]``
temporaries), ``chunked`` (the fused op's ``reference`` backend: autograd on row chunks),
``cpp`` on CPU (float32 draft); ``triton`` on GPU (bfloat16 draft), skipped without one.
Each provider's loss and gradient are checked against ``autograd`` before timing.

Default sweep: N = 256, V = 32000, losses fkl and jsd, full and top-20 targets.
``OSD_BENCH_FULL=1``: N in {256, 1024}, V in {32000, 128256}, all four losses.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_distill_loss.py
"""
import os

import pytest
import torch

from osd_kernels import distill_loss, distill_loss_reference
from osd_kernels._ops import native_available

FULL = os.environ.get("OSD_BENCH_FULL", "0") == "1"
ROWS = (256, 1024) if FULL else (256,)
VOCABS = (32000, 128256) if FULL else (32000,)
LOSSES = ("fkl", "rkl", "jsd", "tvd") if FULL else ("fkl", "jsd")
FORMS = ("full", "top20")
PROVIDERS = ("autograd", "chunked", "cpp", "triton")


def _peak_cpu_supported() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_extra_bytes(fn, device: str):
    """Memory ``fn`` needed above the memory in use before it, or None if unmeasurable."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    if not _peak_cpu_supported():
        return None
    before = _rss_kb("VmRSS")
    fn()
    return max(_rss_kb("VmHWM") - before, 0) * 1024


def _case(N, V, form, dtype, device):
    gen = torch.Generator().manual_seed(N + V)
    draft = (3 * torch.randn(N, V, generator=gen)).to(dtype).to(device)
    target_logits = (3 * torch.randn(N, V, generator=gen)).to(device)
    if form == "full":
        return draft, target_logits
    probs, ids = torch.softmax(target_logits.float(), -1).topk(20, -1)
    return draft, (ids, probs)


CASES = [(N, V, loss, form, p) for p in PROVIDERS for V in VOCABS for N in ROWS
         for loss in LOSSES for form in FORMS]


@pytest.mark.parametrize("N,V,loss,form,provider", CASES)
def test_distill_loss(benchmark, N, V, loss, form, provider):
    on_gpu = provider == "triton"
    if on_gpu and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if provider == "cpp" and not native_available():
        pytest.skip("osd_kernels._C is not built")
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    draft, target = _case(N, V, form, dtype, device)
    backend = {"chunked": "reference", "cpp": "native", "triton": "triton"}.get(provider)

    def run():
        z = draft.detach().requires_grad_(True)
        if provider == "autograd":
            out = distill_loss_reference(z, target, loss=loss, beta=0.5)
        else:
            out = distill_loss(z, target, loss=loss, beta=0.5, backend=backend)
        out.backward()
        if on_gpu:
            torch.cuda.synchronize()
        return out.detach(), z.grad

    z = draft.float().detach().requires_grad_(True)
    want = distill_loss_reference(z, target, loss=loss, beta=0.5)
    want.backward()
    got_loss, got_grad = run()
    torch.testing.assert_close(got_loss.float(), want.detach(), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), z.grad, rtol=2e-2, atol=1e-6)
    del got_grad, z
    peak = _peak_extra_bytes(run, device)
    benchmark.pedantic(run, rounds=3 if provider in ("autograd", "chunked") else 10,
                       warmup_rounds=1)
    benchmark.extra_info.update(provider=provider, N=N, V=V, loss=loss, target=form,
                                grad_mb=N * V * draft.element_size() / 2**20,
                                peak_extra_mb=None if peak is None else peak / 2**20)
