"""quant_linear with int8 activations (``ggml_type`` 1002 / 1003 / 1006 / 1008 / 1012 / 1014:
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K blocks regrouped 16 rows at a time,
``osd_kernels.quant_x16``): the regrouping round-trips and keeps the weights;
the C++ kernel equals its PyTorch reference bit for bit on the AMX path (calls of many
rows), the AVX-512 VNNI path and the portable one, on odd shapes, with bias and norm; a
row's result never depends on the other rows; the error against the float32 product is
the activations' 8-bit rounding; models and the engine (``quantized="int8"``):
speculative greedy output equals plain greedy output token for token, and the default on
a VNNI CPU; bad input; opcheck."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import osd
import osd_kernels
from osd.models.gguf import GGMLType
from osd.models.loading import load_model
from osd.models.quant import QuantLinear, use_int8_activations
from osd_kernels.quant_linear import dequantize_blocks, dequantize_weight, quant_linear
from osd_kernels.quant_x16 import (
    CODES_16,
    CODES_32,
    X16_OFFSET,
    repack_codes,
    quant_linear_x16_reference,
    quantize_activations,
    repack_x16,
    unpack_x16,
    x16_block,
    x16_factors,
)
from tests.test_gguf import T, VOCAB, tiny_hf_model, to_gguf
from tests.test_quant_models import k_quant_gguf
from tests.test_quant_linear_blocks import _blocks
from tests.test_speculative import prompts_of

TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K]
SHAPES = [(1, 1, 16), (2, 3, 32), (3, 2, 48), (5, 18, 64), (8, 1, 16), (9, 2, 32), (13, 4, 16)]
SHAPES += [(20, 3, 48), (70, 2, 16)]  # (M, K / 32, N): passes of 8 rows, tails, prefill sizes
SHAPES += [(34, 7, 32)]  # AMX: passes of 12 rows, rounds of 4 blocks and a tail


def _path(monkeypatch, path):
    """``default`` (AMX tiles for calls of 32 rows and more where the CPU has them), ``vnni``
    (AVX-512 VNNI only), ``portable``."""
    if path == "portable":
        monkeypatch.setenv("OSD_NO_AVX512", "1")
    if path == "vnni":
        monkeypatch.setenv("OSD_NO_AMX", "1")


native = pytest.mark.skipif(not osd_kernels.native_available(), reason="native build missing")


def _case(t, M, kb, N, seed):
    """Blocks of ``N`` rows and ``x [M, K]``: ``K`` is ``kb`` blocks of 32, or for the
    K-quants that many rounded up to whole super-blocks of 256."""
    K = 32 * kb if t not in (GGMLType.Q4_K, GGMLType.Q6_K) else 256 * -(-kb // 8)
    blocks = _blocks(t, N, K, seed, scale=0.05).reshape(N, -1)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    return blocks, x


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_repack_round_trips_and_keeps_the_weights(t):
    blocks, x = _case(t, 1, 2, 48, 1)
    packed, xt = repack_x16(blocks, int(t))
    weights, size = x16_block(xt)
    assert xt == X16_OFFSET + int(t) and packed.shape == (48, x.shape[1] // weights * size)
    assert packed.shape == blocks.shape or t == GGMLType.Q4_K  # its 148 bytes for 144
    assert torch.equal(unpack_x16(packed, xt)[0], blocks)
    w = dequantize_blocks(blocks, int(t))
    assert torch.equal(dequantize_blocks(packed, xt), w)
    u, d, m = x16_factors(blocks, int(t))  # the kernel's reading: d * u + m, exactly
    assert torch.equal((u * d[..., None] + m[..., None]).reshape(w.shape), w)
    assert u.min() >= 0 and u.max() <= 255


@native
@pytest.mark.parametrize("path", ["default", "vnni", "portable"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_kernel_equals_reference(monkeypatch, t, path):
    _path(monkeypatch, path)
    for i, (M, kb, N) in enumerate(SHAPES):
        blocks, x = _case(t, M, kb, N, 10 + i)
        packed, xt = repack_x16(blocks, int(t))
        bias = torch.randn(N) if i % 2 else None
        got = torch.ops.osd.quant_linear(x, packed, torch.empty(0), None, bias, None, 1e-6, xt)
        want = quant_linear_x16_reference(x, packed, xt, bias)
        assert torch.equal(got, want), (t.name, M, kb, N)
        # with the RMSNorm prologue: the normalised rows, then the same product; the
        # kernel's norm and the reference's may round a row an ulp apart, which can move
        # an int8 code by one, so each is checked against the float product of the
        # normalised rows within the activations' 8-bit rounding (half a step a weight)
        w = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(i)) + 0.5
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        weight = dequantize_blocks(packed, xt).double()
        exact = normed.double() @ weight.T
        step = (quantize_activations(normed)[1] / 2).repeat_interleave(32, dim=1).double()
        bound = step @ weight.abs().T * 1.01 + 1e-4
        for backend in ("auto", "reference"):
            got = quant_linear(
                x, packed, torch.empty(0), norm_weight=w, eps=1e-5, ggml_type=xt, backend=backend
            )
            assert torch.all((got.double() - exact).abs() <= bound), (t.name, M, kb, N, backend)


@native
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_rows_are_independent_and_paths_agree(monkeypatch, t):
    blocks, x = _case(t, 45, 5, 64, 3)  # 5 passes: the blocks unpacked once a group
    packed, xt = repack_x16(blocks, int(t))

    def run(rows):
        return torch.ops.osd.quant_linear(rows, packed, torch.empty(0), None, None, None, 1e-6, xt)

    full = run(x)
    assert torch.equal(full, torch.cat([run(x[i : i + 1]) for i in range(x.shape[0])]))
    assert torch.equal(full[3:11], run(x[3:11]))
    monkeypatch.setenv("OSD_NO_AVX512", "1")
    assert torch.equal(full, run(x))


@native
@pytest.mark.skipif(not osd_kernels.use_amx(), reason="the CPU or the OS gives no AMX-INT8 tiles")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_amx_equals_vnni(monkeypatch, t):
    """Calls that run on tiles (32 rows and more, in passes of up to 16; Q6_K stays on
    VNNI), with every block count a round of 4 can leave: the same bits as VNNI."""
    for M, kb in [(32, 1), (33, 5), (40, 9), (47, 2), (64, 6), (100, 3)]:
        blocks, x = _case(t, M, kb, 48, M + kb)
        packed, xt = repack_x16(blocks, int(t))
        bias = torch.randn(48)
        monkeypatch.delenv("OSD_NO_AMX", raising=False)
        got = torch.ops.osd.quant_linear(x, packed, torch.empty(0), None, bias, None, 1e-6, xt)
        monkeypatch.setenv("OSD_NO_AMX", "1")
        want = torch.ops.osd.quant_linear(x, packed, torch.empty(0), None, bias, None, 1e-6, xt)
        assert torch.equal(got, want), (t.name, M, kb)


@native
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_error_is_the_activations_rounding(t):
    """Against the float32 product: each activation moves by at most half its block's step
    (max|x| / 254), so |error| <= sum over blocks of step / 2 * sum |w|."""
    blocks, x = _case(t, 6, 8, 32, 5)
    packed, xt = repack_x16(blocks, int(t))
    w = dequantize_blocks(blocks, int(t))
    got = quant_linear(x, packed, torch.empty(0), ggml_type=xt)
    exact = (x.double() @ w.double().T).float()
    q, dx, _ = quantize_activations(x)
    assert torch.all((q.abs() <= 127) & (q == q.round()))
    step = (dx / 2).repeat_interleave(32, dim=1).double()  # [M, K]
    bound = step @ w.abs().double().T
    assert torch.all((got.double() - exact.double()).abs() <= bound * 1.001 + 1e-5)
    assert ((got - exact).norm() / exact.norm()) < 0.02


def test_bad_input_names_the_problem():
    blocks, x = _case(GGMLType.Q4_1, 2, 2, 32, 7)
    with pytest.raises(ValueError, match="multiple of 16"):
        repack_x16(blocks[:24], 3)
    with pytest.raises(ValueError, match="Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K"):
        repack_x16(blocks, int(GGMLType.Q5_1))
    packed, xt = repack_x16(blocks, 3)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_linear(x, packed[:8], torch.empty(0), ggml_type=xt, backend="native")
    with pytest.raises(ValueError, match="ggml_type"):
        quant_linear(x, packed, torch.empty(0), ggml_type=1005, backend="native")
    if osd_kernels.native_available():
        with pytest.raises(RuntimeError, match="multiple of 16"):
            torch.ops.osd.quant_linear(x, packed[:8], torch.empty(0), None, None, None, 1e-6, xt)


@native
def test_opcheck():
    blocks, x = _case(GGMLType.Q8_0, 3, 2, 32, 9)
    packed, xt = repack_x16(blocks, 8)
    args = (x, packed, torch.empty(0), None, torch.randn(32), None, 1e-6, xt)
    torch.library.opcheck(torch.ops.osd.quant_linear.default, args)


def test_quant_linear_layer_regroups_and_selects_rows():
    blocks, x = _case(GGMLType.Q4_1, 4, 2, 48, 11)
    layer = QuantLinear(
        blocks, blocks.new_empty((48, 0), dtype=torch.float32), None, None, "Q4_1", 3
    )
    w = layer.dequantize()
    assert layer.use_int8_activations() and layer.ggml_type == X16_OFFSET + 3
    assert torch.equal(layer.dequantize(), w) and layer.in_features == 64
    rows = torch.tensor([1, 5, 7, 9, 10, 11, 12, 13, 20, 21, 22, 30, 31, 40, 41, 47])
    picked = layer.select_rows(rows)
    assert picked.ggml_type == X16_OFFSET + 3 and torch.equal(picked.dequantize(), w[rows])
    odd = layer.select_rows(rows[:5])  # 5 rows: kept as the file's blocks
    assert odd.ggml_type == 3 and torch.equal(odd.dequantize(), w[rows[:5]])


@pytest.fixture(scope="module")
def q41(tmp_path_factory):
    """A tiny Q4_1 model whose every layer can be regrouped (320 vocabulary rows)."""
    path = tmp_path_factory.mktemp("q41x16") / "m.gguf"
    return str(to_gguf(tiny_hf_model("llama", seed=44, vocab=320), path, T.Q4_1))


@native
@pytest.mark.parametrize(
    "params",
    [osd.SamplingParams(16), osd.SamplingParams(16, temperature=0.9, top_p=0.9, seed=3)],
    ids=["greedy", "sampled"],
)
def test_speculation_on_int8_activations_emits_plain_decodings_tokens(q41, params):
    """With int8 activations a rounding difference in a layer's input can move a code by
    one, so decode and verify forwards must compute every row the same way (the GEMVs and
    the attention both are row-invariant): speculative decoding (a draft model, chains and
    trees) then emits what plain decoding emits, in a batch too."""
    target = load_model(q41, quantized="int8")
    assert use_int8_activations(target) == 0  # already regrouped, or no VNNI here
    draft = load_model(tiny_hf_model("llama", seed=47, vocab=320))
    prompts = prompts_of([9, 4, 13, 30], vocab=VOCAB, seed=45)
    kw = dict(max_batch_size=4, max_seq_len=80)
    plain = osd.Engine(target, **kw).generate(prompts, params)
    for spec in (
        osd.SpecConfig(num_draft_tokens=4),
        osd.SpecConfig(num_draft_tokens=3, tree=[(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]),
    ):
        got = osd.Engine(target, draft=[draft], spec=spec, **kw).generate(prompts, params)
        if params.temperature == 0:
            assert [o.token_ids for o in got] == [o.token_ids for o in plain], spec
    alone = [osd.Engine(target, **kw).generate([p], params)[0].token_ids for p in prompts]
    if params.temperature == 0:
        assert alone == [o.token_ids for o in plain]


@native
def test_outputs_do_not_depend_on_how_prompts_are_cut_or_batched(q41):
    """A prompt prefilled in pieces of 7, 40 or 200 tokens, alone or beside another, leaves
    the same cache bit for bit and gives the same logits (the GEMVs and the attention are
    row-invariant, prefill included): with int8 activations, where one bit can move a code,
    a request's output then never depends on how the scheduler cut or batched its prompt;
    and so the engine's greedy outputs, alone or together."""
    target = load_model(q41, quantized="int8")
    prompts = prompts_of([150, 90], vocab=VOCAB, seed=49)
    ids = torch.tensor([prompts[0]])
    other = torch.tensor([prompts[1] + prompts[1][:60]])
    runs = []
    with torch.inference_mode():
        for chunk in (7, 40, 200):
            for batch in (ids, torch.cat([ids, other])):
                cache = target.new_cache(batch.shape[0], 160)
                lens = torch.tensor([150] * batch.shape[0], dtype=torch.int32)
                logits = target.prefill(batch, cache, lens, chunk=chunk)
                runs.append((logits[0], cache.kv[:, :, 0, :, :150].clone()))
    for logits, kv in runs[1:]:
        assert torch.equal(logits, runs[0][0]) and torch.equal(kv, runs[0][1])
    params = osd.SamplingParams(12)
    outs = []
    for chunk in (7, 200):
        eng = osd.Engine(target, max_batch_size=2, max_seq_len=180, prefill_chunk=chunk)
        outs.append([o.token_ids for o in eng.generate(prompts, params)])
        outs.append([eng.generate([p], params)[0].token_ids for p in prompts])
    assert all(o == outs[0] for o in outs)


