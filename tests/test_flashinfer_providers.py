"""The FlashInfer benchmark adapters (``bench.flashinfer_providers``) on the CPU.

FlashInfer runs only on CUDA, so these tests drive the adapters through a stand-in module
that implements the documented contract of the calls they make (``flashinfer.sampling``'s
``softmax``, ``top_k_renorm_probs``, ``top_p_renorm_probs``, ``chain_speculative_sampling``
and ``BatchPrefillWithPagedKVCacheWrapper`` with an ``HND`` paged cache and a flattened
custom mask) in PyTorch. They check the conversions into FlashInfer's layout against this
project's references, and that the benchmark provider skips, naming what is missing.
"""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import flashinfer_providers as fip
from osd_kernels import rejection_sample_reference, tree_attention_reference, tree_mask_from_parents
from osd_kernels.tree_attention import tree_attention_mask
from osd_kernels.warp import warp_probs

ROOT = Path(__file__).resolve().parents[1]


# -- a stand-in for the flashinfer module -------------------------------------------------


def _softmax(logits, temperature=None):
    t = 1.0 if temperature is None else temperature
    t = t[:, None] if torch.is_tensor(t) else t
    return torch.softmax(logits.float() / t, dim=-1)


def _top_k_renorm_probs(probs, top_k):
    k = top_k if torch.is_tensor(top_k) else torch.full((probs.shape[0],), top_k)
    kth = probs.sort(-1, descending=True).values.gather(1, (k.long() - 1)[:, None])
    kept = torch.where(probs >= kth, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def _top_p_renorm_probs(probs, top_p):
    p = top_p if torch.is_tensor(top_p) else torch.full((probs.shape[0],), top_p)
    sorted_p, order = probs.sort(-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < p[:, None]
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def _chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, **kw):
    """Standard chain speculative sampling, output as FlashInfer documents it."""
    _chain_speculative_sampling.calls.append(
        dict(draft_probs=draft_probs, draft_token_ids=draft_token_ids, target=target_probs, **kw)
    )
    B, K = draft_token_ids.shape
    gen = torch.Generator().manual_seed(7)
    out = torch.full((B, K + 1), -1, dtype=torch.int32)
    emitted = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        for i in range(K + 1):
            p = target_probs[b, i]
            if i == K:
                out[b, i] = int(torch.multinomial(p, 1, generator=gen))
                break
            x = int(draft_token_ids[b, i])
            q = draft_probs[b, i]
            if float(torch.rand((), generator=gen)) * float(q[x]) < float(p[x]):
                out[b, i], emitted[b] = x, i + 1
                continue
            residual = (p - q).clamp_min(0)
            residual = residual if float(residual.sum()) > 0 else p
            out[b, i] = int(torch.multinomial(residual, 1, generator=gen))
            break
    return out, emitted.clone(), emitted


class _PagedPrefill:
    """``BatchPrefillWithPagedKVCacheWrapper``: pages of ``[Hkv, page_size, D]`` (HND),
    request ``i`` owns pages ``indices[indptr[i]:indptr[i + 1]]``, the last holding
    ``last_page_len[i]`` keys; ``custom_mask`` is each request's ``[qo_len, kv_len]``
    matrix flattened, requests concatenated; ``causal`` aligns queries to the end."""

    def __init__(self, workspace, kv_layout="NHD"):
        assert kv_layout == "HND"

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, Hq, Hkv, D, page_size, **kw):
        self.args = (qo_indptr, kv_indptr, kv_indices, last_page_len, Hq, Hkv, D, page_size)
        self.kw = kw

    def run(self, q, paged_kv_cache):
        qo_indptr, kv_indptr, kv_indices, last, Hq, Hkv, D, page_size = self.args
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (Hkv, page_size, D) and q.shape[1:] == (Hq, D)
        mask, causal = self.kw.get("custom_mask"), self.kw.get("causal", False)
        out, start = torch.empty_like(q), 0
        for i in range(len(qo_indptr) - 1):
            pages = kv_indices[kv_indptr[i] : kv_indptr[i + 1]]
            kv_len = (len(pages) - 1) * page_size + int(last[i])
            k = torch.cat(list(k_cache[pages]), dim=1)[:, :kv_len]
            v = torch.cat(list(v_cache[pages]), dim=1)[:, :kv_len]
            qi = q[qo_indptr[i] : qo_indptr[i + 1]].transpose(0, 1)
            n = qi.shape[1]
            if mask is not None:
                visible = mask[start : start + n * kv_len].view(n, kv_len)
                start += n * kv_len
            else:
                shift = kv_len - n if causal else kv_len
                visible = torch.arange(kv_len) <= torch.arange(n)[:, None] + shift
            o = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=visible, scale=self.kw["sm_scale"], enable_gqa=True
            )
            out[qo_indptr[i] : qo_indptr[i + 1]] = o.transpose(0, 1)
        return out


