"""`python -m sglang_ext doctor ...` (same as the `sglang-ext` console script)."""

import sys

from sglang_ext.tools.cli import main

sys.exit(main())
