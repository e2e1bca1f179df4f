"""The tokenizer stored in a GGUF file's metadata, as a transformers tokenizer.

``tokenizer.ggml.model`` "gpt2" is byte-level BPE (vocabulary and merges as stored, text
split first by the regexes llama.cpp uses for ``tokenizer.ggml.pre``); "llama" is
SentencePiece BPE (merges rebuilt from the scores, byte fallback). Control tokens become
special tokens; BOS/EOS are added as the file says; the chat template is kept.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

if TYPE_CHECKING:
    from osd.models.gguf import GGUFFile

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split regexes applied in order, as llama.cpp's llama-vocab.cpp
# lists them). "\p{N}" alone splits every digit off first.
_PRE_SPLITS = {
    "default": [_GPT2_SPLIT], "gpt2": [_GPT2_SPLIT], "mpt": [_GPT2_SPLIT],
    "olmo": [_GPT2_SPLIT], "jais": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT], "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT], "command-r": [r"\p{N}", _GPT2_SPLIT],
    "codeshell": [r"\p{N}", _GPT2_SPLIT], "exaone": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT], "llama-bpe": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT], "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT],
}
_CONTROL, _USER_DEFINED = 3, 4     # tokenizer.ggml.token_type values


def _bpe_tokenizer(meta: Mapping[str, Any]):
    """Byte-level BPE ("gpt2"): the vocabulary and merges as stored, split per ``pre``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known to osd; splitting text as "
                      "GPT-2 does, so token ids may differ from llama.cpp's", stacklevel=3)
    splits = _PRE_SPLITS.get(pre, [_GPT2_SPLIT])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens: list[str], scores) -> list[tuple[str, str]]:
    """BPE merges equivalent to a SentencePiece vocabulary: every split of a token into two
    tokens, best merged-token score first; ties put the longer left piece first, then
    vocabulary order (the order transformers' sentencepiece conversion uses)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for t, score in zip(tokens, scores):
        local = [(t[:i], t[i:]) for i in range(1, len(t)) if t[:i] in vocab and t[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges += [(-float(score), -len(a), -len(b), a, b) for a, b in local]
    merges.sort(key=lambda m: m[:3])      # stable: equal keys keep vocabulary order
    return [(a, b) for _, _, _, a, b in merges]


def _spm_tokenizer(meta: Mapping[str, Any]):
    """SentencePiece BPE ("llama"): spaces become "▁", unknown bytes fall back to <0xNN>."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        scores = -np.arange(len(tokens), dtype=np.float32)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=_spm_merges(tokens, scores),
                               unk_token=None if unk is None else tokens[unk],
                               fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def tokenizer_from_gguf(g: GGUFFile):
    """A transformers ``PreTrainedTokenizerFast`` built from ``g``'s tokenizer metadata:
    ``tokenizer.ggml.model`` "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE), with
    control tokens as special tokens, BOS/EOS added as the file says, and the file's chat
    template. None when the file has no tokenizer; ValueError for another model type."""
    from tokenizers import AddedToken, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    meta = g.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        return None
    if kind == "gpt2":
        tok = _bpe_tokenizer(meta)
    elif kind == "llama":
        tok = _spm_tokenizer(meta)
    else:
        raise ValueError(f"GGUF file {str(g.path)!r}: unsupported tokenizer model {kind!r}; "
                         "supported: gpt2 (byte-level BPE), llama (SentencePiece)")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        # In a byte-level vocabulary every real token is spelled in the byte alphabet; a
        # control token with other characters would match raw text it was never meant to.
        alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if kind == "gpt2" else None
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == _CONTROL
                                and (alphabet is None or set(t) <= alphabet)])
        tok.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def special(name: str) -> tuple[str, int] | None:
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return (tokens[int(i)], int(i)) if i is not None and 0 <= int(i) < len(tokens) \
            else None

    bos, eos, unk, pad = special("bos"), special("eos"), special("unknown"), special("padding")
    add = [bos] if bos and meta.get("tokenizer.ggml.add_bos_token", kind == "llama") else []
    end = [eos] if eos and meta.get("tokenizer.ggml.add_eos_token", False) else []
    if add or end:
        one = " ".join([t for t, _ in add] + ["$A"] + [t for t, _ in end])
        two = " ".join([t for t, _ in add] + ["$B"] + [t for t, _ in end])
        tok.post_processor = processors.TemplateProcessing(
            single=one, pair=f"{one} {two}", special_tokens=list(dict.fromkeys(add + end)))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos and bos[0], eos_token=eos and eos[0],
        unk_token=unk and unk[0], pad_token=pad and pad[0],
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=int(meta.get(f"{g.architecture}.context_length", 2048)),
        clean_up_tokenization_spaces=False)
