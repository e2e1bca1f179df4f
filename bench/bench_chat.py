"""The real pair end to end: SmolLM2-135M-Instruct (GGUF) and its shipped draft, side by side.

CPU, fp32, greedy, batch 1, chat prompts (HumanEval tasks asked as chat requests, which
the draft never trained on), up to ``NEW_TOKENS`` new tokens each. Providers:

- ``transformers``: ``LlamaForCausalLM.generate`` holding the same dequantized weights;
- ``transformers-assisted``: ``generate(assistant_model=draft)`` with ``K`` draft tokens,
  the constant schedule (the same drafts and verdicts as ``osd-spec``);
- ``osd-plain``; ``osd-spec`` (static draft, chain of ``K``); ``osd-spec-lookup`` (prompt
  lookup first, the draft model otherwise; the EAGLE rows below look up 2+-token matches,
  and their steps drafted by lookup alone verify up to ``LOOKUP_TOKENS`` drafts);
- ``osd-online``: ``osd-spec`` with the draft after online distillation on ``WARMUP``
  other HumanEval requests (background learner), frozen for the timed rounds;
- ``osd-spec-lookup-tree-q8``, ``osd-online-lookup-tree-q8``: the static and the online
  draft served in Q8_0 as ``osd demo`` serves them (``TREE_SPEC``: prompt lookup alone
  on 3-token matches, shorter ones verified beside the draft's chain of 3 in one tree);
- ``osd-eagle``, ``osd-eagle-lookup``, ``osd-eagle-online``: the same three with the EAGLE
  draft (``osd.zoo.chat_eagle``, drafting from the target's features) in place of the
  standalone one;
- ``osd-eagle-lookup-q8``: ``osd-eagle-lookup`` with the EAGLE draft's layer and head kept
  Q8_0 (``quantize_draft="Q8_0"``: a draft step reads about a quarter of the bytes);
  ``osd-eagle-lookup-tree-q8``: the same draft with lookup trees (``EAGLE_TREE_SPEC``);
- ``osd-quant-plain``, ``osd-quant-spec-lookup``, ``osd-quant-eagle-lookup``: the target
  with its GGUF weights kept quantized (``quantized=True``: the same tokens, computed by
  the quant_linear kernels) plain, with prompt lookup then the static draft (k = ``K``),
  and with prompt lookup on 2+-token matches then the EAGLE draft (k = 3);
  ``osd-quant-eagle-lookup-q8``: the last with the EAGLE draft in Q8_0 as well;
- ``llama.cpp``: llama-cpp-python on the same GGUF (2 threads), when installed (the
  optional ``bench`` extra); skipped otherwise.

Every osd and transformers provider's output is asserted equal to osd plain greedy. Timing
is interleaved prompt by prompt with ``osd-plain`` as the anchor, best of ``ROUNDS``; the
ratios ``vs_plain`` come from those side-by-side sums. ``c`` is the draft's one-token
forward over the target's (interleaved, median; ``osd.demo.draft_cost_ratio``). The chat
model is fetched on first use; the module is skipped when it cannot be (no network, no
cache). ``OSD_BENCH_CHAT_TARGET`` benchmarks another GGUF file of the same model (another
quantization, such as a Q4_K_M file), ``OSD_BENCH_CHAT_DRAFT`` another draft directory;
``OSD_BENCH_CHAT_TOKENS``, ``_PROMPTS``, ``_WARMUP`` change the workload.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_chat.py \\
        --benchmark-json=results/bench_chat.json
"""

import os
import time

import pytest
import torch

import osd
from osd import zoo
from osd.chat_template import apply_chat_template
from osd.demo import draft_cost_ratio, online_recipe
from osd.zoo import humaneval

