"""``SpecConfig(auto_k=True)`` with a draft that never pays, against plain decoding.

A random 4-layer Llama target and a random 1-layer draft (the target accepts almost none
of its tokens), greedy, 192 new tokens per row, batch 1 and 8; fp32 on CPU (torch on
``bench.common.THREADS`` threads), bf16 with CUDA graphs on a GPU. auto_k should find that
drafting does not pay and decode plainly, so its goal is a ratio close to 1.0x. The two
engines' rounds alternate so both see the same machine state. Recorded in ``extra_info``:
best-round tokens/s of each, ``auto_k_over_plain``, and the steps each chain length ran.

    python -m pytest -q -p no:cacheprovider bench/bench_auto_k.py
"""

import time

import pytest
import torch

import osd
from osd.models.config import ModelConfig
from osd.models.llama import DecoderLM

pytestmark = pytest.mark.usefixtures("torch_threads")

NEW_TOKENS = 192
ROUNDS = 5


def _model(cfg: ModelConfig, dev, dtype) -> DecoderLM:
    model = DecoderLM(cfg, device=dev, dtype=dtype)
    model.init_weights(generator=torch.Generator(device=dev).manual_seed(cfg.num_layers))
    return model.requires_grad_(False)


@pytest.mark.parametrize("batch", [1, 8])
def test_auto_k_with_a_useless_draft(benchmark, batch):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = _model(ModelConfig("LlamaForCausalLM", 1000, 128, 256, 4, 4, 2, 32), dev, dtype)
    draft = _model(ModelConfig("LlamaForCausalLM", 1000, 64, 128, 1, 2, 1, 32), dev, dtype)
    seq = 16 + NEW_TOKENS + 8
    engines = {
        "plain": osd.Engine(target, max_batch_size=batch, max_seq_len=seq),
        "auto_k": osd.Engine(
            target,
            draft=draft,
            max_batch_size=batch,
            max_seq_len=seq,
            spec=osd.SpecConfig(num_draft_tokens=4, auto_k=True),
        ),
    }
    prompts = [[(7 * i + j) % 1000 for j in range(16)] for i in range(batch)]
    params = osd.SamplingParams(NEW_TOKENS, ignore_eos=True)
    outs = {
        name: [o.token_ids for o in e.generate(prompts, params)]  # warm-up
        for name, e in engines.items()
    }
    assert outs["auto_k"] == outs["plain"], "auto_k changed the greedy output"
    best = {"plain": float("inf")}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def plain_round():
        sync()
        start = time.perf_counter()
        engines["plain"].generate(prompts, params)
        sync()
        best["plain"] = min(best["plain"], time.perf_counter() - start)

    def auto_k_round():
        engines["auto_k"].generate(prompts, params)
        sync()

    benchmark.pedantic(auto_k_round, setup=plain_round, rounds=ROUNDS, iterations=1)
    best["auto_k"] = benchmark.stats.stats.min
    tokens = batch * NEW_TOKENS
    tps = {name: tokens / t for name, t in best.items()}
    summary = engines["auto_k"].stats["auto_k"][0]
    benchmark.extra_info.update(
        batch=batch,
        device=dev.type,
        new_tokens=NEW_TOKENS,
        plain_tokens_per_s=round(tps["plain"], 1),
        auto_k_tokens_per_s=round(tps["auto_k"], 1),
        auto_k_over_plain=round(tps["auto_k"] / tps["plain"], 3),
        steps_per_k={str(k): v for k, v in next(iter(summary.values()))["steps"].items()},
    )
    info = benchmark.extra_info
    print(
        f"\nbatch {batch}: auto_k {info['auto_k_over_plain']:.3f}x plain "
        f"({info['auto_k_tokens_per_s']} vs {info['plain_tokens_per_s']} tokens/s), "
        f"steps per chain length {info['steps_per_k']}"
    )
