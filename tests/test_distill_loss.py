"""distill_loss: the reference against closed forms, the top-k approximation's exactness and
lower-bound properties, every backend's loss and gradient against autograd of the reference
(every loss, beta in {0, 0.1, 0.5, 0.9, 1}, full and top-k targets, masks including
all-masked), dtypes, strided inputs, what the fused op keeps for backward, and opcheck.
"""

import zlib

import pytest
import torch
import torch.nn.functional as F

from osd_kernels import distill_loss, distill_loss_reference
from osd_kernels.distill_loss import bucket_logprobs, divergence_rows
from tests.conftest import backends_for

# The Triton kernels compute both sides of tl.where; under the interpreter numpy warns about
# the NaN (e.g. 0 * -inf) in the side that is thrown away.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

LOSS_BETAS = [("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5)] + [
    ("jsd", b) for b in (0.0, 0.1, 0.5, 0.9, 1.0)
]
BACKENDS = ["reference", "native", "triton"]


def _logits(gen, N, V, scale=3.0, dtype=torch.float32):
    return (scale * torch.randn(N, V, generator=gen)).to(dtype)


def _topk_target(gen, N, V, k, mass=0.9):
    """Distinct random ids and probabilities summing to ``mass`` per row (one row sums to 1)."""
    ids = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(N)])
    probs = torch.softmax(2 * torch.randn(N, k, generator=gen), -1) * mass
    probs[0] = probs[0] / probs[0].sum()  # a row with no leftover mass
    return ids, probs


def _target(gen, form, N, V, device):
    if form == "full":
        return _logits(gen, N, V).to(device)
    ids, probs = _topk_target(gen, N, V, 7)
    return ids.to(device), probs.to(device)


def _grads(draft, target, backend, **kw):
    z = draft.clone().requires_grad_(True)
    if backend == "autograd":
        loss = distill_loss_reference(z, target, **kw)
    else:
        loss = distill_loss(z, target, backend=backend, chunk_size=4, **kw)
    loss.backward()
    return loss.detach(), z.grad


def _compare(draft, target, backend, what, **kw):
    loss_ref, grad_ref = _grads(draft, target, "autograd", **kw)
    loss, grad = _grads(draft, target, backend, **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert grad.dtype == draft.dtype and grad.shape == draft.shape

    def msg(m):
        return f"{what}: {m}"

    torch.testing.assert_close(loss, loss_ref, rtol=2e-5, atol=1e-6, msg=msg)
    if draft.dtype == torch.float32:
        # The gradient q_v (h_B / Q_B - H) cancels: entries far below the largest one carry
        # fp32 rounding of the terms (of size |log p|, up to 69 at the floor, for rkl).
        rtol = 2e-3 if kw.get("loss") == "rkl" else 2e-4
        scale = grad_ref.abs().max().item() + 1e-12
        torch.testing.assert_close(grad, grad_ref, rtol=rtol, atol=1e-4 * scale, msg=msg)
    else:  # both are fp32 gradients rounded once to the draft dtype
        torch.testing.assert_close(grad.float(), grad_ref.float(), rtol=2e-2, atol=1e-5, msg=msg)


# ---- the reference ---------------------------------------------------------------------


def test_reference_closed_forms():
    gen = torch.Generator().manual_seed(0)
    z, t = _logits(gen, 6, 50), _logits(gen, 6, 50)
    lq, lp = F.log_softmax(z, -1), F.log_softmax(t, -1)
    p, q = lp.exp(), lq.exp()
    fkl = (p * (lp - lq)).sum(-1).mean()
    rkl = (q * (lq - lp)).sum(-1).mean()
    tvd = 0.5 * (p - q).abs().sum(-1).mean()
    torch.testing.assert_close(distill_loss_reference(z, t, loss="fkl"), fkl)
    torch.testing.assert_close(distill_loss_reference(z, t, loss="rkl"), rkl)
    torch.testing.assert_close(distill_loss_reference(z, t, loss="tvd"), tvd)
    for beta in (0.1, 0.5, 0.9):
        m = beta * p + (1 - beta) * q
        jsd = (beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)).mean()
        torch.testing.assert_close(distill_loss_reference(z, t, loss="jsd", beta=beta), jsd)
    # the beta -> 0 and beta -> 1 limits are continuous with the exact zeros
    for beta in (1e-6, 1 - 1e-6):
        assert distill_loss_reference(z, t, loss="jsd", beta=beta) < 1e-4
    assert distill_loss_reference(z, t, loss="jsd", beta=0.0) == 0


