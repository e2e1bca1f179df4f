"""``osd draft build`` from a source checkout without the ``osd`` command on the path:
build the chat pair's draft by distillation, or measure it. The recipe lives in
``osd/draft_build/``; ``osd draft build --help`` describes the options.

    python scripts/build_chat_draft.py --help
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from osd.draft_build.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
