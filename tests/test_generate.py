"""Plain generation: greedy equals transformers, batching is invisible, sampling follows
``warp_probs``, and EOS / stop ids / the context limit end sequences."""

import pytest
import torch
from scipy.stats import chisquare
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import osd
from osd.models import load_model
from osd.sampling import request_seed, sample_tokens
from osd_kernels.warp import warp_probs
from tests.test_models import FAMILIES, VOCAB, tiny_hf_model


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def engine():
    return osd.Engine(load_model(tiny_hf_model("llama", seed=1)), max_batch_size=4, max_seq_len=64)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(family):
    hf = tiny_hf_model(family, seed=2)
    eng = osd.Engine.from_pretrained(hf, max_batch_size=2, max_seq_len=64)
    prompts = _prompts([7, 3], seed=3)
    outs = eng.generate(prompts, osd.SamplingParams(20))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, prompt, 20)
        assert out.finish_reason == "length" and out.text is None


def test_ragged_batch_equals_each_alone(engine):
    """More prompts than rows (continuous refill) and stops at different times."""
    prompts = _prompts([9, 2, 14, 5, 1, 11], seed=4)
    alone = [engine.generate([p], osd.SamplingParams(12))[0].token_ids for p in prompts]
    # stop ids that end some sequences early exercise finished-row removal
    stops = [alone[1][3], alone[3][6]]
    params = osd.SamplingParams(12, stop_token_ids=stops)
    batched = engine.generate(prompts, params)
    for a, out in zip(alone, batched):
        cut = next((i + 1 for i, t in enumerate(a) if t in stops), len(a))
        assert out.token_ids == a[:cut]
        assert out.finish_reason == ("stop" if any(t in stops for t in a) else "length")


def test_eos_from_config_ends_sequence():
    hf = tiny_hf_model("mistral", seed=5)
    prompt = _prompts([6], seed=6)[0]
    free = _hf_greedy(hf, prompt, 10)
    eos = free[2]
    hf.config.eos_token_id = [eos, VOCAB - 1] if eos != VOCAB - 1 else [eos]
    eng = osd.Engine.from_pretrained(hf, max_seq_len=32)
    out = eng.generate([prompt], osd.SamplingParams(10))[0]
    assert out.token_ids == free[: free.index(eos) + 1] and out.finish_reason == "stop"


def test_context_limit_stops_with_length(engine):
    eng = osd.Engine(engine.model, max_batch_size=2, max_seq_len=16)
    prompts = _prompts([10, 4], seed=7)
    outs = eng.generate(prompts, osd.SamplingParams(100))
    assert [len(o.token_ids) for o in outs] == [6, 12]
    assert all(o.finish_reason == "length" for o in outs)
    full = engine.generate(prompts, osd.SamplingParams(12))
    assert outs[1].token_ids == full[1].token_ids[:12]


def test_seeded_sampling_reproducible_and_batch_independent(engine):
    prompts = _prompts([5, 8, 3, 6, 9], seed=8)
    params = osd.SamplingParams(10, temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    one_row = osd.Engine(engine.model, max_batch_size=1, max_seq_len=64)
    c = one_row.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in c]
    d = engine.generate(prompts, osd.SamplingParams(10, temperature=0.9, seed=99))
    assert [o.token_ids for o in a] != [o.token_ids for o in d]


def test_sampled_tokens_lie_in_top_k(engine):
    """End to end: with top_k=3 every sampled token is among the model's 3 best."""
    prompts = _prompts([4, 7, 2, 5], seed=9)
    outs = engine.generate(prompts, osd.SamplingParams(8, temperature=1.5, top_k=3, seed=5))
    for prompt, out in zip(prompts, outs):
        seq = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = engine.model.forward_train(seq)[0, len(prompt) - 1 : -1]
        top3 = logits.topk(3, dim=-1).indices
        assert all(t in top3[i].tolist() for i, t in enumerate(out.token_ids))


