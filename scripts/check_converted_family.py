"""Check osd's reading of a model family against llama.cpp's own converter and runtime.

For each family: a random small model (transformers, SmolLM2's tokenizer, weights drawn
wide so that logits are well separated), saved, converted to an F32 GGUF by llama.cpp's
``convert_hf_to_gguf.py`` (from the llama-cpp-python sources: ``pip download --no-deps
--no-binary :all: llama-cpp-python==0.3.36`` and unpack), then loaded by osd. Printed per
family: the largest logit difference between osd (on the GGUF file) and transformers (on
the checkpoint) over a 37-token sequence, and whether 24 greedy tokens after a 12-token
prompt equal transformers' and llama.cpp's (llama-cpp-python, float32 KV cache).

    .venv/bin/python scripts/check_converted_family.py \\
        --llama-cpp /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp

Needs llama-cpp-python and sentencepiece (the optional ``bench`` extra; llama.cpp's
Llama-family converter imports sentencepiece, then takes the BPE vocabulary when there is
no ``tokenizer.model``) and the chat pair's tokenizer. llama.cpp's converter reads a
SentencePiece model for Gemma 2 (none here), so the script makes it take the byte-level
BPE vocabulary for that family.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import sys
import tempfile

import torch
import transformers as tf

import osd
from osd import zoo
from osd.models.loading import load_model, load_tokenizer

FAMILIES = (
    "granite",
    "olmo2",
    "phi3",
    "smollm3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2moe",
    "qwen3moe",
    "olmoe",
    "granitemoe",
)
NEW_TOKENS = 24


def hf_model(family: str, vocab: int, ids: dict):
    """A random transformers model of ``family`` (hidden 128, 4 heads / 2 KV heads)."""
    common = dict(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        **ids,
    )
    half = int(0.75 * 32) // 2
    configs = {
        "granite": lambda: tf.GraniteConfig(
            num_hidden_layers=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
            tie_word_embeddings=True,
            **common,
        ),
        "olmo2": lambda: tf.Olmo2Config(num_hidden_layers=2, tie_word_embeddings=False, **common),
        "phi3": lambda: tf.Phi3Config(  # Phi-4-mini's layout: partial rotary and LongRoPE
            num_hidden_layers=2,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.3 * i for i in range(half)],
                "long_factor": [4.0] * half,
                "original_max_position_embeddings": 256,
            },
            tie_word_embeddings=False,
            **common,
        ),
        "smollm3": lambda: tf.SmolLM3Config(
            num_hidden_layers=4, tie_word_embeddings=True, **common
        ),
        "gemma2": lambda: tf.Gemma2Config(
            num_hidden_layers=6,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            **common,
        ),
        "gemma3": lambda: tf.Gemma3TextConfig(
            num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8, **common
        ),
        "mixtral": lambda: tf.MixtralConfig(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            **common,
        ),
        "qwen2moe": lambda: tf.Qwen2MoeConfig(
            num_hidden_layers=2,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=192,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            **common,
        ),
        "qwen3moe": lambda: tf.Qwen3MoeConfig(
            num_hidden_layers=2,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            **common,
        ),
        # llama.cpp sizes OLMoE's k norm by the hidden width (as many KV heads as heads) and
        # its converter writes OLMoE's epsilon, 1e-5, whatever the config says
        "olmoe": lambda: tf.OlmoeConfig(
            num_hidden_layers=2,
            num_experts=5,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            **{**common, "num_key_value_heads": 4, "rms_norm_eps": 1e-5},
        ),
        "granitemoe": lambda: tf.GraniteMoeConfig(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
            tie_word_embeddings=True,
            **common,
        ),
    }
    classes = {
        "granite": tf.GraniteForCausalLM,
        "olmo2": tf.Olmo2ForCausalLM,
        "phi3": tf.Phi3ForCausalLM,
        "smollm3": tf.SmolLM3ForCausalLM,
        "gemma2": tf.Gemma2ForCausalLM,
        "gemma3": tf.Gemma3ForCausalLM,
        "mixtral": tf.MixtralForCausalLM,
        "qwen2moe": tf.Qwen2MoeForCausalLM,
        "qwen3moe": tf.Qwen3MoeForCausalLM,
        "olmoe": tf.OlmoeForCausalLM,
        "granitemoe": tf.GraniteMoeForCausalLM,
    }
    torch.manual_seed(0)
    model = classes[family](configs[family]()).eval()
    gemma = family.startswith("gemma")  # Gemma's norms multiply by 1 + weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def convert(llama_cpp: str, src: str, out: str, family: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py, in this process."""
    here = os.getcwd()
    saved_argv, saved_path = sys.argv, list(sys.path)
    os.chdir(llama_cpp)
    sys.path[:0] = [os.path.join(llama_cpp, "gguf-py"), llama_cpp]
    try:
        if family == "gemma2":
            # llama.cpp's converter package: importable only once sys.path holds its sources
            import conversion.gemma as gemma

            gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
        sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", out, "--outtype", "f32"]
        runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
    finally:
        os.chdir(here)
        sys.argv, sys.path[:] = saved_argv, saved_path


