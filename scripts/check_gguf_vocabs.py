"""Check osd's GGUF tokenizers against llama.cpp on the vocabulary files llama.cpp ships.

llama.cpp's sources (``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36``,
unpacked) hold vocabulary-only GGUF files, ``models/ggml-vocab-*.gguf``, most with test
texts (``.inp``) and the token ids llama.cpp gives them (``.out``). For each file the
script builds osd's tokenizer (:func:`osd.models.gguf.tokenizer_from_gguf`) and prints:

- its tokenizer model and pre-tokenizer, or why osd does not read it;
- how many of llama.cpp's test texts osd encodes to llama.cpp's ids (no special tokens);
- with llama-cpp-python installed: how many of 200 passages of the Python standard
  library's sources and docs (1 to 600 characters, some with the vocabulary's BOS or EOS
  text inside) osd encodes as llama.cpp does with BOS added as the file says and special
  tokens parsed, and how many (without those) decode back to their text.

One more row comes from a vocabulary rewritten here: ``llama-spm`` with
``tokenizer.ggml.add_space_prefix`` false (how llama.cpp writes Gemma's SentencePiece
vocabularies), through :func:`osd.models.gguf.write_gguf`.

    .venv/bin/python scripts/check_gguf_vocabs.py \\
        --llama-cpp /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import sysconfig
import tempfile
import warnings

from osd.models.gguf import GGUFFile, tokenizer_from_gguf, write_gguf

PASSAGES = 200


def stdlib_passages(n: int, seed: int = 0) -> list[str]:
    """``n`` passages of the standard library's Python sources, 1 to 600 characters each."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        text = open(rng.choice(files), encoding="utf-8", errors="replace").read()
        if len(text) < 10:
            continue
        start = rng.randrange(len(text))
        out.append(text[start : start + rng.randint(1, 600)])
    return out


def llama_cpp_test_texts(path: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test texts for ``path`` and the ids llama.cpp gives them."""
    if not os.path.exists(path + ".inp"):
        return []
    texts = open(path + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    outs = open(path + ".out", encoding="utf-8").read().split("\n")
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


def check(path: str, passages: list[str]) -> str:
    """One markdown table row for the vocabulary file ``path``."""
    name = os.path.basename(path)[len("ggml-vocab-") : -len(".gguf")]
    g = GGUFFile(path)
    kind = g.metadata.get("tokenizer.ggml.model")
    pre = g.metadata.get("tokenizer.ggml.pre", "")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = tokenizer_from_gguf(g)
    except ValueError as e:
        return f"| {name} | {kind} | {pre} | not read: {str(e).split(': ', 1)[-1]} | | |"
    tests = llama_cpp_test_texts(path)
    own = sum(tok.encode(t, add_special_tokens=False) == ids for t, ids in tests)
    own_cell = f"{own}/{len(tests)}" if tests else "(no test texts)"
    try:
        import llama_cpp  # optional dependency: the row says when it is absent
    except ImportError:
        return f"| {name} | {kind} | {pre} | {own_cell} | (llama-cpp-python absent) | |"
    ref = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    rng = random.Random(1)
    specials = [
        tok.convert_ids_to_tokens(i) for i in (tok.bos_token_id, tok.eos_token_id) if i is not None
    ]
    same = back = 0
    for text in passages:
        back += tok.decode(tok.encode(text, add_special_tokens=False)) == text
        if specials and rng.random() < 0.25:
            cut = rng.randrange(len(text) + 1)
            text = text[:cut] + rng.choice(specials) + text[cut:]
        ids = tok(text).input_ids
        same += ids == ref.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    return (
        f"| {name} | {kind} | {pre} | {own_cell} | {same}/{len(passages)} "
        f"| {back}/{len(passages)} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--llama-cpp",
        required=True,
        help="llama.cpp's source directory (with models/ggml-vocab-*.gguf)",
    )
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.llama_cpp, "models", "ggml-vocab-*.gguf")))
    if not files:
        raise SystemExit(f"no models/ggml-vocab-*.gguf under {args.llama_cpp!r}")
    passages = stdlib_passages(PASSAGES)
    print(
        "| vocabulary | model | pre-tokenizer | llama.cpp's test texts, ids equal "
        "| standard-library passages (BOS, special tokens), ids equal to llama.cpp "
        "| decoded back to the text |"
    )
    print("|---|---|---|---|---|---|")
    for path in files:
        print(check(path, passages), flush=True)
    spm = os.path.join(args.llama_cpp, "models", "ggml-vocab-llama-spm.gguf")
    if os.path.exists(spm):
        with tempfile.TemporaryDirectory() as tmp:
            print(check(without_space_prefix(spm, tmp), passages), flush=True)


def without_space_prefix(path: str, directory: str) -> str:
    """A copy of vocabulary file ``path`` with ``tokenizer.ggml.add_space_prefix`` false."""
    meta = dict(GGUFFile(path).metadata)
    meta["tokenizer.ggml.add_space_prefix"] = False
    out = os.path.join(directory, "ggml-vocab-llama-spm-no-space-prefix.gguf")
    write_gguf(out, meta, {})
    return out


if __name__ == "__main__":
    main()