@native
def test_int8_activations_are_the_cpu_default_where_vnni_runs(q41):
    """``Engine.from_pretrained(gguf)`` regroups the Q4_1 layers for int8 activations on a
    VNNI CPU (``quantized=None``); ``quantized=True`` keeps the float32 product (the
    dequantized model's tokens), ``quantized="int8"`` asks for int8 where it runs."""

    def types(engine):
        return {m.ggml_type for m in engine.model.modules() if isinstance(m, QuantLinear)}

    default = osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48)
    exact = osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48, quantized=True)
    assert types(exact) == {3}
    assert types(default) == ({X16_OFFSET + 3} if osd_kernels.use_vnni() else {3})
    with pytest.raises(ValueError, match="'int8'"):
        osd.Engine.from_pretrained(q41, quantized="int4")


@native
def test_int8_targets_keep_their_caches_in_float16(q41):
    """Where a GGUF target multiplies int8 activations its caches keep K/V in float16
    (``kv_dtype`` None), which attention widens as it reads; ``kv_dtype=torch.float32``
    keeps float32, float32 activations keep float32, and a dtype the kernels do not read
    is refused. The half cache moves the logits less than the int8 activations
    themselves do (against float32 activations)."""
    default = osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48)
    full = osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48, kv_dtype=torch.float32)
    exact = osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48, quantized=True)
    half = torch.float16 if osd_kernels.use_vnni() else torch.float32
    assert default.cache.kv.dtype == half and full.cache.kv.dtype == torch.float32
    assert exact.cache.kv.dtype == torch.float32
    ids = torch.tensor([prompts_of([40], vocab=VOCAB, seed=50)[0]])
    logits = []
    with torch.inference_mode():
        for model in (default.model, full.model, exact.model):
            cache = model.new_cache(1, 48)
            logits.append(model.prefill(ids, cache, torch.tensor([40], dtype=torch.int32)))
    if osd_kernels.use_vnni():
        half_error = (logits[0] - logits[1]).abs().max().item()
        assert 0 < half_error < (logits[1] - logits[2]).abs().max().item()
    for bad in (torch.bfloat16, "float64", "half-ish"):
        with pytest.raises(ValueError, match="kv_dtype"):
            osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48, kv_dtype=bad)


