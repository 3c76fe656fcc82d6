"""Entry point of sglang's plugin loader (`sglang.srt.plugins`, and on
sglang >= 0.5.21 also `sglang.multimodal_gen.plugins`).

The loader calls `register()` in every sglang process; unless SGLANG_EXT is set it returns at once,
importing nothing but `os` (scripts/measure_plugin_overhead.py measures that).
"""

from __future__ import annotations

import os


def register() -> None:
    # Unset, empty or "0": off without importing anything. Any other value goes to
    # activate(), which validates it (a bad value stops start-up, "off" stays off).
    if os.environ.get("SGLANG_EXT", "").strip() in ("", "0"):
        return
    from sglang_ext.activation import activate

    activate()
