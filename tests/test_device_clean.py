"""Every PyTorch reference creates its tensors on the device of its inputs.

A reference that builds a tensor without ``device=`` (``torch.as_tensor(0)``,
``torch.arange(n)``) gets the default device, the CPU: on CUDA inputs it then mixes devices
(``Expected all tensors to be on the same device``). On a CPU-only machine the default
device and the inputs' device coincide, so ordinary tests cannot see it. Here the
references run on CPU inputs under :class:`DefaultDeviceElsewhere`, which sends every
factory call whose device would come from the default to the 'meta' device instead, and
fails on the first op that returns a tensor off the inputs' device, naming it.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten

from osd_kernels import philox
from osd_kernels.decode_linear import decode_linear, decode_linear_reference
from osd_kernels.distill_loss import (
    distill_loss,
    distill_loss_fwd_bwd_reference,
    distill_loss_reference,
)
from osd_kernels.kv_rollback import chain_rollback, kv_rollback, kv_rollback_reference
from osd_kernels.rejection_sample import rejection_sample, rejection_sample_reference
from osd_kernels.tree_attention import (
    causal_tree_mask,
    tree_attention,
    tree_attention_reference,
    tree_mask_from_parents,
)
from osd_kernels.tree_rejection_sample import (
    tree_depths,
    tree_rejection_sample,
    tree_rejection_sample_reference,
)
from osd_kernels.warp import warp_probs

# Factories that take their device from their data when it is a tensor.
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)


class DefaultDeviceElsewhere(TorchFunctionMode):
    """Factory calls without ``device=`` (and not copying a tensor) create 'meta' tensors,
    as they would create CPU tensors next to CUDA inputs; any op returning a tensor that is
    not on ``expected`` raises at once."""

    def __init__(self, expected="cpu"):
        super().__init__()
        self.expected = torch.device(expected)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _device_constructors() and kwargs.get("device") is None:
            data = args[0] if args else kwargs.get("data")
            if not (func in _FROM_DATA and torch.is_tensor(data)):
                kwargs["device"] = "meta"
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device != self.expected:
                name = getattr(func, "__qualname__", repr(func))
                name = name.replace("_VariableFunctionsClass", "torch")
                raise AssertionError(
                    f"{name} returned a tensor on {t.device}; the inputs are "
                    f"on {self.expected} (a tensor created without device=?)"
                )
        return out


def _run_clean(fn, *args, **kwargs):
    with DefaultDeviceElsewhere("cpu"):
        out = fn(*args, **kwargs)
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            assert t.device.type == "cpu"
    return out


def test_mode_catches_a_tensor_created_without_device():
    x = torch.arange(4)
    with pytest.raises(AssertionError, match="meta"):
        _run_clean(lambda: x + torch.as_tensor(0, dtype=torch.int64))
    with pytest.raises(AssertionError, match="meta"):
        _run_clean(lambda: x + torch.arange(4))
    # the pattern philox_uniform once had: a Python index made a tensor on the default device
    with pytest.raises(AssertionError, match="meta"):
        _run_clean(
            lambda: philox.philox4x32_10(torch.as_tensor(0, dtype=torch.int64) >> 2, x, 0, 0, x, x)
        )
    # tensors that follow their inputs pass, and so do explicit devices
    _run_clean(lambda: torch.as_tensor(x, dtype=torch.float32) + torch.full_like(x, 2))
    _run_clean(lambda: torch.arange(4, device=x.device) + torch.zeros((), device="cpu"))


def test_philox():
    seed = torch.tensor([3, -7], dtype=torch.int64)
    offset = torch.tensor([0, 2**40], dtype=torch.int64)
    _run_clean(philox.philox_uniform, seed[:, None], offset[:, None], 5, 0)
    _run_clean(philox.philox_uniform, 11, offset[:, None], torch.arange(3)[None], 1)
    _run_clean(philox.philox_uniform_rows, seed, offset, 9, 10)
    _run_clean(philox.philox_uniform_rows, seed, 0, torch.tensor([1, 3]), 7)
    _run_clean(philox.philox4x32_10, torch.arange(4), 1, 2, 3, 4, 5)


def test_warp_probs():
    logits = torch.randn(3, 17)
    _run_clean(warp_probs, logits)
    _run_clean(warp_probs, logits, 0.7, 5, 0.9)
    _run_clean(
        warp_probs,
        logits,
        torch.tensor([0.5, 1.0, 0.0]),
        torch.tensor([0, 3, 20], dtype=torch.int32),
        torch.tensor([1.0, 0.8, 0.5]),
    )


def _chain_case(gen, B=3, K=4, V=23):
    logits = torch.randn(B, K + 1, V, generator=gen) * 2
    q = torch.softmax(torch.randn(B, K, V, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(B, K)
    kw = dict(
        temperature=torch.tensor([0.0, 0.8, 1.2]),
        top_k=torch.tensor([0, 5, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 0.7]),
        seed=torch.tensor([1, 2, 3]),
        offset=torch.tensor([0, 5, 9]),
        num_draft_tokens=torch.tensor([4, 2, 3], dtype=torch.int32),
    )
    return logits, drafts, q, kw


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sample(with_q):
    gen = torch.Generator().manual_seed(0)
    logits, drafts, q, kw = _chain_case(gen)
    q = q if with_q else None
    _run_clean(rejection_sample_reference, logits, drafts, q, **kw)
    _run_clean(
        rejection_sample_reference,
        logits,
        drafts,
        q,
        temperature=0.9,
        top_k=4,
        top_p=0.95,
        generator=torch.Generator().manual_seed(1),
    )
    _run_clean(rejection_sample, logits, drafts, q, backend="reference", **kw)


@pytest.mark.parametrize(
    "with_q,without_replacement", [(True, False), (True, True), (False, False)]
)
def test_tree_rejection_sample(with_q, without_replacement):
    gen = torch.Generator().manual_seed(0)
    B, T, V = 3, 6, 19
    parents = torch.tensor(
        [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, -1, 3]], dtype=torch.int32
    )
    logits = torch.randn(B, T, V, generator=gen) * 2
    q = torch.softmax(torch.randn(B, T, V, generator=gen), -1) if with_q else None
    tokens = torch.randint(0, V, (B, T), generator=gen)
    tokens[:, 1] = logits[:, 0].argmax(-1)  # some greedy acceptances
    kw = dict(
        temperature=torch.tensor([0.0, 0.9, 1.1]),
        top_k=torch.tensor([0, 6, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 0.8]),
        seed=torch.tensor([4, 5, 6]),
        offset=torch.tensor([1, 2, 3]),
        without_replacement=without_replacement,
    )
    _run_clean(tree_depths, parents)
    _run_clean(tree_rejection_sample_reference, logits, tokens, parents, q, **kw)
    _run_clean(
        tree_rejection_sample_reference,
        logits,
        tokens,
        parents,
        q,
        temperature=0.8,
        generator=torch.Generator().manual_seed(2),
        max_depth=2,
    )
    _run_clean(tree_rejection_sample, logits, tokens, parents, q, backend="reference", **kw)


def test_kv_rollback():
    L, B, H, S, D = 2, 3, 2, 12, 4
    kv = torch.randn(L, 2, B, H, S, D)
    lens = torch.tensor([2, 0, 5], dtype=torch.int32)
    slots = torch.tensor([[0, 2, 3], [0, 1, -1], [0, 3, -1]])
    keep = torch.tensor([3, 2, 2], dtype=torch.int32)
    _run_clean(kv_rollback_reference, kv, lens, slots, keep)
    _run_clean(kv_rollback, kv, lens, slots, keep, backend="reference")
    _run_clean(chain_rollback, lens, keep)


@pytest.mark.parametrize("loss", ["fkl", "rkl", "jsd", "tvd"])
def test_distill_loss(loss):
    gen = torch.Generator().manual_seed(0)
    N, V, k = 5, 29, 4
    z = torch.randn(N, V, generator=gen, requires_grad=True)
    t = torch.randn(N, V, generator=gen)
    probs, ids = torch.softmax(t, -1).topk(k, -1)
    mask = torch.tensor([True, False, True, True, False])
    _run_clean(distill_loss_reference, z, t, loss=loss, beta=0.3, mask=mask).backward()
    _run_clean(distill_loss_reference, z, (ids, probs), loss=loss)
    _run_clean(distill_loss_fwd_bwd_reference, z.detach(), t, None, None, mask, loss, 0.3, 2)
    _run_clean(distill_loss_fwd_bwd_reference, z.detach(), None, ids, probs, None, loss, 0.3, 3)
    _run_clean(distill_loss, z, (ids, probs), loss=loss, mask=mask, backend="reference").backward()


def test_decode_linear():
    x = torch.randn(2, 3, 16)
    w = torch.randn(8, 16)
    _run_clean(decode_linear_reference, x, w, torch.randn(8), norm_weight=torch.rand(16))
    _run_clean(decode_linear, x, w, None, backend="reference")


@pytest.mark.parametrize("masked", [True, False])
def test_tree_attention(masked):
    B, T, Hq, Hkv, S, D = 2, 3, 4, 2, 16, 8
    q = torch.randn(B, T, Hq, D)
    k = torch.randn(B, Hkv, S, D)
    v = torch.randn(B, Hkv, S, D)
    lens = torch.tensor([5, 2], dtype=torch.int32)
    mask = None
    if masked:
        mask = _run_clean(tree_mask_from_parents, torch.tensor([[-1, 0, 0], [-1, 0, 1]]))
    _run_clean(causal_tree_mask, B, T, device="cpu")
    _run_clean(tree_attention_reference, q, k, v, lens, mask)
    _run_clean(tree_attention_reference, q, k, v, lens, mask, scale=0.3, max_kv_len=9)
    _run_clean(tree_attention, q, k, v, lens, mask, backend="reference")
