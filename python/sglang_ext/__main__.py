"""`python -m sglang_ext doctor ...` (same as the `sglang-ext` console script)."""

from sglang_ext.tools.cli import main

raise SystemExit(main())
