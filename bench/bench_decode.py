"""Plain decoding: tokens/s of our runtime against transformers ``generate``, same weights.

CPU, fp32, greedy, random Llama weights, prompts of 16 tokens, ``N`` new tokens per
sequence (EOS disabled so every run generates exactly ``N``). Tokens/s counts generated
tokens of the whole batch over the wall time of one ``generate`` call (prefill included).

Side by side: every timed round of our engine (the pytest-benchmark measurement) is
preceded by one transformers ``generate`` on the same prompts (run in the round's setup
and timed by hand), so both see the same machine state. Ratios compare the best rounds:
on a shared machine the minimum is the least disturbed measurement.

Sizes: ``4M`` (4 layers, hidden 256), ``90M`` (12 layers, hidden 768) and ``moe`` (a
Qwen3-MoE: 4 layers, hidden 512, 8 experts of width 512, 2 per token). Batches 1 and 8.
Providers: ``osd`` (default attention backend: the SDPA reference on CPU) and
``osd-native-attn`` (the C++ tree-attention kernel). ``OSD_BENCH_FULL=1`` generates more
tokens and takes more rounds; ``OSD_BENCH_THREADS`` sets torch's thread count (default 1).

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_decode.py \\
        --benchmark-json=results/bench_decode.json
"""

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import osd
from bench.common import FULL

NEW_TOKENS = 128 if FULL else 32
ROUNDS = {"4M": 10 if FULL else 5, "90M": 5 if FULL else 3, "moe": 5 if FULL else 3}
PROMPT_LEN = 16
SIZES = {
    "4M": dict(
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=4,
        vocab_size=4096,
    ),
    "90M": dict(
        num_hidden_layers=12,
        hidden_size=768,
        intermediate_size=2048,
        num_attention_heads=12,
        vocab_size=8192,
    ),
    "moe": dict(
        num_hidden_layers=4,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        norm_topk_prob=True,
    ),
}
PROVIDERS = ["osd", "osd-native-attn"]
CASES = [(size, batch, provider) for size in SIZES for batch in (1, 8) for provider in PROVIDERS]
pytestmark = pytest.mark.usefixtures("torch_threads")

_models: dict = {}


def _hf_model(size: str):
    """Random weights drawn wide (std 0.1, unit norms) so greedy decoding has no near-ties."""
    if size not in _models:
        _models.clear()
        config, cls = (
            (Qwen3MoeConfig, Qwen3MoeForCausalLM)
            if size == "moe"
            else (LlamaConfig, LlamaForCausalLM)
        )
        cfg = config(
            **SIZES[size],
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=None,
        )
        model = cls(cfg).eval()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(
                    torch.ones_like(p)
                    if "norm" in name
                    else 0.1 * torch.randn(p.shape, generator=gen)
                )
        _models[size] = model
    return _models[size]


def _prompts(batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(0, 4096, (batch, PROMPT_LEN), generator=gen)


def _hf_generate(model, ids: torch.Tensor) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    return out[:, PROMPT_LEN:].tolist()


@pytest.mark.parametrize("size,batch,provider", CASES, ids=[f"{s}-b{b}-{p}" for s, b, p in CASES])
def test_decode(benchmark, size, batch, provider):
    hf = _hf_model(size)
    ids = _prompts(batch)
    reference = _hf_generate(hf, ids)
    backend = "native" if provider == "osd-native-attn" else "auto"
    engine = osd.Engine.from_pretrained(
        hf, max_batch_size=batch, max_seq_len=PROMPT_LEN + NEW_TOKENS, attention_backend=backend
    )
    params = osd.SamplingParams(NEW_TOKENS)
    prompts = ids.tolist()
    assert [o.token_ids for o in engine.generate(prompts, params)] == reference, (
        "greedy output differs from transformers"
    )

    hf_times = []

    def transformers_round():
        start = time.perf_counter()
        _hf_generate(hf, ids)
        hf_times.append(time.perf_counter() - start)

    benchmark.pedantic(
        engine.generate,
        args=(prompts, params),
        setup=transformers_round,
        rounds=ROUNDS[size],
        iterations=1,
        warmup_rounds=1,
    )
    tokens = batch * NEW_TOKENS
    ours, theirs = tokens / benchmark.stats.stats.min, tokens / min(hf_times)
    benchmark.extra_info.update(
        provider=provider,
        size=size,
        batch=batch,
        params_m=round(hf.num_parameters() / 1e6, 1),
        new_tokens=NEW_TOKENS,
        threads=torch.get_num_threads(),
        tokens_per_s=round(ours, 1),
        transformers_tokens_per_s=round(theirs, 1),
        vs_transformers=round(ours / theirs, 2),
    )
