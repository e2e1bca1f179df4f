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
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

if TYPE_CHECKING:
    from osd.models.gguf.format import GGUFFile

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
# tokenizer.ggml.pre -> the regexes llama.cpp (llama-vocab.cpp) splits text by, applied
# in order, each to the pieces the one before left; where llama.cpp rewrites a
# tokenizer.json regex for std::regex, the original is used (the tokenizers crate runs it).
_PRE_SPLITS = {
    "default": [
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ],
    **dict.fromkeys(
        [
            "gpt2",
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "granite-docling",
            "jina-es",
            "jina-de",
            "gigachat",
            "a.x-4.0",
            "mellum",
        ],
        [_GPT2],
    ),
    **dict.fromkeys(
        [
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        [r"\p{N}", _GPT2],
    ),
    **dict.fromkeys(
        [
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "dbrx",
            "smaug-bpe",
            "chatglm-bpe",
            "glm4",
            "glm5",
        ],
        [_LLAMA3],
    ),
    **dict.fromkeys(
        [
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        [_QWEN2],
    ),
    "qwen35": [_QWEN35],
    "tekken": [_TEKKEN],
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], [_GPT4O]),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _DEEPSEEK3),
    "deepseek-llm": [
        r"[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
        "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
        "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
        "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
        "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
        "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
        "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
        "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
        "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
        "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
        "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK,
        r"\p{N}+",
    ],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
    "falcon": [
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"[0-9][0-9][0-9]",
    ],
    "seed-coder": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
        r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], [_BLOOM]),
    "viking": [_BLOOM, r"\p{N}"],
}
# Pre-tokenizers whose words found whole in the vocabulary are taken as one token before
# any merge (the tokenizers crate's ``ignore_merges``), and those that add BOS by default.
_IGNORE_MERGES = {
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "tekken",
    "glm4",
    "glm5",
}
_ADD_BOS = {
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "tekken",
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _bpe_tokenizer(meta: Mapping[str, Any]):
    """Byte-level BPE ("gpt2"): the vocabulary and merges as stored, split per ``pre``."""
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in _IGNORE_MERGES,
        )
    )
    if pre not in _PRE_SPLITS:
        warnings.warn(
            f"GGUF pre-tokenizer {pre!r} is not known to osd; splitting text as "
            "GPT-2 does, so token ids may differ from llama.cpp's",
            stacklevel=3,
        )
    splits = _PRE_SPLITS.get(pre, _PRE_SPLITS["default"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
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
    merges.sort(key=lambda m: m[:3])  # stable: equal keys keep vocabulary order
    return [(a, b) for _, _, _, a, b in merges]


def _spm_tokenizer(meta: Mapping[str, Any]):
    """SentencePiece BPE ("llama"): spaces become "▁", unknown bytes fall back to <0xNN>."""
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        scores = -np.arange(len(tokens), dtype=np.float32)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_spm_merges(tokens, scores),
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return tok


def tokenizer_from_gguf(g: GGUFFile):
    """A transformers ``PreTrainedTokenizerFast`` built from ``g``'s tokenizer metadata:
    ``tokenizer.ggml.model`` "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE), with
    control tokens as special tokens, BOS/EOS added as the file says, and the file's chat
    template. None when the file has no tokenizer; ValueError for another model type."""
    # transformers is slow to import and only tokenizers need it: kept off `import osd`
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
        raise ValueError(
            f"GGUF file {str(g.path)!r}: unsupported tokenizer model {kind!r}; "
            "supported: gpt2 (byte-level BPE), llama (SentencePiece)"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        # In a byte-level vocabulary every real token is spelled in the byte alphabet; a
        # control token with other characters would match raw text it was never meant to.
        alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if kind == "gpt2" else None
        tok.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, k in zip(tokens, types)
                if k == _CONTROL and (alphabet is None or set(t) <= alphabet)
            ]
        )
        tok.add_tokens(
            [
                AddedToken(t, normalized=False, special=False)
                for t, k in zip(tokens, types)
                if k == _USER_DEFINED
            ]
        )

    def special(name: str) -> tuple[str, int] | None:
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return (tokens[int(i)], int(i)) if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos, unk, pad = special("bos"), special("eos"), special("unknown"), special("padding")
    add_bos = kind == "llama" or meta.get("tokenizer.ggml.pre") in _ADD_BOS
    add = [bos] if bos and meta.get("tokenizer.ggml.add_bos_token", add_bos) else []
    end = [eos] if eos and meta.get("tokenizer.ggml.add_eos_token", False) else []
    if add or end:
        one = " ".join([t for t, _ in add] + ["$A"] + [t for t, _ in end])
        two = " ".join([t for t, _ in add] + ["$B"] + [t for t, _ in end])
        tok.post_processor = processors.TemplateProcessing(
            single=one, pair=f"{one} {two}", special_tokens=list(dict.fromkeys(add + end))
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos and bos[0],
        eos_token=eos and eos[0],
        unk_token=unk and unk[0],
        pad_token=pad and pad[0],
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=int(meta.get(f"{g.architecture}.context_length", 2048)),
        clean_up_tokenization_spaces=False,
    )
