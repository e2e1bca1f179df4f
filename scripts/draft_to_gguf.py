"""Write an osd draft directory as a GGUF file for llama.cpp's draft-model mode (``-md``):
:func:`osd.models.gguf.export.write_draft_gguf` (the target's tokenizer metadata, the
draft's shape, Q8_0, llama.cpp's Q/K row order). ``bench/bench_llamacpp.py`` writes the chat
draft this way for its ``llama.cpp-draft`` row.

    .venv/bin/python scripts/draft_to_gguf.py --target TARGET.gguf --draft DIR --out draft.gguf
"""

from __future__ import annotations

import argparse
import os
import sys

from osd.models.gguf.export import write_draft_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target's GGUF file (its tokenizer)")
    ap.add_argument("--draft", required=True, help="the draft directory")
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    args = ap.parse_args()
    try:
        cfg = write_draft_gguf(args.target, args.draft, args.out)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(
        f"draft_to_gguf: wrote {args.out} ({cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, {os.path.getsize(args.out) / 1e6:.1f} MB)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