@pytest.fixture
def fake_fi():
    _chain_speculative_sampling.calls = []
    sampling = types.SimpleNamespace(
        softmax=_softmax,
        top_k_renorm_probs=_top_k_renorm_probs,
        top_p_renorm_probs=_top_p_renorm_probs,
        chain_speculative_sampling=_chain_speculative_sampling,
    )
    module = types.ModuleType("flashinfer")
    module.sampling = sampling
    module.BatchPrefillWithPagedKVCacheWrapper = _PagedPrefill
    return module


# -- skipping ------------------------------------------------------------------------------


def test_skip_names_the_missing_package_and_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match=r"flashinfer-python.*CUDA device"):
        fip.flashinfer_or_skip()
    with pytest.raises(pytest.skip.Exception, match="flashinfer-python"):
        fip.flashinfer_rejection_sample(torch.zeros(1, 2, 4), torch.zeros(1, 1, dtype=torch.long))


def test_skip_names_the_device_alone_when_flashinfer_imports(monkeypatch, fake_fi):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_fi)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="needs a CUDA device$"):
        fip.flashinfer_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fip.flashinfer_or_skip() is fake_fi
    assert fip.flashinfer_device() == ("cuda", torch.bfloat16)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="with a CUDA device the provider may run, not skip"
)
def test_bench_collects_the_provider_and_skips_it():
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--benchmark-disable",
        "-rs",
        "bench/bench_tree_attention.py::test_tree_attention[1-1-1024-flashinfer]",
        "bench/bench_tree_attention.py::test_gpu_goal_flashinfer",
    ]
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 skipped" in res.stdout, res.stdout
    assert "the flashinfer provider needs" in res.stdout, res.stdout


# -- attention ------------------------------------------------------------------------------


def test_paged_layout_is_one_page_per_row():
    qo, kv_indptr, kv_indices, last = fip.paged_layout(
        torch.tensor([5, 0, 9], dtype=torch.int32), 4
    )
    assert qo.tolist() == [0, 4, 8, 12]
    assert kv_indptr.tolist() == [0, 1, 2, 3] and kv_indices.tolist() == [0, 1, 2]
    assert last.tolist() == [9, 4, 13] and last.dtype == torch.int32


def test_flat_custom_mask_concatenates_each_rows_matrix():
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 0, 7], dtype=torch.int32)
    T = 5
    parents = torch.stack(
        [torch.full((3,), -1)] + [torch.randint(0, i, (3,), generator=gen) for i in range(1, T)], 1
    )
    mask = tree_mask_from_parents(parents)
    want = []
    for b in range(3):
        kv_len = int(lens[b]) + T
        rows = tree_attention_mask(lens[b : b + 1], mask[b : b + 1], 1, T, kv_len)
        want.append(rows[0].flatten())
    got = fip.flat_custom_mask(lens, mask)
    assert got.dtype == torch.bool and torch.equal(got, torch.cat(want))


@pytest.mark.parametrize("tree", (True, False))
def test_tree_attention_through_the_paged_layout(fake_fi, tree):
    """Ragged prefixes, a cache with more rows and slots than used, GQA 8 / 2."""
    gen = torch.Generator().manual_seed(1)
    B, T, Hq, Hkv, D, S = 3, 6, 8, 2, 16, 40
    q = torch.randn(B, T, Hq, D, generator=gen)
    k, v = torch.randn(2, B + 1, Hkv, S, D, generator=gen)
    lens = torch.tensor([10, 0, 25, 3], dtype=torch.int32)
    mask = None
    if tree:
        parents = torch.stack(
            [torch.full((B,), -1)]
            + [torch.randint(0, i, (B,), generator=gen) for i in range(1, T)],
            1,
        )
        mask = tree_mask_from_parents(parents)
    attend = fip.FlashInferTreeAttention(q, k, v, lens, mask, scale=0.3, fi=fake_fi)
    assert attend.wrapper.kw["causal"] is (not tree)
    assert attend.wrapper.kw["q_data_type"] == torch.float32
    want = tree_attention_reference(q, k, v, lens, mask, scale=0.3)
    torch.testing.assert_close(attend(q), want, rtol=1e-5, atol=1e-5)


# -- chain speculative sampling -----------------------------------------------------------


