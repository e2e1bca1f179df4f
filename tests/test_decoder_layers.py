"""``decoder_layers`` (the C++ loop over a forward's layers) against its reference, the
same loop in Python over the ops' references, on random layers of odd shapes: dense
weights (plain and packed), GGUF block types, biases, RoPE tables (full, partial, none),
per-head q/k norms, a residual multiplier, skipped cache layers, causal and tree-masked
rows, Gemma's norms after attention and the MLP, GeGLU and sliding windows. The model-level
equality with the Python loop of the native ops (bit for bit) is in test_fused_layers."""

import numpy as np
import pytest
import torch

import osd_kernels
from osd.models.gguf import GGMLType, quantize
from osd.models.quant import QuantLinear
from osd_kernels.decoder_layers import DENSE, decoder_layers, layer_arguments

pytestmark = pytest.mark.skipif(
    not osd_kernels.native_available(), reason="osd_kernels._C is not built"
)

H, HQ, HKV, D, I = 96, 6, 2, 16, 64  # hidden, query / KV heads, head dim, MLP width


def _projection(kind, n, k, gen, bias):
    w = torch.randn(n, k, generator=gen) * k**-0.5
    b = torch.randn(n, generator=gen) * 0.1 if bias else None
    if kind == "dense":
        return (DENSE, w, None, None, b)
    if kind == "packed":
        return (DENSE, osd_kernels.pack_weight(w), None, None, b)
    t = GGMLType[kind]
    layer = QuantLinear.from_gguf_blocks(
        torch.from_numpy(np.ascontiguousarray(quantize(w, t))), t.name, (n, k)
    )
    return (int(t), layer.qweight, layer.scales, layer.mins, b)


def _layers(kinds, gen, cache_indices, rope_tables, multiplier, gemma_windows=None):
    """Random layers; with ``gemma_windows`` (a window per layer, None for none) Gemma's:
    norms after attention and the MLP, GeGLU, those sliding windows."""
    layers = []
    for i, (index, table) in enumerate(zip(cache_indices, rope_tables)):
        shapes = [((HQ + 2 * HKV) * D, H), (H, HQ * D), (2 * I, H), (H, I)]
        projections = [
            _projection(kinds[(i + p) % len(kinds)], n, k, gen, bias=p % 2 == 0)
            for p, (n, k) in enumerate(shapes)
        ]
        norm = lambda: (1 + 0.1 * torch.randn(H, generator=gen), 1e-5)  # noqa: E731
        head_norms = None
        if i % 2:  # per-head q/k norms (Qwen3) on every other layer
            q_norm, k_norm = (1 + 0.1 * torch.randn(2, D, generator=gen)).unbind()
            head_norms = (q_norm, k_norm, 1e-6)
        layers.append(
            {
                "head_norms": head_norms,
                "cache_index": index,
                "num_heads": HQ,
                "rope_table": table,
                "input_norm": norm(),
                "post_norm": norm(),
                "residual_multiplier": multiplier,
                "projections": projections,
            }
        )
        if gemma_windows is not None:
            layers[-1]["feedforward_norms"] = (norm()[0], 1e-6, norm()[0], 1e-5)
            layers[-1]["window"] = gemma_windows[i]
            layers[-1]["activation"] = "gelu_tanh"
    return layer_arguments(layers)


