"""``python -m osd.cli``: the ``osd`` command."""

import sys

from osd.cli import main

sys.exit(main())
