"""The ``osd`` command line: ``osd demo``, ``osd generate``, ``osd serve``, ``osd draft``,
``osd bench``.

Errors in what the user asked for (bad paths, bad parameters, over-long prompts) print
one ``error:`` line and exit with status 2, never a traceback. Each command imports its
own modules inside its function (``osd.cli.commands``): ``osd --help`` and a command's
argument errors answer at once, without importing torch, transformers or uvicorn.
"""

from __future__ import annotations

import sys

from osd.cli.parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