def _chain(B=3, K=4, V=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=gen) * 3
    q = torch.softmax(logits[:, :K] + torch.randn(B, K, V, generator=gen), dim=-1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(B, K)
    return logits, drafts, q


@pytest.mark.parametrize(
    "kw",
    (
        dict(temperature=0.8),
        dict(temperature=0.8, top_k=7, top_p=0.9),
        dict(temperature=1.0, top_p=0.5),
        dict(temperature=torch.tensor([0.0, 0.7, 1.3]), top_k=torch.tensor([0, 5, 3])),
        dict(temperature=torch.tensor([0.5, 1.0, 2.0]), top_p=torch.tensor([1.0, 0.6, 0.3])),
    ),
)
def test_target_probs_are_the_warped_target(fake_fi, kw):
    logits, _, _ = _chain()
    B, K1, V = logits.shape
    got = fip.flashinfer_target_probs(fake_fi, logits, **kw)
    rows = {k: (v.repeat_interleave(K1) if torch.is_tensor(v) else v) for k, v in kw.items()}
    want = warp_probs(logits.reshape(-1, V), **rows)
    t = rows["temperature"]
    if torch.is_tensor(t):
        greedy = F.one_hot(logits.reshape(-1, V).argmax(-1), V).float()
        want = torch.where((t <= 0)[:, None], greedy, want)
    assert got.dtype == torch.float32 and got.shape == (B, K1, V)
    torch.testing.assert_close(got.reshape(-1, V), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_probs", (False, True))
def test_greedy_chain_equals_the_reference(fake_fi, with_probs):
    logits, drafts, q = _chain(B=6, K=3, V=8, seed=3)  # small V: some drafts are the argmax
    drafts[0] = logits[0, :3].argmax(-1)  # one row accepts everything
    draft = q if with_probs else None
    seed = torch.arange(6)
    got = fip.flashinfer_rejection_sample(logits, drafts, draft, seed=seed, fi=fake_fi)
    want = rejection_sample_reference(logits, drafts, draft, seed=seed)
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.int32
    fip.assert_chain_output(got, want, drafts, greedy=True)
    assert int(got[1][0]) == 3


def test_sampled_chain_arguments_and_output(fake_fi):
    logits, drafts, q = _chain(B=4, K=5, V=30, seed=5)
    seed, offset = torch.arange(4) + 11, torch.full((4,), 9)
    got = fip.flashinfer_rejection_sample(
        logits,
        drafts,
        None,
        temperature=1.0,
        seed=seed,
        offset=offset,
        backend="native",
        fi=fake_fi,
    )
    (call,) = _chain_speculative_sampling.calls
    # one-hot draft distributions for point drafts, int32 ids, per-row int64 Philox keys
    assert call["draft_probs"].dtype == torch.float32
    assert torch.equal(call["draft_probs"], F.one_hot(drafts, 30).float())
    assert call["draft_token_ids"].dtype == torch.int32
    assert torch.equal(call["draft_token_ids"].long(), drafts)
    assert call["seed"].dtype == torch.int64 and torch.equal(call["seed"], seed)
    assert torch.equal(call["offset"], offset)
    torch.testing.assert_close(call["target"].sum(-1), torch.ones(4, 6))
    want = rejection_sample_reference(
        logits, drafts, None, temperature=1.0, seed=seed, offset=offset
    )
    fip.assert_chain_output(got, want, drafts, greedy=False)
    # given draft probabilities pass through as they are
    fip.flashinfer_rejection_sample(logits, drafts, q.bfloat16(), temperature=1.0, fi=fake_fi)
    assert torch.equal(_chain_speculative_sampling.calls[1]["draft_probs"], q.bfloat16().float())
    assert "seed" not in _chain_speculative_sampling.calls[1]


def test_philox_arguments():
    assert fip._philox_kwargs(None, 3, 2, "cpu") == {}
    assert fip._philox_kwargs(5, None, 2, "cpu") == {"seed": 5, "offset": 0}
    both = fip._philox_kwargs(torch.tensor(5), 0, 3, "cpu")
    assert both["seed"].tolist() == [5, 5, 5] and both["offset"].tolist() == [0, 0, 0]


def test_malformed_chain_output_is_caught():
    drafts = torch.tensor([[4, 2, 9]])
    ok = (torch.tensor([[4, 2, 7, -1]]), torch.tensor([2], dtype=torch.int32))
    fip.assert_chain_output(ok, None, drafts, greedy=False)
    bad = [
        (torch.tensor([[4, 3, 7, -1]]), ok[1]),  # an accepted draft changed
        (torch.tensor([[4, 2, -1, -1]]), ok[1]),  # no emitted token
        (torch.tensor([[4, 2, 7, 1]]), ok[1]),  # no padding after it
        (ok[0], torch.tensor([4], dtype=torch.int32)),  # count out of range
    ]
    for got in bad:
        with pytest.raises(AssertionError):
            fip.assert_chain_output(got, None, drafts, greedy=False)
