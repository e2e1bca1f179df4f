"""The cached forward through the fused decode-layer kernels (osd/models/fused_layers.py),
forced on CPU tensors with the Triton kernels under the interpreter, against the unfused
forward of the same model: prefill, decode steps and a tree verify (tree mask, positions
from depths), logits and the whole KV cache. The decode steps (3 rows) take the
``decode_gemv`` layers, the other forwards the ``add_rms_norm`` / ``silu_mul`` layers.
``cpu`` (the default) and ``auto`` take the C++ kernels for CPU forwards of few rows,
float32 and quantized projections: those results equal the unfused forward's bit for bit.

float32: logits and cache within 1e-4 (the models' test tolerance; the fused path rounds
where the unfused one does, sums run in other orders). bfloat16: both forwards are
compared with the float32 model's; the fused one's error, mean and max, stays within 2x
and 3x the unfused one's (measured on the test model: mean 0.03-0.07 against 0.03-0.07,
max up to 2.3x, on logits of spread 2.4). The interpreter rounds float32 to bfloat16
toward zero where a GPU rounds to nearest, which biases its errors.
"""

import importlib

import pytest
import torch

from osd.models import fused_layers, load_model
from osd.models.quant import quantize_linears
from osd_kernels import native_available
from tests.test_models import VOCAB, _tree, tiny_hf_model

# Llama (tied head), biases on every projection, Qwen3's per-head q/k norms and head width
# 24, Granite's residual multiplier, Phi-4-mini's partial rotary with LongRoPE, SmolLM3's
# layer without RoPE, Gemma 3's sliding layer with a RoPE base of its own
FUSABLE = ("llama", "llama_bias", "qwen3", "granite", "phi3_longrope", "smollm3")
UNFUSABLE = ("gemma3", "olmo2", "mixtral")  # GeGLU and post-norms, post-norms, experts
# pre- and post-norms and GeGLU: the CPU path only (Gemma 2's soft caps: its Python loop)
CPU_ONLY = ("gemma3", "gemma2")


def _run(model, mode, monkeypatch):
    """Prefill (3 ragged rows), 3 decode steps and a tree verify; the logits of each
    forward and the final cache."""
    monkeypatch.setattr(fused_layers, "FUSED_LAYERS", mode)
    dev = model.device
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (3, 9), generator=gen).to(dev)
    lengths = torch.tensor([9, 4, 6], dtype=torch.int32, device=dev)
    parents = [-1, 0, 0, 1, 1, 2]
    masks, depths = _tree(parents)
    nodes = torch.randint(0, VOCAB, (3, len(parents)), generator=gen).to(dev)
    cache = model.new_cache(4, 32)
    out = []
    with torch.no_grad():
        out.append(model.prefill(ids, cache, lengths, chunk=5))
        for _ in range(3):
            step = torch.randint(0, VOCAB, (3, 1), generator=gen).to(dev)
            out.append(model(step, cache))
            cache.commit(torch.ones(3, dtype=torch.int32, device=dev), 1)
        out.append(
            model(
                nodes,
                cache,
                tree_mask=torch.tensor([masks] * 3, device=dev),
                depths=torch.tensor([depths] * 3, device=dev),
            )
        )
    return out, cache.kv


def _spy_on_kernels(monkeypatch) -> dict:
    """Count the calls of the Triton kernels' entry points (imported by the ops at
    each call, so patched here)."""
    calls = {}
    for op in ("add_rms_norm", "silu_mul", "rope_kv_write", "decode_gemv"):
        module = importlib.import_module(f"osd_kernels.triton.{op}")
        real = getattr(module, f"{op}_triton")

        def spy(*args, op=op, real=real, **kwargs):
            calls[op] = calls.get(op, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, f"{op}_triton", spy)
    return calls