NEW_TOKENS = int(os.environ.get("OSD_BENCH_CHAT_TOKENS", "128"))
NUM_PROMPTS = int(os.environ.get("OSD_BENCH_CHAT_PROMPTS", "16"))
WARMUP = int(os.environ.get("OSD_BENCH_CHAT_WARMUP", "48"))
K = 4
LOOKUP_TOKENS = 8  # SpecConfig.lookup_tokens of the EAGLE rows with prompt lookup
ROUNDS = 2
PROVIDERS = [
    "transformers",
    "transformers-assisted",
    "osd-plain",
    "osd-spec",
    "osd-spec-lookup",
    "osd-online",
    "osd-spec-lookup-tree-q8",
    "osd-online-lookup-tree-q8",
    "osd-eagle",
    "osd-eagle-lookup",
    "osd-eagle-lookup-q8",
    "osd-eagle-lookup-tree-q8",
    "osd-eagle-online",
    "osd-quant-plain",
    "osd-quant-spec-lookup",
    "osd-quant-eagle-lookup",
    "osd-quant-eagle-lookup-q8",
    "llama.cpp",
]
# The speculative shapes of the quantized-target rows (measured side by side as the
# fastest of their drafts on the quantized target, docs/benchmarks.md).
QUANT_SPECS = {
    "osd-quant-spec-lookup": dict(num_draft_tokens=K, prompt_lookup=True),
    "osd-quant-eagle-lookup": dict(num_draft_tokens=3, prompt_lookup=True, ngram_min=2),
}
QUANT_SPECS["osd-quant-eagle-lookup-q8"] = QUANT_SPECS["osd-quant-eagle-lookup"]
# Lookup trees with 3-token matches drafting alone, the standalone draft's shape measured
# on independent prompts (its serving.json; the demo also looks up earlier answers, so it
# puts every match beside the draft's chain, docs/online.md).
TREE_SPEC = dict(
    num_draft_tokens=3, prompt_lookup=True, lookup_tokens=LOOKUP_TOKENS, lookup_tree_below=3
)
EAGLE_TREE_SPEC = dict(TREE_SPEC, num_draft_tokens=4)  # the EAGLE draft's longer branch


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(int(os.environ.get("OSD_BENCH_THREADS", "2")))
    try:
        target, draft = zoo.chat_pair()
    except Exception as exc:  # pragma: no cover - offline machines
        pytest.skip(f"the chat pair is not available: {exc}")
    target = os.environ.get("OSD_BENCH_CHAT_TARGET", target)  # another file of the model
    draft = os.environ.get("OSD_BENCH_CHAT_DRAFT", draft)  # benchmark another draft
    if draft is None:
        pytest.skip(zoo.locate.missing_message("chat_draft"))
    convs = humaneval.conversations(NUM_PROMPTS + WARMUP, seed=11)
    plain = osd.Engine.from_pretrained(target, max_batch_size=1, max_seq_len=1024, quantized=False)
    prompts = apply_chat_template(plain.tokenizer, convs)
    return {
        "target": target,
        "draft": draft,
        "eagle": zoo.chat_eagle(),
        "plain": plain,
        "prompts": prompts[:NUM_PROMPTS],
        "warmup": prompts[NUM_PROMPTS:],
        "rows": {},
    }


def _hf(path):
    # transformers loads only for its assisted-generation row
    from transformers import LlamaConfig, LlamaForCausalLM

    m = osd.load_model(path, head_vocab=False)  # transformers holds the full head
    c = m.config
    cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        eos_token_id=list(c.eos_token_ids),
        bos_token_id=c.bos_token_id,
        pad_token_id=c.eos_token_ids[0],
    )
    hf = LlamaForCausalLM(cfg).eval()
    state = {}
    for name, t in m.state_dict().items():
        state.update(_hf_names(name, t, c))
    hf.load_state_dict(state, strict=False)
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf


def _hf_names(name, t, c):
    """Our fused parameter names -> transformers' (wqkv -> q/k/v, w_gate_up -> gate/up)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if name.startswith("layers."):
        i, rest = name.split(".", 2)[1:]
        p = f"model.layers.{i}."
        if rest == "wqkv.weight":
            return {
                p + "self_attn.q_proj.weight": t[:q],
                p + "self_attn.k_proj.weight": t[q : q + kv],
                p + "self_attn.v_proj.weight": t[q + kv :],
            }
        if rest == "w_gate_up.weight":
            h = t.shape[0] // 2
            return {p + "mlp.gate_proj.weight": t[:h], p + "mlp.up_proj.weight": t[h:]}
        names = {
            "wo.weight": "self_attn.o_proj.weight",
            "w_down.weight": "mlp.down_proj.weight",
            "input_norm.weight": "input_layernorm.weight",
            "post_attention_norm.weight": "post_attention_layernorm.weight",
        }
        return {p + names[rest]: t}
    names = {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    return {names[name]: t}


def _draft_of(setup, provider):
    if not provider.startswith(("osd-eagle", "osd-quant-eagle")):
        return setup["draft"]
    if setup["eagle"] is None:  # the repository keeps it: its absence is a broken setup
        pytest.fail(zoo.locate.missing_message("chat_eagle"))
    return setup["eagle"]


def _engine(setup, provider):
    if provider.startswith("osd-quant"):
        if provider == "osd-quant-plain":
            return osd.Engine.from_pretrained(
                setup["target"], max_batch_size=1, max_seq_len=1024, quantized=True
            )
        return osd.Engine.from_pretrained(
            setup["target"],
            draft=_draft_of(setup, provider),
            max_batch_size=1,
            max_seq_len=1024,
            quantized=True,
            spec=osd.SpecConfig(**QUANT_SPECS[provider]),
            quantize_draft=_draft_format(provider),
        )
    lookup = provider.endswith(("-lookup", "-lookup-q8"))
    # The EAGLE draft drafts better than a 1-token match predicts: lookup on 2+-token matches.
    eagle_lookup = lookup and provider.startswith("osd-eagle")
    spec = osd.SpecConfig(
        num_draft_tokens=K,
        prompt_lookup=lookup,
        ngram_min=2 if eagle_lookup else 1,
        lookup_tokens=LOOKUP_TOKENS if eagle_lookup else 0,
    )
    if "-lookup-tree" in provider:
        spec = osd.SpecConfig(
            **(EAGLE_TREE_SPEC if provider.startswith("osd-eagle") else TREE_SPEC)
        )
    draft = _draft_of(setup, provider)
    if "-online" not in provider:
        return osd.Engine.from_pretrained(
            setup["target"],
            draft=draft,
            spec=spec,
            max_batch_size=1,
            max_seq_len=1024,
            quantized=False,
            quantize_draft=_draft_format(provider),
        )
    eng = osd.Engine.from_pretrained(  # warm-up with the float draft
        setup["target"],
        draft=draft,
        spec=spec,
        max_batch_size=1,
        max_seq_len=1024,
        quantized=False,
        online=online_recipe("chat"),
        quantize_draft=None,
    )
    for p in setup["warmup"]:
        eng.generate([p], osd.SamplingParams(NEW_TOKENS))
    eng.close()
    learned = eng.speculators[0].drafter.model
    frozen = osd.Engine(
        eng.model,
        draft=learned,
        spec=spec,
        tokenizer=eng.tokenizer,
        max_batch_size=1,
        max_seq_len=1024,
        quantize_draft=_draft_format(provider),
    )
    frozen.online_updates = eng.stats["online"]["updates_applied"]
    return frozen


def _draft_format(provider):
    """The block format a provider keeps its draft in (None: float32)."""
    return "Q8_0" if provider.endswith("-q8") else None


def _runner(setup, provider):
    params = osd.SamplingParams(NEW_TOKENS)
    if provider.startswith("osd"):
        eng = setup["plain"] if provider == "osd-plain" else _engine(setup, provider)
        return (lambda p: eng.generate([p], params)[0].token_ids), eng
    if provider == "llama.cpp":
        llama_cpp = pytest.importorskip("llama_cpp")
        llm = llama_cpp.Llama(setup["target"], n_threads=2, n_ctx=1024, verbose=False)

        def run(p):
            out = []
            for t in llm.generate(p, temp=0.0, reset=True):
                if t in setup["plain"].eos_token_ids or len(out) >= NEW_TOKENS:
                    break
                out.append(t)
            return out

        return run, None
    hf = setup.setdefault("hf", _hf(setup["target"]))
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    if provider == "transformers-assisted":
        draft = setup.setdefault("hf_draft", _hf(setup["draft"]))
        draft.generation_config.num_assistant_tokens = K
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        kw["assistant_model"] = draft

    def run(p):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), **kw
            )
        return out[0, len(p) :].tolist()

    return run, None


@pytest.mark.parametrize("provider", PROVIDERS)
def test_chat(benchmark, setup, provider):
    run, eng = _runner(setup, provider)
    plain = setup["plain"]
    params = osd.SamplingParams(NEW_TOKENS)
    refs = [plain.generate([p], params)[0].token_ids for p in setup["prompts"]]
    outs = [run(p) for p in setup["prompts"]]
    if provider != "llama.cpp":  # llama.cpp computes in its own precision
        trimmed = [o[: len(r)] for o, r in zip(outs, refs)]
        assert trimmed == refs, f"{provider} differs from osd plain greedy"
    best = {"p": [float("inf")] * len(refs), "a": [float("inf")] * len(refs)}

    def rounds():
        for i, p in enumerate(setup["prompts"]):
            t0 = time.perf_counter()
            plain.generate([p], params)
            best["a"][i] = min(best["a"][i], time.perf_counter() - t0)
            t0 = time.perf_counter()
            run(p)
            best["p"][i] = min(best["p"][i], time.perf_counter() - t0)

    if eng is not None and eng is not plain:
        eng.reset_stats()
    benchmark.pedantic(rounds, rounds=ROUNDS, iterations=1)
    tokens = sum(len(o) for o in outs)
    info = {
        "tokens_per_s": tokens / sum(best["p"]),
        "plain_tokens_per_s": sum(len(r) for r in refs) / sum(best["a"]),
        "new_tokens": NEW_TOKENS,
        "prompts": len(refs),
    }
    info["vs_plain"] = info["tokens_per_s"] / info["plain_tokens_per_s"]
    if eng is not None and eng is not plain and eng.drafts:
        st = eng.stats
        info.update(
            alpha=st.get("alpha"),
            acceptance_rate=st.get("acceptance_rate"),
            mean_accepted_length=st.get("mean_accepted_length"),
            lookup_steps=st.get("lookup_steps"),
        )
        draft = _draft_of(setup, provider)
        key = (draft, provider.startswith("osd-quant"), _draft_format(provider))
        costs = setup.setdefault("c", {})
        if key not in costs:
            costs[key] = draft_cost_ratio(
                setup["target"], draft, quantized=key[1], quantize_draft=key[2]
            )
        info["c"] = costs[key]
        if hasattr(eng, "online_updates"):
            info["online_updates"] = eng.online_updates
    benchmark.extra_info.update(info)
    setup["rows"][provider] = info
    print(
        f"\n{provider}: "
        + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
    )