def test_topk_is_exact_when_the_target_lives_in_the_topk():
    """With p = 0 outside the kept ids, fkl, jsd and tvd over k + 1 buckets equal the full ones."""
    gen = torch.Generator().manual_seed(1)
    N, V, k = 5, 40, 6
    z, t = _logits(gen, N, V), _logits(gen, N, V)
    ids = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(N)])
    t_masked = torch.full_like(t, float("-inf")).scatter(1, ids, t.gather(1, ids))
    probs = torch.softmax(t_masked, -1).gather(1, ids)
    for loss, beta in (("fkl", 0.5), ("tvd", 0.5), ("jsd", 0.3), ("jsd", 0.8)):
        full = distill_loss_reference(z, t_masked, loss=loss, beta=beta)
        top = distill_loss_reference(z, (ids, probs), loss=loss, beta=beta)
        torch.testing.assert_close(top, full, msg=loss)


def test_topk_is_a_lower_bound_of_the_full_divergence():
    """Coarsening to k + 1 buckets never increases an f-divergence (data processing)."""
    gen = torch.Generator().manual_seed(2)
    N, V = 64, 100
    z, t = _logits(gen, N, V), _logits(gen, N, V)
    p = torch.softmax(t, -1)
    for k in (1, 5, 30):
        probs, ids = p.topk(k, -1)
        for loss, beta in (("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5), ("jsd", 0.1), ("jsd", 0.9)):
            rows_full = divergence_rows(*bucket_logprobs(z, t), loss, beta)
            rows_top = divergence_rows(*bucket_logprobs(z, (ids, probs)), loss, beta)
            assert (rows_top <= rows_full + 1e-6).all(), (loss, k)
            assert (rows_top < rows_full - 1e-4).any(), (loss, k)  # and not trivially equal


# ---- every backend against autograd of the reference -----------------------------------


@pytest.mark.parametrize("form", ["full", "topk"])
@pytest.mark.parametrize("loss,beta", LOSS_BETAS)
def test_gradients_match_autograd(device, form, loss, beta):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((form, loss, beta)).encode()))
    for backend in ["reference"] + backends_for(device):
        # the Triton interpreter costs ~30 ms per row: small N for it on CPU
        N, V = (5, 203) if backend == "triton" and device.type == "cpu" else (41, 1271)
        draft = _logits(gen, N, V).to(device)
        target = _target(gen, form, N, V, device)
        mask = (torch.rand(N, generator=gen) > 0.3).to(device)
        mask[0] = True
        for m in (mask, None):
            _compare(
                draft,
                target,
                backend,
                f"{backend} {form} {loss} {beta}",
                loss=loss,
                beta=beta,
                mask=m,
            )