@pytest.mark.parametrize("family", FUSABLE)
def test_fused_forward_matches_unfused(family, monkeypatch):
    model = load_model(tiny_hf_model(family))
    calls = _spy_on_kernels(monkeypatch)
    ref, ref_kv = _run(model, "off", monkeypatch)
    assert not calls
    got, got_kv = _run(model, "on", monkeypatch)
    # per layer: one rope_kv_write in each of the 6 forwards; in the 3 of more than 8 rows
    # (2 prefill pieces of 15 and 12 rows, the tree verify of 18) one silu_mul and two
    # add_rms_norm but for the first layer's input norm, in the 3 decode steps of 3 rows
    # four decode_gemv
    layers = model.config.num_layers
    assert calls == {
        "rope_kv_write": 6 * layers,
        "silu_mul": 3 * layers,
        "add_rms_norm": 3 * (2 * layers - 1),
        "decode_gemv": 3 * 4 * layers,
    }
    for a, b in zip(got, ref):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-4
    assert (got_kv - ref_kv).abs().max() <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("family", FUSABLE)
def test_fused_forward_matches_unfused_on_cuda(family, monkeypatch):
    """On CUDA ``auto`` takes the fused path (compiled kernels) for these models."""
    model = load_model(tiny_hf_model(family), device="cuda")
    calls = _spy_on_kernels(monkeypatch)
    ref, ref_kv = _run(model, "off", monkeypatch)
    got, got_kv = _run(model, "auto", monkeypatch)
    assert calls["rope_kv_write"] == 6 * model.config.num_layers
    for a, b in zip(got, ref):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-4
    assert (got_kv - ref_kv).abs().max() <= 1e-4


def test_skip_layers(monkeypatch):
    """Self-speculation's skipped layers: a prefill and a decode step with layer 0 bypassed,
    each through both fused layer kinds (15 rows, then 3)."""
    model = load_model(tiny_hf_model("llama"))
    skip = frozenset({0})
    gen = torch.Generator().manual_seed(8)
    ids, step = (
        torch.randint(0, VOCAB, (3, 5), generator=gen),
        torch.randint(0, VOCAB, (3, 1), generator=gen),
    )
    results = []
    for mode in ("off", "on"):
        monkeypatch.setattr(fused_layers, "FUSED_LAYERS", mode)
        cache = model.new_cache(3, 16)
        with torch.no_grad():
            first = model(ids, cache, skip_layers=skip)
            cache.commit(torch.full((3,), 5, dtype=torch.int32), 5)
            results.append((first, model(step, cache, skip_layers=skip), cache.kv.clone()))
    for a, b in zip(*results):
        assert (a - b).abs().max() <= 1e-4
    assert results[1][2][0].abs().max() == 0  # layer 0's cache never written


@pytest.mark.parametrize("family", UNFUSABLE)
def test_other_layers_keep_the_unfused_forward(family, monkeypatch):
    model = load_model(tiny_hf_model(family))
    monkeypatch.setattr(fused_layers, "FUSED_LAYERS", "on")
    x = torch.zeros(1, 1, model.config.hidden_size)
    with torch.no_grad():
        assert not fused_layers.use_fused(model, x)


def test_switch(monkeypatch):
    """cpu (the default) and auto: CPU float32 forwards of at most CPU_MAX_ROWS rows with
    the native build (auto: CUDA too); off and on as named; grad mode and a foreign dtype
    keep the unfused path; an unknown mode raises."""
    model = load_model(tiny_hf_model("llama"))
    x = torch.zeros(1, 1, model.config.hidden_size)
    wide = torch.zeros(1, fused_layers.CPU_MAX_ROWS + 1, model.config.hidden_size)
    modes = (("auto", native_available()), ("cpu", native_available()), ("off", False))
    with torch.no_grad():
        for mode, expected in (*modes, ("on", True)):
            monkeypatch.setattr(fused_layers, "FUSED_LAYERS", mode)
            assert fused_layers.use_fused(model, x) is expected
        assert fused_layers.use_fused(model, wide)  # "on": any number of rows
        assert not fused_layers.use_fused(model, x.bfloat16())
        for mode in ("auto", "cpu"):
            monkeypatch.setattr(fused_layers, "FUSED_LAYERS", mode)
            assert not fused_layers.use_fused(model, wide)
    assert not fused_layers.use_fused(model, x)  # grad enabled
    monkeypatch.setattr(fused_layers, "FUSED_LAYERS", "yes")
    with torch.no_grad(), pytest.raises(ValueError, match="FUSED_LAYERS"):
        fused_layers.use_fused(model, x)


