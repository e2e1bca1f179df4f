"""Regenerate ``osd/zoo/weights/draft_code``: a second draft trained mostly on the "code"
domain (the built-in draft is trained mostly on prose). The router tests and examples
use the two drafts as domain specialists.

Same shape and schedule as the built-in draft (``osd.zoo.train.DRAFT``), with
``code_fraction=0.9`` and seed 2; the tokenizer is retrained deterministically, so it is
the pair's. About 4 minutes on 2 CPU cores.

Usage: python scripts/build_code_draft.py [--threads 1]
"""
import argparse
import os
import shutil
import tempfile
from dataclasses import replace

import torch

from osd.zoo import WEIGHTS_DIR, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        _, draft_dir = train.build(tmp, draft=replace(train.DRAFT, code_fraction=0.9, seed=2),
                                   roles=("draft",))
        dest = os.path.join(WEIGHTS_DIR, "draft_code")
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        shutil.copytree(draft_dir, dest)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
