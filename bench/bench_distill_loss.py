"""Distillation loss (``distill_loss``): forward + backward time and peak memory per provider.

Each round computes the loss and the gradient w.r.t. the draft logits ``[N, V]``.
``peak_mb`` is the peak of the tensor memory the round allocated (inputs excluded),
tracked through a ``TorchDispatchMode``; it includes the gradient (``grad_mb``) and, for
the fused providers, autograd's copy of it into ``.grad`` (the saved gradient is still
referenced when it is accumulated).

Providers: ``autograd`` (``distill_loss_reference`` + ``backward``, several fp32 ``[N, V]``
temporaries), ``chunked`` (the fused op's ``reference`` backend: autograd on row chunks),
``cpp`` on CPU (float32 draft); ``triton`` on GPU (bfloat16 draft), skipped without one.
Each provider's loss and gradient are checked against ``autograd`` before timing.

Default sweep: N = 256, V = 32000, losses fkl and jsd, full and top-20 targets.
``OSD_BENCH_FULL=1``: N in {256, 1024}, V in {32000, 128256}, all four losses.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_distill_loss.py
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.common import FULL, provider_device
from osd_kernels import distill_loss, distill_loss_reference

ROWS = (256, 1024) if FULL else (256,)
VOCABS = (32000, 128256) if FULL else (32000,)
LOSSES = ("fkl", "rkl", "jsd", "tvd") if FULL else ("fkl", "jsd")
FORMS = ("full", "top20")
PROVIDERS = ("autograd", "chunked", "cpp", "triton")


class _PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode (inputs' storages excluded).

    Every op output whose storage is new is counted until that storage is freed; kernel
    scratch that is not a tensor (the C++ kernel's per-thread row buffers of V floats)
    is not.
    """

    def __init__(self, existing):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live, self.current, self.peak = {}, 0, 0

    def _free(self, key):
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.known and key not in self.live:
                self.live[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out


def _case(N, V, form, dtype, device):
    gen = torch.Generator().manual_seed(N + V)
    draft = (3 * torch.randn(N, V, generator=gen)).to(dtype).to(device)
    target_logits = (3 * torch.randn(N, V, generator=gen)).to(device)
    if form == "full":
        return draft, target_logits
    probs, ids = torch.softmax(target_logits.float(), -1).topk(20, -1)
    return draft, (ids, probs)


CASES = [
    (N, V, loss, form, p)
    for p in PROVIDERS
    for V in VOCABS
    for N in ROWS
    for loss in LOSSES
    for form in FORMS
]


@pytest.mark.parametrize("N,V,loss,form,provider", CASES)
def test_distill_loss(benchmark, N, V, loss, form, provider):
    device, dtype = provider_device(provider)
    draft, target = _case(N, V, form, dtype, device)
    backend = {"chunked": "reference", "cpp": "native", "triton": "triton"}.get(provider)

    def run():
        z = draft.detach().requires_grad_(True)
        if provider == "autograd":
            out = distill_loss_reference(z, target, loss=loss, beta=0.5)
        else:
            out = distill_loss(z, target, loss=loss, beta=0.5, backend=backend)
        out.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return out.detach(), z.grad

    z = draft.float().detach().requires_grad_(True)
    want = distill_loss_reference(z, target, loss=loss, beta=0.5)
    want.backward()
    got_loss, got_grad = run()
    torch.testing.assert_close(got_loss.float(), want.detach(), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), z.grad, rtol=2e-2, atol=1e-6)
    del got_grad, z
    inputs = [draft] + ([target] if torch.is_tensor(target) else list(target))
    with _PeakTensorBytes(inputs) as mode:
        run()
    benchmark.pedantic(
        run, rounds=3 if provider in ("autograd", "chunked") else 10, warmup_rounds=1
    )
    benchmark.extra_info.update(
        provider=provider,
        N=N,
        V=V,
        loss=loss,
        target=form,
        grad_mb=N * V * draft.element_size() / 2**20,
        peak_mb=mode.peak / 2**20,
    )