def check(family: str, llama_cpp: str, workdir: str) -> str:
    import llama_cpp as lc  # optional dependency (the bench extra)

    tok = load_tokenizer(zoo.chat_pair()[0])
    ids = dict(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id
    )
    hf = hf_model(family, len(tok), ids)
    # The converter names the model after its directory, and llama.cpp's vocabulary loader
    # treats some names specially (a model named "Phi3" with this vocabulary fails to load).
    src, gguf = os.path.join(workdir, family, "random"), os.path.join(workdir, family + ".gguf")
    hf.save_pretrained(src)
    tok.save_pretrained(src)
    if family == "phi3":  # llama.cpp's Phi-3 converter takes a BPE vocabulary this way
        path = os.path.join(src, "tokenizer_config.json")
        cfg = json.load(open(path))
        cfg["tokenizer_class"] = "GPT2Tokenizer"
        json.dump(cfg, open(path, "w"))
    convert(llama_cpp, src, gguf, family)
    model = load_model(gguf)
    seq = torch.randint(0, len(tok), (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(seq).logits.float() - model(seq, model.new_cache(1, 64))).abs().max()
        top = hf(seq).logits.abs().max()
    prompt = seq[0, :12].tolist()
    eng = osd.Engine.from_pretrained(gguf, max_batch_size=1, max_seq_len=200)
    ours = eng.generate([prompt], osd.SamplingParams(NEW_TOKENS))[0].token_ids
    ref = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
    )[0, 12:].tolist()
    llm = lc.Llama(
        gguf, n_threads=2, n_ctx=200, verbose=bool(os.environ.get("VERBOSE")), type_k=0, type_v=0
    )
    theirs = []
    for t in llm.generate(prompt, temp=0.0, reset=True):
        theirs.append(t)
        if len(theirs) >= len(ours):
            break
    return (
        f"| {family} | {float(diff):.1e} | {float(top):.1f} | {ours == ref[: len(ours)]} | "
        f"{ours == theirs} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-cpp",
        required=True,
        help="llama.cpp sources (holding convert_hf_to_gguf.py and gguf-py)",
    )
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    args = parser.parse_args()
    missing = [m for m in ("llama_cpp", "sentencepiece") if importlib.util.find_spec(m) is None]
    if missing:  # llama.cpp's Llama-family converter imports sentencepiece up front
        raise SystemExit(f"this check needs {' and '.join(missing)}: pip install -e '.[bench]'")
    torch.set_num_threads(2)
    print(
        "| family | max abs logit diff vs transformers | largest logit | greedy = transformers "
        "| greedy = llama.cpp |"
    )
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as workdir:
        for family in args.families:
            print(check(family, os.path.abspath(args.llama_cpp), workdir), flush=True)


if __name__ == "__main__":
    main()