def _tables(B, T, gen):
    out = []
    for rot in (D, D // 2):  # full, then partial rotary
        angle = torch.rand(B, T, rot, generator=gen) * 6
        out += [angle.cos(), angle.sin()]
    return out


def _native_and_reference(
    x, tensors, ints, floats, kv, lens, mask, slots, rope, scale, max_kv_len=0
):
    """Both backends' outputs and caches (each on its own copy of ``kv``), checked to agree
    within float32 rounding."""
    out, kvs = [], []
    for backend in ("native", "reference"):
        cache = kv.clone()
        out.append(
            decoder_layers(
                x,
                tensors,
                ints,
                floats,
                cache,
                lens,
                mask,
                slots,
                rope,
                scale,
                max_kv_len,
                backend=backend,
            )
        )
        kvs.append(cache)
    assert (out[0] - out[1]).abs().max() <= 1e-5 * out[1].abs().max()
    assert (kvs[0] - kvs[1]).abs().max() <= 1e-5 * kvs[1].abs().max()
    return out, kvs


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize(
    "kinds", [["dense"], ["packed", "Q8_0"], ["Q4_1", "Q5_0", "Q4_0", "dense"]], ids=str
)
@pytest.mark.parametrize("T", [1, 5])
def test_native_matches_reference(T, kinds, tree):
    gen = torch.Generator().manual_seed(T + 7 * len(kinds))
    B, B_max, S = 2, 3, 40
    lens = torch.tensor([9, 0, 17], dtype=torch.int32)
    slots = lens[:B, None].long() + torch.arange(T)
    tensors, ints, floats = _layers(
        kinds, gen, cache_indices=[2, 0, 3], rope_tables=[0, -1, 1], multiplier=0.75
    )
    kv = torch.randn(4, 2, B_max, HKV, S, D, generator=gen)
    x = torch.randn(B * T, H, generator=gen)
    mask = None
    if tree:  # a root, two children, a grandchild under the first ...
        parents = [-1, 0, 0, 1, 3][:T]
        bits = []
        for i, p in enumerate(parents):
            bits.append((1 << i) | (bits[p] if p >= 0 else 0))
        mask = torch.tensor([bits] * B, dtype=torch.int64)
    out, kvs = _native_and_reference(
        x, tensors, ints, floats, kv, lens, mask, slots, _tables(B, T, gen), D**-0.5
    )
    assert out[0].shape == (B * T, H)
    assert torch.equal(kvs[0][1], kv[1])  # layer 1 of the cache is no layer's


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("max_kv_len", [0, 12, 40], ids=["exact", "within", "past"])
def test_gemma_layers_and_windows_match_reference(T, max_kv_len):
    """Norms after attention and the MLP, GeGLU and sliding windows (7 and 11 tokens, one
    layer global): where the call reaches past a window (the caller's ``max_kv_len``, or
    the exact one: rows at 9 and 17 cached tokens) each query attends over its own
    window. Native against the reference, and a windowed query equal to the same query
    decoded alone at its position, bit for bit."""
    gen = torch.Generator().manual_seed(5 + T)
    B, B_max, S = 2, 3, 40
    lens = torch.tensor([9, 17, 0], dtype=torch.int32)
    slots = lens[:B, None].long() + torch.arange(T)
    windows = [7, None, 11]
    tensors, ints, floats = _layers(
        ["Q8_0", "dense"], gen, [0, 1, 2], [0, -1, 1], 1.0, gemma_windows=windows
    )
    kv = torch.randn(3, 2, B_max, HKV, S, D, generator=gen)
    x = torch.randn(B * T, H, generator=gen)
    rope = _tables(B, T, gen)
    out, kvs = _native_and_reference(
        x, tensors, ints, floats, kv, lens, None, slots, rope, D**-0.5, max_kv_len
    )
    if T > 1 and max_kv_len != 12:
        # the last query of each row decoded alone (its keys and values as the block wrote
        # them), through the native op: the same bits
        cache = kvs[0].clone()
        last = torch.arange(B) * T + T - 1
        one = [r[:, T - 1 : T].contiguous() for r in rope]
        alone = decoder_layers(
            x[last],
            tensors,
            ints,
            floats,
            cache,
            lens + T - 1,
            None,
            slots[:, -1:],
            one,
            D**-0.5,
            max_kv_len,
            backend="native",
        )
        assert torch.equal(alone, out[0][last])
    with pytest.raises(RuntimeError, match="takes no tree mask past the window"):
        mask = torch.ones(B, T, dtype=torch.int64)
        torch.ops.osd.decoder_layers(
            x, tensors, ints, floats, kv.clone(), lens, mask, slots, rope, 1.0, 40
        )


def test_no_layers_return_the_input():
    x = torch.randn(3, H)
    kv = torch.zeros(1, 2, 3, HKV, 8, D)
    lens = torch.zeros(3, dtype=torch.int32)
    out = torch.ops.osd.decoder_layers(
        x, [], [], [], kv, lens, None, torch.zeros(3, 1, dtype=torch.long), [], 1.0
    )
    assert torch.equal(out, x)


def test_bad_arguments_name_the_problem():
    gen = torch.Generator().manual_seed(0)
    tensors, ints, floats = _layers(["dense"], gen, [0], [0], 1.0)
    kv = torch.zeros(1, 2, 1, HKV, 8, D)
    lens = torch.zeros(1, dtype=torch.int32)
    slots = torch.zeros(1, 1, dtype=torch.long)
    x = torch.randn(1, H)
    rope = _tables(1, 1, gen)
    op = torch.ops.osd.decoder_layers
    with pytest.raises(RuntimeError, match="a layer"):
        op(x, tensors, ints[:-1], floats, kv, lens, None, slots, rope, 1.0)
    with pytest.raises(RuntimeError, match="cache index"):
        op(x, tensors, [5, *ints[1:]], floats, kv, lens, None, slots, rope, 1.0)
    with pytest.raises(RuntimeError, match="RoPE table"):
        op(x, tensors, ints, floats, kv, lens, None, slots, rope[:1], 1.0)
    with pytest.raises(RuntimeError, match="norm"):
        op(x, [None, *tensors[1:]], ints, floats, kv, lens, None, slots, rope, 1.0)
    with pytest.raises(RuntimeError, match=r"x must be \[B T, H\]"):
        op(torch.randn(2, H), tensors, ints, floats, kv, lens, None, slots, rope, 1.0)
    with pytest.raises(ValueError, match="float32 CPU"):
        decoder_layers(
            x.double(), tensors, ints, floats, kv, lens, None, slots, rope, 1.0, backend="native"
        )


def test_opcheck():
    """Schema, fake (meta) implementation and the cache's mutation annotation."""
    gen = torch.Generator().manual_seed(1)
    tensors, ints, floats = _layers(["dense", "Q8_0"], gen, [1, 0], [0, -1], 1.0)
    kv = torch.randn(2, 2, 2, HKV, 8, D, generator=gen)
    lens = torch.tensor([2, 3], dtype=torch.int32)
    slots = lens[:, None].long()
    args = (torch.randn(2, H), tensors, ints, floats, kv, lens, None, slots, _tables(2, 1, gen))
    torch.library.opcheck(torch.ops.osd.decoder_layers.default, (*args, 0.25))
