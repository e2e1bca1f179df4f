"""tree_attention: the reference against a brute-force loop, every backend against the
reference (odd shapes, ragged and empty prefixes, GQA, strided views, every dtype, causal
blocks longer than the 64-bit tree mask), tree masks from random parent arrays, and
opcheck.

Low-precision tolerance (flash-attention's rule): a backend's error against the fp32
reference must be within twice the error of the reference itself run in that precision,
plus a small floor.
"""

import importlib
import math
import zlib

import pytest
import torch

from osd_kernels import (
    causal_tree_mask,
    tree_attention,
    tree_attention_reference,
    tree_mask_from_parents,
)
from osd_kernels.triton import tree_attention as triton_ta
from osd_kernels.triton.tree_attention import (
    MAX_SPLITS,
    SPLIT_MIN_KEYS,
    split_kv_num_splits,
    tree_attention_triton,
)
from tests.conftest import backends_for

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _signed(bits: int) -> int:
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def random_parents(gen, batch: int, num_nodes: int) -> torch.Tensor:
    """Random trees [batch, num_nodes] int32: parents[:, 0] = -1, parents[:, i] < i."""
    cols = [torch.full((batch,), -1)] + [
        torch.randint(0, i, (batch,), generator=gen) for i in range(1, num_nodes)
    ]
    return torch.stack(cols, 1).to(torch.int32)