@native
def test_head_dims_the_fast_attention_does_not_read_keep_a_float32_cache(tmp_path):
    """A head dim that is not a multiple of 16 keeps float32 K/V beside int8 activations
    (the AVX-512 attention path reads float16 only at such widths; elsewhere the keys
    would be widened every call)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=None,
    )
    path = to_gguf(LlamaForCausalLM(cfg), tmp_path / "d24.gguf", T.Q4_1)
    engine = osd.Engine.from_pretrained(str(path), max_batch_size=1, max_seq_len=32)
    types = {m.ggml_type for m in engine.model.modules() if isinstance(m, QuantLinear)}
    assert types == ({X16_OFFSET + 3} if osd_kernels.use_vnni() else {3})
    assert engine.cache.kv.dtype == torch.float32


def test_a_half_cache_keeps_speculation_lossless():
    """A float32 model over a float16 cache (``kv_dtype=torch.float16``): speculative
    greedy decoding (a draft's chains and trees) emits plain decoding's tokens, since
    both read the same rounded K/V."""
    target = load_model(tiny_hf_model("llama", seed=44, vocab=320))
    target.kv_dtype = torch.float16
    draft = load_model(tiny_hf_model("llama", seed=47, vocab=320))
    prompts = prompts_of([9, 4, 13, 30], vocab=VOCAB, seed=45)
    kw = dict(max_batch_size=4, max_seq_len=80)
    params = osd.SamplingParams(16)
    plain = osd.Engine(target, **kw)
    assert plain.cache.kv.dtype == torch.float16
    want = [o.token_ids for o in plain.generate(prompts, params)]
    for spec in (
        osd.SpecConfig(num_draft_tokens=4),
        osd.SpecConfig(num_draft_tokens=3, tree=[(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]),
    ):
        got = osd.Engine(target, draft=[draft], spec=spec, **kw).generate(prompts, params)
        assert [o.token_ids for o in got] == want, spec


def test_int8_activations_are_all_or_nothing(tmp_path):
    """A model with a layer that keeps float32 activations (here an output head of 300
    rows, not a multiple of 16) regroups none: that layer's prefill pieces past 64 rows
    round by their size, which an int8 layer after it could turn into another code."""
    path = to_gguf(tiny_hf_model("llama", seed=44), tmp_path / "m.gguf", T.Q4_1)
    model = load_model(path, quantized=True)
    assert use_int8_activations(model) == 0
    assert {m.ggml_type for m in model.modules() if isinstance(m, QuantLinear)} == {3}


@native
@pytest.mark.parametrize(
    "t,v", [(T.Q4_K, None), (T.Q6_K, None), (T.Q5_0, T.Q8_0)], ids=["Q4_K", "Q6_K", "Q5_0-v-Q8_0"]
)
def test_k_quant_and_q5_0_models_take_int8_activations(tmp_path, t, v):
    """The types of Q4_K_M / Q6_K files (Q4_K, Q6_K, and Q5_0 / Q8_0 where rows are not
    whole super-blocks) are regrouped too: every layer of such a model multiplies int8
    activations, its logits stay within the activations' rounding of the float32 product,
    and speculative greedy output (a chain and a tree) equals plain decoding's."""
    if not osd_kernels.use_vnni():
        pytest.skip("int8 activations need AVX-512 VNNI")
    path = k_quant_gguf(tmp_path / "k.gguf", t, v, seed=int(t), vocab=320)
    exact = load_model(path, quantized=True)
    target = load_model(path, quantized="int8")
    kinds = {m.ggml_type for m in target.modules() if isinstance(m, QuantLinear)}
    assert kinds and all(k > X16_OFFSET for k in kinds), kinds
    prompts = prompts_of([11, 5, 17], vocab=VOCAB, seed=61)
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        lens = torch.tensor([ids.shape[1]], dtype=torch.int32)
        a = exact.prefill(ids, exact.new_cache(1, 32), lens)[0, -1]
        b = target.prefill(ids, target.new_cache(1, 32), lens)[0, -1]
    assert float((a - b).norm() / a.norm()) < 0.05
    draft = load_model(tiny_hf_model("llama", seed=47, vocab=320))
    kw = dict(max_batch_size=3, max_seq_len=64)
    params = osd.SamplingParams(12)
    plain = [o.token_ids for o in osd.Engine(target, **kw).generate(prompts, params)]
    for spec in (
        osd.SpecConfig(num_draft_tokens=4),
        osd.SpecConfig(num_draft_tokens=3, tree=[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]),
    ):
        got = osd.Engine(target, draft=[draft], spec=spec, **kw).generate(prompts, params)
        assert [o.token_ids for o in got] == plain, spec


def _codes_case(M, kb, N, G, wide, mins, seed):
    """Codes and factors (``ggml_type`` 0): 8-bit signed codes or 4-bit nibbles, a scale
    (and min) per ``G`` weights; and ``x [M, 32 kb]``."""
    gen = torch.Generator().manual_seed(seed)
    K = 32 * kb
    if wide:
        q = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int64).to(torch.int8)
    else:
        q = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    scales = (torch.rand(N, K // G, generator=gen) - 0.5) * 0.02
    m = (torch.rand(N, K // G, generator=gen) - 0.5) * 0.1 if mins else None
    return q, scales, m, torch.randn(M, K, generator=gen)


@native
@pytest.mark.parametrize("path", ["default", "vnni", "portable"])
@pytest.mark.parametrize("G", [32, 16])
def test_codes_and_factors_regroup_and_equal_the_reference(monkeypatch, path, G):
    """The form osd holds other types in (Q5_1, Q5_K, Q2_K, Q3_K, IQ4, and fused
    projections of mixed types) regroups too: the weights are kept exactly, and the kernel
    equals its reference bit for bit (codes stored as code + 128, the offset taken off
    each dot product exactly)."""
    _path(monkeypatch, path)
    for i, (M, kb, N) in enumerate(SHAPES):
        q, scales, mins, x = _codes_case(M, kb, N, G, i % 2 == 0, i % 3 != 0, 30 + i)
        packed, xt = repack_codes(q, scales, mins)
        assert xt == (CODES_16 if G == 16 else CODES_32)
        w = dequantize_weight(q, scales, mins)
        assert torch.equal(dequantize_blocks(packed, xt), w)
        bias = torch.randn(N) if i % 2 else None
        got = torch.ops.osd.quant_linear(x, packed, torch.empty(0), None, bias, None, 1e-6, xt)
        assert torch.equal(got, quant_linear_x16_reference(x, packed, xt, bias)), (M, kb, N)
        exact = x @ w.T + (bias if bias is not None else 0)
        assert float((got - exact).norm() / exact.norm()) < 0.03


def test_codes_layer_regroups_and_selects_rows():
    """A layer of codes and factors regroups in place (the same weights) and selects output
    rows (a restricted head) regrouped again, or as codes when they are not 16 a group."""
    q, scales, mins, _ = _codes_case(3, 4, 48, 16, True, True, 5)
    layer = QuantLinear(q, scales, mins, None, "Q6_K")
    w = layer.dequantize()
    assert layer.use_int8_activations() and layer.ggml_type == CODES_16
    assert torch.equal(layer.dequantize(), w) and layer.in_features == 128
    rows = torch.arange(0, 48, 3)
    picked = layer.select_rows(rows)
    assert picked.ggml_type == CODES_16 and torch.equal(picked.dequantize(), w[rows])
    odd = layer.select_rows(rows[:5])
    assert odd.ggml_type == 0 and torch.equal(odd.dequantize(), w[rows[:5]])


def test_a_fused_projection_of_mixed_k_quants_takes_int8_activations(tmp_path):
    """Q4_K_M files keep some ``attn_v`` in Q6_K beside Q4_K ``attn_q`` / ``attn_k``: the
    fused projection is held as codes and factors (groups of 16), which are regrouped as
    well, so the whole model multiplies int8 activations; its greedy output with a draft
    equals plain decoding's."""
    if not osd_kernels.use_vnni():
        pytest.skip("int8 activations need AVX-512 VNNI")
    path = k_quant_gguf(tmp_path / "k.gguf", T.Q4_K, T.Q6_K, seed=5, vocab=320)
    model = load_model(path, quantized="int8")
    kinds = {m.ggml_type for m in model.modules() if isinstance(m, QuantLinear)}
    assert CODES_16 in kinds and all(k > X16_OFFSET for k in kinds), kinds
    prompts = prompts_of([11, 5], vocab=VOCAB, seed=62)
    kw = dict(max_batch_size=2, max_seq_len=48)
    params = osd.SamplingParams(10)
    plain = [o.token_ids for o in osd.Engine(model, **kw).generate(prompts, params)]
    draft = load_model(tiny_hf_model("llama", seed=47, vocab=320))
    spec = osd.SpecConfig(num_draft_tokens=3)
    got = osd.Engine(model, draft=[draft], spec=spec, **kw).generate(prompts, params)
    assert [o.token_ids for o in got] == plain
