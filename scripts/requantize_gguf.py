"""Write the chat target (or any GGUF) in another llama.cpp quantization, with llama.cpp's
own quantizer (llama-cpp-python, the optional ``bench`` extra): for example the Q4_K_M
file most GGUF users download, to check osd's K-quant loading and ``quantized=True`` on a
file llama.cpp wrote, and to benchmark it (``OSD_BENCH_CHAT_TARGET``, bench/bench_chat.py).

    .venv/bin/python scripts/requantize_gguf.py --ftype Q4_K_M --out /tmp/smollm2.Q4_K_M.gguf

The chat target is stored in Q4_1, so this re-quantizes its dequantized weights
(``allow_requantize``): the file holds K-quant blocks of the Q4_1 values.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

from osd.models.gguf import GGUFFile, type_name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=None, help="input GGUF (default: the chat target)")
    parser.add_argument("--ftype", default="Q4_K_M",
                        help="llama.cpp file type name: Q4_K_M, Q5_K_M, Q3_K_M, Q2_K, ...")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("error: llama-cpp-python is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
        return 2
    source = args.source
    if source is None:
        from osd.zoo import chat
        source = chat.fetch_target()
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.ftype.upper()}", None)
    if ftype is None:
        print(f"error: llama.cpp has no file type {args.ftype!r}", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = args.threads
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(args.out),
                                        ctypes.byref(params))
    if rc != 0:
        print(f"error: llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    counts: dict[str, int] = {}
    for info in GGUFFile(args.out).tensors.values():
        name = type_name(info.type)
        counts[name] = counts.get(name, 0) + 1
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB): tensors by type "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
