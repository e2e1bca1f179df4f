"""GGUF tokenizers (``osd.models.gguf.tokenizer``): byte-level BPE against the tokenizers
library, llama.cpp's pre-tokenizer splits, SentencePiece from scores, and chat templates.
The vocabulary files llama.cpp ships are checked by ``scripts/check_gguf_vocabs.py``
(docs/gguf.md)."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from osd.chat_template import apply_chat_template, encode_chat, plain_transcript
from osd.models.gguf import write_gguf
from osd.models.gguf.tokenizer import _bpe_tokenizer
from osd.models.loading import load_tokenizer

VOCAB = 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it?",
    "Hello world! Hello there, the world says hello back 12345 times.",
] * 20


def trained_bpe() -> Tokenizer:
    """A byte-level BPE of 300 tokens (the GPT-2 recipe) trained on CORPUS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB
    return tok


def bpe_metadata(tok: Tokenizer, pre: str = "gpt2") -> dict:
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_bpe_tokenizer_matches_the_tokenizers_library(pre, tmp_path):
    ref = trained_bpe()
    if pre == "smollm":  # llama.cpp's "smollm": every digit split off first
        ref.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    path = tmp_path / "t.gguf"
    write_gguf(path, {"general.architecture": "llama", **bpe_metadata(ref, pre)}, {})
    tok = load_tokenizer(path)
    texts = [
        "Hello world!",
        "  two  spaces\n\nand\ttabs",
        "x = 12345 + 6.78",
        "café 日本 🤗",
        "<|im_start|>user\nhi<|im_end|>",
        "isn't it's we'll",
    ]
    for text in texts:
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [1]  # control tokens stay whole
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("default", ["abc", " ", "123", "45", "!!", " HelloWorld", " isn", "'", "t"]),
        ("gpt2", ["abc", " 12345", "!!", " HelloWorld", " isn", "'t"]),
        ("llama-bpe", ["abc", " ", "123", "45", "!!", " HelloWorld", " isn", "'t"]),
        ("qwen2", ["abc", " ", "1", "2", "3", "4", "5", "!!", " HelloWorld", " isn", "'t"]),
        (
            "deepseek-coder",
            ["abc", " ", "1", "2", "3", "4", "5", "!!", " HelloWorld", " isn", "'", "t"],
        ),
        ("tekken", ["abc", " ", "1", "2", "3", "4", "5", "!!", " Hello", "World", " isn", "'t"]),
        ("gpt-4o", ["abc", " ", "123", "45", "!!", " Hello", "World", " isn't"]),
    ],
)
def test_bpe_pre_tokenizers_split_as_llama_cpp(pre, pieces):
    """Each pre-tokenizer splits text as llama.cpp's regexes for it do (the real
    vocabularies are checked by scripts/check_gguf_vocabs.py, docs/gguf.md)."""
    tok = _bpe_tokenizer(bpe_metadata(trained_bpe(), pre))
    got = tok.pre_tokenizer.pre_tokenize_str("abc 12345!! HelloWorld isn't")
    assert [p.replace("Ġ", " ") for p, _ in got] == pieces


def test_llama3_bpe_takes_whole_words_and_adds_bos(tmp_path):
    """Llama 3's pre-tokenizer takes a word found whole in the vocabulary as one token,
    merges or not, and adds BOS unless the file says otherwise."""
    ref = trained_bpe()
    for pre in ("llama-bpe", "gpt2"):
        meta = bpe_metadata(ref, pre)
        del meta["tokenizer.ggml.add_bos_token"]
        meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["Ġzqxj"]
        meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [1]
        write_gguf(tmp_path / f"{pre}.gguf", {"general.architecture": "llama", **meta}, {})
        ids = load_tokenizer(tmp_path / f"{pre}.gguf").encode(" zqxj")
        if pre == "llama-bpe":
            assert ids == [1, VOCAB]
        else:  # no merge leads to the word: byte-level pieces, no BOS
            assert VOCAB not in ids and ids[0] != 1 and len(ids) > 1


def test_sentencepiece_tokenizer(tmp_path):
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "a",
        "b",
        "c",
        "ab",
        "▁h",
        "ll",
        "▁he",
        "▁hell",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "bc",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + pieces
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))][::-1]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    path = tmp_path / "spm.gguf"
    write_gguf(path, meta, {})
    tok = load_tokenizer(path)
    ids = tok.encode("hello world")
    assert ids[0] == 1  # BOS added (llama default)
    assert [tokens[i] for i in ids[1:]] == ["▁hello", "▁world"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    # "bc" outscores "ab" (a later piece scores higher), so it merges first.
    assert [tokens[i] for i in tok.encode("abc", add_special_tokens=False)] == ["▁", "a", "bc"]
    e = tok.encode("hé", add_special_tokens=False)  # é is not in the vocabulary
    assert [tokens[i] for i in e] == ["▁h", "<0xC3>", "<0xA9>"]
    assert tok.decode(e) == "hé"


def test_apply_chat_template_and_its_errors(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, {"general.architecture": "llama", **bpe_metadata(trained_bpe())}, {})
    tok = load_tokenizer(path)
    convs = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    ]
    ids = apply_chat_template(tok, convs)
    assert tok.decode(ids[0]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids[1]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    with pytest.raises(TypeError, match="pass \\[messages\\]"):
        apply_chat_template(tok, convs[0])
    with pytest.raises(ValueError, match="conversations is empty"):
        apply_chat_template(tok, [])
    with pytest.raises(ValueError, match="conversation 0 is empty"):
        apply_chat_template(tok, [[]])
    with pytest.raises(ValueError, match="message 0 has role 'bot'"):
        apply_chat_template(tok, [[{"role": "bot", "content": "x"}]])
    with pytest.raises(ValueError, match="message 1 has no 'role'"):
        apply_chat_template(tok, [[{"role": "user", "content": "x"}, {"content": "y"}]])
    with pytest.raises(ValueError, match="has no 'content'"):
        apply_chat_template(tok, [[{"role": "user"}]])
    with pytest.raises(TypeError, match="content must be a str"):
        apply_chat_template(tok, [[{"role": "user", "content": 3}]])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, convs)


def test_a_base_model_is_asked_in_a_transcript(tmp_path):
    """encode_chat: the chat template when there is one, else a question-and-answer
    transcript encoded as a plain prompt."""
    path = tmp_path / "t.gguf"
    write_gguf(path, {"general.architecture": "llama", **bpe_metadata(trained_bpe())}, {})
    tok = load_tokenizer(path)
    conv = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
    ]
    text = "Be brief.\n\nQuestion: hi\nAnswer: hello\n\nQuestion: 2+2?\nAnswer:"
    assert plain_transcript(conv) == text
    assert encode_chat(tok, [conv]) == apply_chat_template(tok, [conv])
    tok.chat_template = None
    ids = encode_chat(tok, [conv, conv[1:2]])
    assert ids[0] == list(tok(text)["input_ids"]) and tok.decode(ids[1]) == "Question: hi\nAnswer:"
    with pytest.raises(TypeError, match="pass \\[messages\\]"):
        encode_chat(tok, conv)