def masks_from_parents_loop(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self bitmasks, built node by node in Python (the test's own construction)."""
    rows = []
    for row in parents.tolist():
        masks = []
        for i, parent in enumerate(row):
            masks.append((1 << i) | (masks[parent] if parent >= 0 else 0))
        rows.append([_signed(m) for m in masks])
    return torch.tensor(rows, dtype=torch.int64)


def random_tree_mask(gen, batch: int, num_nodes: int) -> torch.Tensor:
    """Ancestor-or-self bitmasks [batch, num_nodes] of random trees."""
    return masks_from_parents_loop(random_parents(gen, batch, num_nodes))


def test_tree_mask_from_parents():
    gen = torch.Generator().manual_seed(8)
    for T in (1, 2, 7, 33, 64):
        parents = random_parents(gen, 4, T)
        assert torch.equal(tree_mask_from_parents(parents), masks_from_parents_loop(parents))
    chain = torch.arange(-1, 63, dtype=torch.int32).unsqueeze(0)
    assert torch.equal(tree_mask_from_parents(chain), causal_tree_mask(1, 64))


def _case(gen, B, T, Hq, Hkv, D, dtype, device, *, B_max=None, L=2, max_prefix=90):
    """q, a [L, 2, B_max, Hkv, S, D] cache (callers use views of it), ragged lens incl. 0."""
    B_max = B_max or B + 1
    S = max_prefix + T + 3
    lens = torch.randint(0, max_prefix + 1, (B_max,), generator=gen, dtype=torch.int32)
    lens[0] = 0
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype).to(device)
    kv = torch.randn(L, 2, B_max, Hkv, S, D, generator=gen).to(dtype).to(device)
    return q, kv, lens.to(device)


def _check_close(out, q, k, v, lens, mask, dtype, what):
    """Compare with the fp32 reference using the dtype-tied rule above."""
    exact = tree_attention_reference(q.float(), k.float(), v.float(), lens, mask)
    err = (out.float() - exact).abs().max().item()
    if dtype == torch.float32:
        bound = FLOOR[dtype]
    else:
        low = tree_attention_reference(q, k, v, lens, mask)
        bound = 2 * (low.float() - exact).abs().max().item() + FLOOR[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    assert err <= bound, f"{what}: error {err:.3g} > bound {bound:.3g}"


def test_reference_matches_brute_force():
    """The SDPA reference against an explicit softmax over each query's visible keys."""
    gen = torch.Generator().manual_seed(1)
    B, T, Hq, Hkv, D = 3, 6, 4, 2, 8
    q, kv, lens = _case(gen, B, T, Hq, Hkv, D, torch.float64, "cpu", max_prefix=11)
    mask = random_tree_mask(gen, B, T)
    mask[1, 3] = 0  # a query that sees only the prefix
    out = tree_attention_reference(q, kv[1, 0], kv[1, 1], lens, mask)
    for b in range(B):
        L = int(lens[b])
        for i in range(T):
            keys = list(range(L)) + [L + j for j in range(T) if (int(mask[b, i]) >> j) & 1]
            for h in range(Hq):
                k = kv[1, 0, b, h // 2, keys]
                v = kv[1, 1, b, h // 2, keys]
                expect = torch.softmax(k @ q[b, i, h] / math.sqrt(D), 0) @ v
                if not keys:
                    expect = torch.zeros(D, dtype=torch.float64)
                torch.testing.assert_close(out[b, i, h], expect)


SHAPES = [  # B, T, Hq, Hkv, D
    (1, 1, 4, 2, 16),
    (3, 7, 3, 3, 40),
    (3, 1, 8, 1, 64),
    (1, 64, 4, 2, 16),
    (3, 64, 3, 3, 40),
    (1, 7, 8, 1, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(device, dtype, shape):
    B, T, Hq, Hkv, D = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype)).encode()))
    q, kv, lens = _case(gen, B, T, Hq, Hkv, D, dtype, device)
    k, v = kv[1, 0], kv[1, 1]  # strided views of the runtime's cache layout
    tree = random_tree_mask(gen, B, T).to(device)
    for backend in backends_for(device):
        for mask in (None, tree):
            out = tree_attention(q, k, v, lens, mask, backend=backend)
            _check_close(out, q, k, v, lens, mask, dtype, f"{backend} mask={mask is not None}")


# The C++ kernel's instruction-set paths, chosen at run time: AVX-512 (head dims that are a
# multiple of 16) where the CPU has it, AVX2 + FMA, portable loops.
CPU_PATHS = {"default": {}, "avx2": {"OSD_NO_AVX512": "1"}, "portable": {"OSD_NO_AVX2": "1"}}


def _use_path(monkeypatch, path):
    for name, value in CPU_PATHS[path].items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("path", CPU_PATHS)
def test_cpu_paths(monkeypatch, path):
    """Each instruction-set path of the C++ kernel against the reference, with head dims
    that do (64) and do not (40) suit the AVX-512 path."""
    _use_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(7)
    for dtype in DTYPES:
        for D in (40, 64):
            q, kv, lens = _case(gen, 3, 7, 9, 3, D, dtype, "cpu")
            mask = random_tree_mask(gen, 3, 7)
            for m in (mask, None):
                out = tree_attention(q, kv[1, 0], kv[1, 1], lens, m, backend="native")
                _check_close(out, q, kv[1, 0], kv[1, 1], lens, m, dtype, f"native {path} D={D}")


@pytest.mark.parametrize("path", CPU_PATHS)
def test_sharp_softmax_matches_reference(monkeypatch, path):
    """Scores far apart (a large scale): exponents below -87 underflow to 0 in the vector
    and portable softmax alike, beside masked (-inf) keys."""
    _use_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(8)
    for D in (24, 32):
        q, kv, lens = _case(gen, 2, 9, 6, 2, D, torch.float32, "cpu", max_prefix=150)
        mask = random_tree_mask(gen, 2, 9)
        for scale in (12.0, 60.0):
            for m in (mask, None):
                out = tree_attention(q, kv[0, 0], kv[0, 1], lens, m, scale=scale, backend="native")
                want = tree_attention_reference(q, kv[0, 0], kv[0, 1], lens, m, scale=scale)
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_rows_do_not_depend_on_their_task():
    """On the AVX-512 path a query row's output is the same bits whatever shares its task.
    The kernel has three task layouts: fewer than 8 query rows per KV head (decode: one row
    at a time, the prefix split into key ranges), 8 to 16 (short verify: rows in vector
    lanes, the prefix split into longer ranges) and more (rows in lanes, split into
    blocks). Within each, causal query t of a T-row call equals the last query of the
    (t + 1)-row call, at one and two threads (tasks are sized by T and the thread count)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the CPU has no AVX-512")
    gen = torch.Generator().manual_seed(10)
    q, kv, lens = _case(gen, 1, 9, 9, 3, 64, torch.float32, "cpu", max_prefix=500)
    lens[0] = 450  # split into ranges in both split layouts, ending in a part block
    k, v = kv[0, 0], kv[0, 1]
    longest = (2, 5, 9)  # the longest call (T) of each layout with 3 rows per T
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            full = {
                T: tree_attention(q[:, :T], k, v, lens, None, backend="native") for T in longest
            }
            outs.append(full)
            for t in range(9):
                last = tree_attention(q[:, : t + 1], k, v, lens, None, backend="native")[:, t]
                same_layout = full[next(T for T in longest if t < T)]
                assert torch.equal(last, same_layout[:, t]), (n, t)
    finally:
        torch.set_num_threads(threads)
    for T in longest:
        assert torch.equal(outs[0][T], outs[1][T])


def test_a_verified_query_equals_the_same_query_decoded_alone():
    """Float32 on AVX-512 (T <= 64): a query's output depends only on its visible keys in
    position order. Each node of a tree verified in one call equals, bit for bit, the same
    query decoded alone (T = 1) after the prefix and its ancestors laid out consecutively
    (what the KV rollback leaves after accepting them), at one and two threads, beside other
    rows of a batch."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the CPU has no AVX-512")
    gen = torch.Generator().manual_seed(21)
    B, T, Hq, Hkv, D = 3, 9, 9, 3, 64
    q, kv, lens = _case(gen, B, T, Hq, Hkv, D, torch.float32, "cpu", max_prefix=300)
    lens[1] = 257
    k, v = kv[0, 0], kv[0, 1]
    mask = random_tree_mask(gen, B, T)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            tree = tree_attention(q, k, v, lens, mask, backend="native")
            for b in range(B):
                L = int(lens[b])
                for t in range(T):
                    seen = [j for j in range(T) if (int(mask[b, t]) >> j) & 1]
                    order = list(range(L)) + [L + j for j in seen]
                    k1 = k[b : b + 1, :, order].contiguous()
                    v1 = v[b : b + 1, :, order].contiguous()
                    lens1 = torch.tensor([len(order) - 1], dtype=torch.int32)
                    alone = tree_attention(q[b : b + 1, t : t + 1], k1, v1, lens1, backend="native")
                    assert torch.equal(alone[0, 0], tree[b, t]), (n, b, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("D", (16, 48, 80, 128))
def test_lane_layout_matches_reference(D):
    """Verify blocks and prefills (8 or more query rows per KV head) keep a task's rows in
    vector lanes on the AVX-512 path: head dims whose values split into chunks of 1 to 4
    vectors, 8 to 40 rows per KV head (one or two lane vectors, every remainder of the
    four-row groups of P.V), prefixes that split or not, tree masks and causal, every
    dtype, against the reference."""
    gen = torch.Generator().manual_seed(16 + D)
    for dtype in DTYPES:
        for T, Hq, Hkv in ((2, 4, 1), (3, 9, 3), (5, 2, 1), (5, 6, 2), (10, 4, 1)):
            q, kv, lens = _case(gen, 3, T, Hq, Hkv, D, dtype, "cpu", max_prefix=500)
            lens[0] = 0
            lens[1] = 384  # ends on a split boundary
            mask = random_tree_mask(gen, 3, T)
            for m in (mask, None):
                out = tree_attention(q, kv[0, 0], kv[0, 1], lens, m, backend="native")
                _check_close(
                    out,
                    q,
                    kv[0, 0],
                    kv[0, 1],
                    lens,
                    m,
                    dtype,
                    f"lanes D={D} T={T} Hq={Hq} Hkv={Hkv} {dtype}",
                )


LONG_SHAPES = [  # B, T, Hq, Hkv, D: causal blocks past the 64-bit tree mask
    (3, 65, 3, 1, 20),
    (2, 100, 4, 2, 12),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LONG_SHAPES)
def test_long_causal_matches_reference(device, dtype, shape):
    """Causal calls take any T: every backend against the fp32 reference, which is itself
    checked against an explicit softmax for some queries (ragged and empty prefixes)."""
    B, T, Hq, Hkv, D = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, "long")).encode()))
    q, kv, lens = _case(gen, B, T, Hq, Hkv, D, dtype, device, max_prefix=37)
    k, v = kv[1, 0], kv[1, 1]
    exact = tree_attention_reference(q.double(), k.double(), v.double(), lens, None)
    G = Hq // Hkv
    for b in range(B):
        L = int(lens[b])
        for i in (0, 63, 64, T - 1):
            h = (i + b) % Hq
            kk, vv = k[b, h // G, : L + i + 1].double(), v[b, h // G, : L + i + 1].double()
            want = torch.softmax(kk @ q[b, i, h].double() / math.sqrt(D), 0) @ vv
            torch.testing.assert_close(exact[b, i, h].cpu(), want.cpu())
    for backend in ["reference"] + backends_for(device):
        out = tree_attention(q, k, v, lens, None, backend=backend)
        _check_close(out, q, k, v, lens, None, dtype, f"{backend} T={T}")


@pytest.mark.parametrize("path", CPU_PATHS)
def test_split_keys_cpu(monkeypatch, path):
    """Decode and short verify calls split each row's prefix into key ranges and merge
    them: rows of one batch with no prefix, one block, prefixes that end on a split
    boundary (128 one row at a time, T = 1; 384 in lanes, T = 4) and a long prefix (ranges
    of several blocks), every dtype, tree masks and causal, against the reference."""
    _use_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(15)
    for dtype in DTYPES:
        for T in (1, 4):
            q, kv, lens = _case(gen, 5, T, 6, 2, 32, dtype, "cpu", B_max=5, L=1, max_prefix=1500)
            lens.copy_(torch.tensor([0, 70, 128, 384, 1500], dtype=torch.int32))
            mask = random_tree_mask(gen, 5, T)
            for m in (mask, None):
                out = tree_attention(q, kv[0, 0], kv[0, 1], lens, m, backend="native")
                _check_close(
                    out, q, kv[0, 0], kv[0, 1], lens, m, dtype, f"split {path} T={T} {dtype}"
                )


@pytest.mark.parametrize("path", CPU_PATHS)
def test_long_causal_cpu_paths(monkeypatch, path):
    """Each instruction-set path's causal key tiles (T > 64) against the reference."""
    _use_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(9)
    for D in (24, 32):
        q, kv, lens = _case(gen, 2, 70, 3, 1, D, torch.float32, "cpu", max_prefix=30)
        out = tree_attention(q, kv[0, 0], kv[0, 1], lens, None, backend="native")
        _check_close(out, q, kv[0, 0], kv[0, 1], lens, None, torch.float32, f"native {path}")


def test_chain_mask_equals_causal(device):
    gen = torch.Generator().manual_seed(2)
    for T in (1, 7, 64):
        q, kv, lens = _case(gen, 2, T, 4, 2, 16, torch.float32, device, max_prefix=40)
        chain = causal_tree_mask(2, T, device)
        for backend in ["reference"] + backends_for(device):
            a = tree_attention(q, kv[0, 0], kv[0, 1], lens, None, backend=backend)
            b = tree_attention(q, kv[0, 0], kv[0, 1], lens, chain, backend=backend)
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_causal_tree_mask_bits():
    m = causal_tree_mask(2, 64)
    assert m.shape == (2, 64) and m.dtype == torch.int64
    assert m[1, 0] == 1 and m[0, 2] == 0b111 and m[0, 62] == (1 << 63) - 1 and m[0, 63] == -1


def test_strided_inputs(device):
    """q sliced from a fused qkv projection, a cache with a padded head dim, a row-strided mask."""
    gen = torch.Generator().manual_seed(3)
    B, T, Hq, Hkv, D = 3, 5, 4, 2, 24
    qkv = torch.randn(B, T, 3 * Hq, D + 8, generator=gen).to(device)
    q = qkv[:, :, Hq : 2 * Hq, :D]
    big = torch.randn(2, 2, B + 2, Hkv, 60, D + 8, generator=gen).to(device)
    k, v = big[1, 0, ..., :D], big[1, 1, ..., 3 : D + 3]
    lens = torch.tensor([0, 17, 40, 2, 9], dtype=torch.int32, device=device)
    mask = random_tree_mask(gen, B, 2 * T).to(device)[:, ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or mask.is_contiguous())
    for backend in backends_for(device):
        out = tree_attention(q, k, v, lens, mask, backend=backend)
        _check_close(out, q, k, v, lens, mask, torch.float32, backend)


def test_query_that_sees_nothing_is_zero(device):
    gen = torch.Generator().manual_seed(4)
    q, kv, lens = _case(gen, 1, 3, 2, 1, 16, torch.float32, device)
    lens.zero_()
    mask = torch.tensor([[1, 0, 0b110]], device=device)
    for backend in ["reference"] + backends_for(device):
        out = tree_attention(q, kv[0, 0], kv[0, 1], lens, mask, backend=backend)
        assert torch.isfinite(out).all(), backend
        assert out[0, 1].abs().max() == 0, backend
        torch.testing.assert_close(out[0, 0], kv[0, 1, 0, :, 0].expand(2, 16))


def test_max_kv_len_bound(device):
    """A loose host-side bound gives the same result as the exact one."""
    gen = torch.Generator().manual_seed(5)
    q, kv, lens = _case(gen, 3, 4, 4, 2, 16, torch.float32, device)
    exact = tree_attention(q, kv[0, 0], kv[0, 1], lens, backend="reference")
    loose = tree_attention(q, kv[0, 0], kv[0, 1], lens, backend="reference", max_kv_len=kv.shape[4])
    torch.testing.assert_close(exact, loose)


def test_bad_input_names_the_problem():
    q = torch.zeros(2, 3, 4, 8)
    k = torch.zeros(3, 2, 16, 8)
    lens = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tree_attention(q[:, :, :3], k, k, lens)
    with pytest.raises(ValueError, match="cache_lens"):
        tree_attention(q, k, k, lens.long())
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention(q, k, k, lens, torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="k_cache"):
        tree_attention(q, k.bfloat16(), k.bfloat16(), lens)
    with pytest.raises(TypeError, match="k_cache"):
        tree_attention(q.half(), k, k, lens)  # a float32 cache under float16 q
    with pytest.raises(RuntimeError, match="k_cache"):
        torch.ops.osd.tree_attention(q, k.bfloat16(), k.bfloat16(), lens, None, 1.0)
    with pytest.raises(ValueError, match="head dim"):
        tree_attention(q, k[..., :4], k[..., :4], lens)
    with pytest.raises(ValueError, match="bitmask limit"):
        tree_attention(torch.zeros(1, 65, 2, 8), k, k, lens, torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(RuntimeError, match="bitmask limit"):
        torch.ops.osd.tree_attention(
            torch.zeros(1, 65, 2, 8),
            k[..., :80, :],
            k[..., :80, :],
            lens,
            torch.zeros(1, 65, dtype=torch.long),
            1.0,
        )
    with pytest.raises(ValueError, match="max_kv_len"):
        tree_attention(q, k, k, lens, max_kv_len=17)
    with pytest.raises(RuntimeError, match="capacity"):
        tree_attention(q, k, k, torch.tensor([14, 0, 0], dtype=torch.int32), backend="native")


def test_opcheck():
    gen = torch.Generator().manual_seed(6)
    q, kv, lens = _case(gen, 2, 3, 4, 2, 8, torch.float32, "cpu", max_prefix=7)
    mask = random_tree_mask(gen, 2, 3)
    for m in (mask, None):
        torch.library.opcheck(
            torch.ops.osd.tree_attention.default, (q, kv[0, 0], kv[0, 1], lens, m, 0.3)
        )


# Split KV (the Triton decode/verify path for long prefixes), forced with ``num_splits`` so
# it runs at interpreter-sized prefixes. Under the interpreter a prefix chunk is a multiple
# of 32 keys, so short rows (and the last case, 12 splits of at most 4 tiles) leave splits
# empty. The interpreter pays per program, so each case runs few split counts.
SPLIT_CASES = [  # B, T, Hq, Hkv, D, lens (B_max entries), tree mask?, split counts
    (3, 5, 9, 3, 80, [0, 333, 1025, 7], True, (1, 7)),
    (3, 5, 9, 3, 80, [0, 333, 1025, 7], False, (3,)),
    (2, 17, 4, 4, 64, [0, 1100, 5], True, (2,)),
    (2, 17, 4, 4, 64, [47, 1100, 5], False, (5,)),
    (1, 64, 9, 3, 64, [301, 3], True, (1,)),
    (1, 64, 9, 3, 64, [301, 3], False, (3,)),
    (2, 1, 4, 4, 80, [1999, 0, 64], False, (4,)),
    (2, 3, 3, 1, 64, [100, 0, 9], True, (12,)),
]


def _split_case(gen, B, T, Hq, Hkv, D, lens, dtype):
    S = max(lens) + T + 5
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    kv = torch.randn(2, 2, len(lens), Hkv, S, D, generator=gen).to(dtype)
    return q, kv[1, 0], kv[1, 1], torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "case",
    SPLIT_CASES,
    ids=lambda c: (
        f"B{c[0]}-T{c[1]}-{c[2]}/{c[3]}-D{c[4]}-{'tree' if c[6] else 'causal'}-splits{c[7]}"
    ),
)
def test_split_kv_matches_reference(case):
    """Split KV against the fp32 reference: ragged prefixes (empty ones too), GQA and MHA,
    head dims 64 and 80, tree masks (with a row that sees no tree key) and causal."""
    B, T, Hq, Hkv, D, lens, tree, split_counts = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    q, k, v, lens = _split_case(gen, B, T, Hq, Hkv, D, lens, torch.float32)
    mask = random_tree_mask(gen, B, T) if tree else None
    if tree:
        mask[-1, T // 2] = 0  # a query that sees only the prefix (or nothing, if it is empty)
    for splits in split_counts:
        out = tree_attention_triton(q, k, v, lens, mask, D**-0.5, num_splits=splits)
        _check_close(out, q, k, v, lens, mask, torch.float32, f"num_splits={splits}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_kv_half(dtype):
    gen = torch.Generator().manual_seed(11)
    q, k, v, lens = _split_case(gen, 3, 6, 9, 3, 80, [400, 0, 95, 40], dtype)
    for mask in (random_tree_mask(gen, 3, 6), None):
        out = tree_attention_triton(q, k, v, lens, mask, 80**-0.5, num_splits=5)
        _check_close(out, q, k, v, lens, mask, dtype, f"split {dtype} mask={mask is not None}")


def test_split_kv_chain_equals_causal_and_nothing_seen():
    """The new keys run the single pass's tile code: a chain mask equals causal bit for bit;
    an empty prefix with an empty mask row gives zeros."""
    gen = torch.Generator().manual_seed(12)
    q, k, v, lens = _split_case(gen, 2, 7, 4, 2, 16, [0, 90, 3], torch.float32)
    a = tree_attention_triton(q, k, v, lens, None, 0.25, num_splits=3)
    b = tree_attention_triton(q, k, v, lens, causal_tree_mask(2, 7), 0.25, num_splits=3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    mask = causal_tree_mask(2, 7)
    mask[0, 4] = 0
    out = tree_attention_triton(q, k, v, lens, mask, 0.25, num_splits=2)
    assert torch.isfinite(out).all() and out[0, 4].abs().max() == 0


def test_split_kv_num_splits_heuristic():
    """Host-side choice: single pass for short prefixes, prefill and full GPUs; otherwise
    about two programs per SM, each split at least SPLIT_MIN_KEYS keys."""
    assert split_kv_num_splits(1, 8, 8, 4, 300) == 1  # short prefix
    assert split_kv_num_splits(1, 8, 65, 4, 1 << 15) == 1  # T > 64: prefill
    assert split_kv_num_splits(64, 8, 8, 4, 1 << 15) == 1  # B * Hkv fills the GPU
    n = split_kv_num_splits(1, 8, 8, 4, (1 << 15) + 8)
    assert n == 33  # ceil(2 * 132 / 8)
    assert split_kv_num_splits(1, 8, 1, 4, (1 << 15) + 1) == n  # decode splits alike
    assert split_kv_num_splits(8, 8, 8, 4, 4096 + 8) == 5
    assert split_kv_num_splits(1, 8, 1, 4, 4096 + 1) == 4096 // SPLIT_MIN_KEYS
    assert split_kv_num_splits(1, 1, 1, 1, 1 << 20) == MAX_SPLITS


def test_split_kv_bad_num_splits():
    q, k = torch.zeros(1, 65, 2, 8), torch.zeros(1, 1, 80, 8)
    lens = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="T <= 64"):
        tree_attention_triton(q, k, k, lens, None, 1.0, num_splits=2)
    for bad in (-1, MAX_SPLITS + 1):
        with pytest.raises(ValueError, match="num_splits"):
            tree_attention_triton(q[:, :3], k, k, lens, None, 1.0, num_splits=bad)


def test_split_kv_auto_dispatch():
    """``tree_attention(backend="triton")`` takes the split path on its own when the
    heuristic asks for it (here 4 splits of a 1,030-key prefix, one KV head)."""
    gen = torch.Generator().manual_seed(13)
    q, k, v, lens = _split_case(gen, 1, 2, 2, 1, 32, [1030], torch.float32)
    assert triton_ta.split_kv_num_splits(1, 1, 2, 2, 1032) == 4
    calls = []
    real = triton_ta._split_kv
    try:
        triton_ta._split_kv = lambda *a: calls.append(a[7]) or real(*a)
        out = tree_attention(q, k, v, lens, None, max_kv_len=1032, backend="triton")
    finally:
        triton_ta._split_kv = real
    assert calls == [4]
    _check_close(out, q, k, v, lens, None, torch.float32, "auto split")


@pytest.mark.parametrize("path", ["default", "avx2"])
def test_cpu_auto_dispatch(monkeypatch, path):
    """``auto`` on CPU: the C++ kernel for few query rows per KV head; for large blocks
    (prefill) only where its AVX-512 path runs (head dims that are a multiple of 16), else
    the SDPA reference."""
    ta = importlib.import_module("osd_kernels.tree_attention")  # the module, not the function
    _use_path(monkeypatch, path)
    calls = []
    monkeypatch.setattr(
        ta, "tree_attention_reference", lambda *a, **kw: _reference_spy(calls, *a, **kw)
    )
    gen = torch.Generator().manual_seed(14)
    avx512 = ta.use_avx512()
    for T, D in ((5, 64), (200, 64), (200, 40)):
        q, kv, lens = _case(gen, 1, T, 9, 3, D, torch.float32, "cpu", max_prefix=40)
        calls.clear()
        out = tree_attention(q, kv[0, 0], kv[0, 1], lens, None)
        _check_close(out, q, kv[0, 0], kv[0, 1], lens, None, torch.float32, f"auto T={T}")
        large = T * 3 > ta.CPU_NATIVE_MAX_ROWS
        assert bool(calls) == (large and not (avx512 and D % 16 == 0)), (T, D, path, calls)


def _reference_spy(calls, *args, **kwargs):
    calls.append(args[0].shape)
    return tree_attention_reference(*args, **kwargs)
