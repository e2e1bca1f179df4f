"""Write the chat target (or any GGUF) in another llama.cpp quantization, with llama.cpp's
own quantizer (llama-cpp-python, the optional ``bench`` extra): for example the Q4_K_M
file most GGUF users download, to check osd's K-quant loading and ``quantized=True`` on a
file llama.cpp wrote, and to benchmark it (``OSD_BENCH_CHAT_TARGET``, bench/bench_chat.py).

    .venv/bin/python scripts/requantize_gguf.py --ftype Q4_K_M --out /tmp/smollm2.Q4_K_M.gguf
    .venv/bin/python scripts/requantize_gguf.py --check /tmp/smollm2.Q4_K_M.gguf

The chat target is stored in Q4_1, so this re-quantizes its dequantized weights
(``allow_requantize``): the file holds K-quant blocks of the Q4_1 values.

``--check FILE``: loads the file as osd does (dequantized, and ``quantized=True``), prints
which linear layers stay quantized and their bytes, asserts that both give the same greedy
tokens on HumanEval chat prompts, and prints for how many tokens llama.cpp's greedy output
on the same file agrees (llama.cpp quantizes activations for its dot products, so the two
part ways after a while; wrong weights would part at once).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

import osd
from osd.chat_template import apply_chat_template
from osd.models.gguf import GGUFFile, type_name
from osd.models.quant import QuantLinear
from osd.zoo import chat, humaneval


def check(path: str, prompts: int = 3, new_tokens: int = 64) -> None:
    """The ``--check`` report for GGUF file ``path`` (see the module docstring)."""
    import llama_cpp  # optional dependency (the bench extra); main() checks it is there

    torch.set_num_threads(2)
    plain = osd.Engine.from_pretrained(path, max_batch_size=1, max_seq_len=1024)
    quant = osd.Engine.from_pretrained(path, max_batch_size=1, max_seq_len=1024, quantized=True)
    m = quant.model
    layers = [
        getattr(layer, n) for layer in m.layers for n in ("wqkv", "wo", "w_gate_up", "w_down")
    ] + [m.lm_head]
    held = [x for x in layers if isinstance(x, QuantLinear)]
    qbytes = sum(
        t.numel() * t.element_size()
        for x in held
        for t in (x.qweight, x.scales, x.mins)
        if t is not None
    )
    fbytes = sum(
        x.weight.numel() * x.weight.element_size() for x in layers if not isinstance(x, QuantLinear)
    )
    print(
        f"{path}: {len(held)} of {len(layers)} linear layers kept quantized "
        f"({', '.join(sorted({x.fmt for x in held}))}): {qbytes / 2**20:.1f} MiB of codes "
        f"and factors, {fbytes / 2**20:.1f} MiB float32 in the rest"
    )
    ids = apply_chat_template(plain.tokenizer, humaneval.conversations(prompts, seed=11))
    params = osd.SamplingParams(new_tokens)
    ref = [o.token_ids for o in plain.generate(ids, params)]
    assert [o.token_ids for o in quant.generate(ids, params)] == ref, (
        "quantized=True differs from the dequantized model"
    )
    print(f"quantized=True greedy == dequantized greedy on {prompts} prompts x {new_tokens} tokens")
    llm = llama_cpp.Llama(path, n_threads=2, n_ctx=1024, verbose=False)
    agree = []
    for p, r in zip(ids, ref):
        out = []
        for t in llm.generate(p, temp=0.0, reset=True):
            if t in plain.eos_token_ids or len(out) >= new_tokens:
                break
            out.append(t)
        agree.append(
            next((i for i, (x, y) in enumerate(zip(out, r)) if x != y), min(len(out), len(r)))
        )
    print(
        f"llama.cpp greedy on the same file agrees with osd for the first {agree} tokens "
        f"(of {[len(r) for r in ref]})"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=None, help="input GGUF (default: the chat target)")
    parser.add_argument(
        "--ftype",
        default="Q4_K_M",
        help="llama.cpp file type name: Q4_K_M, Q5_K_M, Q3_K_M, Q2_K, ...",
    )
    parser.add_argument("--out", help="the GGUF file to write")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check", metavar="FILE", help="check FILE instead (see above)")
    args = parser.parse_args(argv)
    if not args.out and not args.check:
        parser.error("--out is required (or --check FILE)")
    try:
        import llama_cpp  # optional dependency (the bench extra)
    except ImportError:
        print(
            "error: llama-cpp-python is not installed (pip install -e '.[bench]')", file=sys.stderr
        )
        return 2
    if args.check:
        check(args.check)
        return 0
    source = args.source
    if source is None:
        source = chat.fetch_target()
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.ftype.upper()}", None)
    if ftype is None:
        print(f"error: llama.cpp has no file type {args.ftype!r}", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = args.threads
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(
        os.fsencode(source), os.fsencode(args.out), ctypes.byref(params)
    )
    if rc != 0:
        print(f"error: llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    counts: dict[str, int] = {}
    for info in GGUFFile(args.out).tensors.values():
        name = type_name(info.type)
        counts[name] = counts.get(name, 0) + 1
    print(
        f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB): tensors by type "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