def _spy_on_cpu_layers(monkeypatch) -> list:
    """The row counts of the forwards that take the C++ layers."""
    rows, real = [], fused_layers._cpu_layers

    def spy(model, x, *args):
        rows.append(x.shape[0] * x.shape[1])
        return real(model, x, *args)

    monkeypatch.setattr(fused_layers, "_cpu_layers", spy)
    return rows


def _spy_on_cpp_loop(monkeypatch) -> list:
    """The row counts of the forwards whose layers ran as one ``decoder_layers`` call."""
    rows, real = [], fused_layers._decoder_layers

    def spy(x, *args):
        rows.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(fused_layers, "_decoder_layers", spy)
    return rows


@pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
@pytest.mark.parametrize("loop", ["cpp", "python"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "Q8_0"])
@pytest.mark.parametrize("max_rows", [16, 64])
@pytest.mark.parametrize("family", FUSABLE)
def test_cpu_native_forward_equals_unfused(family, max_rows, quantized, loop, monkeypatch):
    """``cpu`` (as ``auto``) on CPU: the prefill pieces (15 and 12 rows) and the decode
    steps (3) through the C++ layers, with a limit of 64 rows the tree verify (18) too
    (the tiny model's MLP output stays float, so CPU_MAX_ROWS_QUANTIZED does not apply);
    logits and cache bit for bit, the layers looped in C++ (``decoder_layers``, where the
    attention is not too wide for the C++ kernel) or in Python."""
    model = load_model(tiny_hf_model(family))
    if quantized:
        quantize_linears(model, "Q8_0")
    ref, ref_kv = _run(model, "off", monkeypatch)
    ref_kv = ref_kv.clone()
    monkeypatch.setattr(fused_layers, "CPU_MAX_ROWS", max_rows)
    monkeypatch.setattr(fused_layers, "LOOP_IN_CPP", loop == "cpp")
    rows = _spy_on_cpu_layers(monkeypatch)
    in_cpp = _spy_on_cpp_loop(monkeypatch)
    got, got_kv = _run(model, "cpu", monkeypatch)
    assert rows == [15, 12, 3, 3, 3] + ([18] if max_rows == 64 else [])
    # 4 heads over 2 KV heads: T * 2 query rows a KV head, at most 48 for the C++ attention
    expected = [r for r in rows if r in (3, 18) or r // 3 * 2 <= 48]
    assert in_cpp == ([] if loop == "python" else expected)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.equal(got_kv, ref_kv)


@pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
@pytest.mark.parametrize("loop", ["cpp", "python"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_quantized_projections_take_larger_forwards(family, loop, monkeypatch):
    """Every projection block-quantized (an MLP width of whole blocks): forwards of up to
    CPU_MAX_ROWS_QUANTIZED rows take the C++ layers, the tree verify of 18 rows included,
    since both forwards call ``quant_linear`` alike: logits and cache bit for bit."""
    model = load_model(tiny_hf_model(family, intermediate_size=96))
    quantize_linears(model, "Q8_0")
    assert fused_layers._quantized_projections(model)
    ref, ref_kv = _run(model, "off", monkeypatch)
    ref_kv = ref_kv.clone()
    monkeypatch.setattr(fused_layers, "LOOP_IN_CPP", loop == "cpp")
    rows = _spy_on_cpu_layers(monkeypatch)
    got, got_kv = _run(model, "cpu", monkeypatch)
    assert rows == [15, 12, 3, 3, 3, 18]
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.equal(got_kv, ref_kv)
    monkeypatch.setattr(fused_layers, "CPU_MAX_ROWS_QUANTIZED", 16)
    rows.clear()
    _run(model, "cpu", monkeypatch)
    assert rows == [15, 12, 3, 3, 3]


@pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
@pytest.mark.parametrize("loop", ["cpp", "python"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "Q8_0"])
@pytest.mark.parametrize("family", [*CPU_ONLY, "mistral_window", "qwen2_window"])
def test_cpu_path_takes_sandwich_norms_geglu_and_windows(family, quantized, loop, monkeypatch):
    """Gemma's layers (a norm before and after attention and the MLP, GeGLU) and sliding
    windows take the CPU path: logits and cache bit for bit the unfused forward's. The
    C++ loop takes them too, causal forwards past the windows included (each query over
    its window, as decoded alone), except Gemma 2's soft-capped attention; the tree verify,
    past the windows, takes the Python loop."""
    model = load_model(tiny_hf_model(family))
    if quantized:
        quantize_linears(model, "Q8_0")
    ref, ref_kv = _run(model, "off", monkeypatch)
    ref_kv = ref_kv.clone()
    monkeypatch.setattr(fused_layers, "LOOP_IN_CPP", loop == "cpp")
    rows = _spy_on_cpu_layers(monkeypatch)
    in_cpp = _spy_on_cpp_loop(monkeypatch)
    got, got_kv = _run(model, "cpu", monkeypatch)
    assert rows == [15, 12, 3, 3, 3]
    # the prefill pieces of 5 and 4 rows a sequence are within the C++ attention's rows
    # (T x query heads per KV head <= 16) where the heads are not grouped
    group = model.layers[0].num_heads // model.layers[0].num_kv_heads
    fits = [r for r in rows if r // 3 * group <= 16]
    assert in_cpp == ([] if loop == "python" or family == "gemma2" else fits)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.equal(got_kv, ref_kv)


@pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
def test_cpp_loop_follows_replaced_and_packed_weights(monkeypatch):
    """The C++ loop's arguments are rebuilt when a weight or a module is replaced, a weight
    packed, or changed in place under its packed copy: each forward equals the Python
    loop's bit for bit."""
    model = load_model(tiny_hf_model("llama"))
    ids = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(fused_layers, "FUSED_LAYERS", "cpu")

    def both():
        out = []
        for loop in (True, False):
            monkeypatch.setattr(fused_layers, "LOOP_IN_CPP", loop)
            with torch.no_grad():
                out.append(model(ids, model.new_cache(2, 8)))
        assert torch.equal(out[0], out[1])
        return out[0]

    first = both()
    layer = model.layers[0]
    layer.wo.weight = torch.nn.Parameter(layer.wo.weight.detach() * 2)  # replaced
    second = both()
    assert not torch.equal(first, second)
    replaced = torch.nn.Linear(layer.wo.in_features, layer.wo.out_features, bias=False)
    with torch.no_grad():
        replaced.weight.copy_(layer.wo.weight / 2)
    layer.wo = replaced  # the module itself
    assert torch.equal(both(), first)
    layer.wo.weight = torch.nn.Parameter(layer.wo.weight.detach() * 2)
    model.pack_weights()  # the Python loop takes the packed copies (other sum order)
    packed = both()
    assert (packed - second).abs().max() <= 1e-4
    with torch.no_grad():
        layer.w_down.weight.mul_(0.5)  # in place: the packed copy is stale
    assert (both() - packed).abs().max() > 1e-3


@pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
def test_cpu_native_skip_layers_and_cache_views(monkeypatch):
    """Skipped layers keep their cache untouched; a cache of other rows (``rows``: another
    tensor) gets views of its own."""
    model = load_model(tiny_hf_model("llama"))
    skip = frozenset({0})
    ids = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(8))
    results = []
    for mode in ("off", "cpu"):
        monkeypatch.setattr(fused_layers, "FUSED_LAYERS", mode)
        cache = model.new_cache(4, 16)
        with torch.no_grad():
            first = model(ids, cache, skip_layers=skip)
            part = cache.rows(2, 2)
            second = model(ids, part)
        results.append((first, second, cache.kv.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[1][2][0, :, :2].abs().max() == 0  # layer 0 of rows 0-1 never written


def test_fused_forward_bf16(monkeypatch):
    """Against the float32 model, the fused bfloat16 forward errs like the unfused one."""
    hf = tiny_hf_model("llama")
    exact, _ = _run(load_model(hf), "off", monkeypatch)
    model = load_model(hf, dtype=torch.bfloat16)
    calls = _spy_on_kernels(monkeypatch)
    ref, _ = _run(model, "off", monkeypatch)
    got, _ = _run(model, "on", monkeypatch)
    assert calls["rope_kv_write"] == 6 * model.config.num_layers
    for a, b, e in zip(got, ref, exact):
        fused, unfused = (a - e).abs(), (b - e).abs()
        assert fused.mean() <= 2 * unfused.mean() and fused.max() <= 3 * unfused.max()