@pytest.mark.parametrize("form", ["full", "topk"])
def test_odd_shape_triton(device, form):
    """The (41, 1271) shape through the Triton kernel (one call: the interpreter is slow)."""
    gen = torch.Generator().manual_seed(3)
    draft = _logits(gen, 41, 1271).to(device)
    target = _target(gen, form, 41, 1271, device)
    mask = (torch.rand(41, generator=gen) > 0.2).to(device)
    _compare(draft, target, "triton", f"triton {form}", loss="jsd", beta=0.1, mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_draft_and_target(device, dtype):
    gen = torch.Generator().manual_seed(4)
    for backend in ["reference"] + backends_for(device):
        N, V = (4, 333) if backend == "triton" and device.type == "cpu" else (13, 333)
        draft = _logits(gen, N, V, dtype=dtype).to(device)
        full = _logits(gen, N, V, dtype=dtype).to(device)
        ids, probs = _topk_target(gen, N, V, 5)
        topk = (ids.to(device), probs.to(dtype).to(device))
        for target in (full, topk):
            for loss, beta in (("fkl", 0.5), ("jsd", 0.5), ("rkl", 0.5), ("tvd", 0.5)):
                _compare(draft, target, backend, f"{backend} {dtype} {loss}", loss=loss, beta=beta)


def test_all_masked_gives_zero_loss_and_zero_gradient(device):
    gen = torch.Generator().manual_seed(5)
    N, V = 6, 77
    mask = torch.zeros(N, dtype=torch.bool, device=device)
    for backend in ["reference"] + backends_for(device):
        for form in ("full", "topk"):
            target = _target(gen, form, N, V, device)
            for loss, beta in LOSS_BETAS:
                z = _logits(gen, N, V).to(device).requires_grad_(True)
                out = distill_loss(z, target, loss=loss, beta=beta, mask=mask, backend=backend)
                out.backward()
                assert out.item() == 0 and torch.equal(z.grad, torch.zeros_like(z)), (backend, loss)


def test_strided_inputs(device):
    """Column-strided draft logits, a row-padded target, non-contiguous ids and probs."""
    gen = torch.Generator().manual_seed(6)
    N, V = 7, 150
    draft = _logits(gen, N, 2 * V).to(device)[:, ::2]
    target = _logits(gen, N, V + 9).to(device)[:, 4 : V + 4]
    ids, probs = _topk_target(gen, N, V, 12)
    ids, probs = ids.to(device)[:, ::2], probs.to(device)[:, ::2]
    assert not (draft.is_contiguous() or target.is_contiguous() or ids.is_contiguous())
    for backend in ["reference"] + backends_for(device):
        for tgt in (target, (ids, probs)):
            for loss, beta in (("fkl", 0.5), ("jsd", 0.9), ("tvd", 0.5)):
                _compare(draft, tgt, backend, f"strided {backend} {loss}", loss=loss, beta=beta)


def test_portable_cpu_path(monkeypatch):
    """The C++ kernel's non-AVX2 path (used on other CPUs) against autograd of the reference."""
    monkeypatch.setenv("OSD_NO_AVX2", "1")
    gen = torch.Generator().manual_seed(7)
    draft = _logits(gen, 11, 301)
    for form in ("full", "topk"):
        target = _target(gen, form, 11, 301, "cpu")
        for loss, beta in (("fkl", 0.5), ("rkl", 0.5), ("jsd", 0.1), ("tvd", 0.5)):
            _compare(draft, target, "native", f"portable {form} {loss}", loss=loss, beta=beta)


def test_extreme_logits_stay_finite(device):
    gen = torch.Generator().manual_seed(8)
    N, V = 5, 64
    draft = _logits(gen, N, V, scale=300.0).to(device)
    target = _logits(gen, N, V, scale=300.0).to(device)
    for backend in ["reference"] + backends_for(device):
        for loss, beta in LOSS_BETAS:
            loss_v, grad = _grads(draft, target, backend, loss=loss, beta=beta)
            assert torch.isfinite(loss_v) and torch.isfinite(grad).all(), (backend, loss)


# ---- the fused op's contract -----------------------------------------------------------


def test_backward_keeps_only_the_gradient():
    """The fused loss keeps for backward the [N, V] gradient in the draft dtype and a scalar."""
    gen = torch.Generator().manual_seed(9)
    N, V = 8, 500
    z = _logits(gen, N, V, dtype=torch.bfloat16).requires_grad_(True)
    target = _logits(gen, N, V)
    for backend in ("reference", "native"):
        loss = distill_loss(z, target, loss="jsd", backend=backend)
        ctx = loss.grad_fn
        assert ctx.saved_tensors == () and ctx.count == N, backend
        assert ctx.grad.shape == (N, V) and ctx.grad.dtype == torch.bfloat16, backend
        kept = ctx.grad.data_ptr()
        del ctx
        loss.backward()
        assert z.grad.data_ptr() == kept, backend  # handed over to .grad, not copied
        z.grad = None


def test_backward_scales_by_grad_output_and_runs_once():
    gen = torch.Generator().manual_seed(10)
    draft, target = _logits(gen, 4, 30), _logits(gen, 4, 30)
    _, g1 = _grads(draft, target, "native", loss="fkl")
    z = draft.clone().requires_grad_(True)
    loss = distill_loss(z, target, loss="fkl", backend="native")
    (3.0 * loss).backward(retain_graph=True)
    torch.testing.assert_close(z.grad, 3.0 * g1)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_bad_input_names_the_problem():
    z = torch.zeros(3, 10)
    with pytest.raises(ValueError, match="unknown loss"):
        distill_loss(z, z, loss="kl")
    with pytest.raises(ValueError, match="beta"):
        distill_loss(z, z, loss="jsd", beta=1.5)
    with pytest.raises(ValueError, match="target logits"):
        distill_loss(z, z[:, :5])
    with pytest.raises(TypeError, match="target"):
        distill_loss(z, [z])
    with pytest.raises(ValueError, match="topk_ids"):
        distill_loss(z, (torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)))
    with pytest.raises(ValueError, match="k < V"):
        distill_loss(z, (torch.zeros(3, 10, dtype=torch.long), torch.zeros(3, 10)))
    with pytest.raises(ValueError, match="mask"):
        distill_loss(z, z, mask=torch.ones(3))
    with pytest.raises(TypeError, match="draft_logits"):
        distill_loss(z.long(), z)
    ids = torch.tensor([[1, 1], [0, 2], [0, 3]])
    with pytest.raises(RuntimeError, match="repeated id"):
        distill_loss(z, (ids, torch.full((3, 2), 0.3)), backend="native")
    # padding in masked-out rows is never read, so it is allowed
    keep = torch.tensor([False, True, True])
    distill_loss(z, (ids, torch.full((3, 2), 0.3)), mask=keep, backend="native")
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        distill_loss(z, (ids + 9, torch.full((3, 2), 0.3)), backend="native")


def test_opcheck():
    gen = torch.Generator().manual_seed(11)
    z, t = _logits(gen, 5, 23), _logits(gen, 5, 23)
    ids, probs = _topk_target(gen, 5, 23, 4)
    mask = torch.tensor([True, False, True, True, False])
    for args in ((z, t, None, None, mask, "jsd", 0.3), (z, None, ids, probs, None, "rkl", 0.5)):
        torch.library.opcheck(torch.ops.osd.distill_loss_fwd_bwd.default, args)