def _naive_warp(logits, temperature, top_k, top_p):
    """Textbook temperature / top-k / top-p on one row of distinct logits, by sorting."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = top_k if top_k > 0 else len(probs)
    kept = order[:k]
    p_k = probs[kept] / probs[kept].sum()
    mass = 0.0
    for idx, p in zip(kept.tolist(), p_k.tolist()):
        keep[idx] = True
        mass += p
        if mass >= top_p:
            break
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.8, 6, 0.7)],
)
def test_sampling_distribution_chi_square(temperature, top_k, top_p):
    """200k draws per setting vs the exact warped distribution; significance 1e-4."""
    logits = torch.randn(11, generator=torch.Generator().manual_seed(10)) * 0.8
    exact = _naive_warp(logits, temperature, top_k, top_p)
    warped = warp_probs(logits[None], temperature, top_k, top_p)[0]
    assert torch.allclose(warped.double(), exact, atol=1e-6)
    n = 200_000
    params = osd.SamplingParams(1, temperature=temperature, top_k=top_k, top_p=top_p)
    seeds = torch.tensor([request_seed(11, i) for i in range(n)])
    draws = sample_tokens(logits.expand(n, -1), params, seeds, torch.zeros(n, dtype=torch.int64))
    counts = torch.bincount(draws, minlength=11).double()
    support = exact > 0
    assert support.sum() >= 2
    assert counts[~support].sum() == 0
    _, p_value = chisquare(counts[support].numpy(), (exact[support] * n).numpy())
    assert p_value > 1e-4


def test_plain_sampler_rows_follow_their_seed_and_offset():
    """A row's draw depends only on its logits, seed and offset, not on its batch."""
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(12))
    params = osd.SamplingParams(1, temperature=1.0)
    seeds = torch.tensor([request_seed(5, i) for i in range(3)])
    offsets = torch.tensor([0, 4, 9])
    a = sample_tokens(logits, params, seeds, offsets)
    b = torch.cat(
        [
            sample_tokens(logits[i : i + 1], params, seeds[i : i + 1], offsets[i : i + 1])
            for i in range(3)
        ]
    )
    assert torch.equal(a, b)
    draws = {
        int(sample_tokens(logits[:1], params, seeds[:1], torch.tensor([o]))) for o in range(40)
    }
    assert len(draws) > 1  # a new offset is a new draw
    assert torch.equal(
        sample_tokens(logits, osd.SamplingParams(1), seeds, offsets), logits.argmax(-1)
    )


def test_request_seeds_are_mixed():
    """Request seeds are splitmix64 of ``base + i``: distinct, 63-bit, never the raw seed
    (torch's CUDA generator keys the same Philox on its raw seed)."""
    seeds = [request_seed(1000, i) for i in range(1000)]
    assert len(set(seeds)) == 1000
    assert all(0 <= s < 2**63 and s != 1000 + i for i, s in enumerate(seeds))
    assert request_seed(1000, 1) == request_seed(1001, 0)


def test_string_prompts_with_checkpoint_tokenizer(tmp_path):
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    ).save_pretrained(tmp_path)
    hf = tiny_hf_model("qwen2", seed=13)
    hf.save_pretrained(tmp_path)
    eng = osd.Engine.from_pretrained(tmp_path, max_seq_len=32)
    assert eng.tokenizer is not None
    out = eng.generate(["w5 w17 w3", [7, 19, 5]], osd.SamplingParams(6))
    assert out[0].token_ids == _hf_greedy(hf, [7, 19, 5], 6) == out[1].token_ids
    assert out[0].text == " ".join(words[t] for t in out[0].token_ids if t > 1)


def test_chat_formats_with_the_template(tmp_path):
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    hf = tiny_hf_model("llama", seed=14)
    eng = osd.Engine.from_pretrained(hf, max_seq_len=32)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.chat([[{"role": "user", "content": "w5"}]], osd.SamplingParams(4))
    fast.chat_template = (
        "{% for m in messages %}w{{ 10 if m['role'] == 'user' else 11 }} "
        "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w12"
        "{% endif %}"
    )
    eng = osd.Engine.from_pretrained(hf, max_seq_len=32, tokenizer=fast)
    conv = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w5 w17"}]
    out = eng.chat([conv], osd.SamplingParams(5))
    ids = [words.index(w) for w in "w11 w7 w10 w5 w17 w12".split()]
    assert out[0].token_ids == eng.generate([ids], osd.SamplingParams(5))[0].token_ids
    with pytest.raises(ValueError, match="role"):
        eng.chat([[{"role": "robot", "content": "w5"}]], osd.SamplingParams(4))
    with pytest.raises(TypeError):
        eng.chat(conv, osd.SamplingParams(4))  # one conversation without the list
