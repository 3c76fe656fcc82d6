"""Entry point of sglang's plugin loader (`sglang.srt.plugins`, and on
sglang >= 0.5.21 also `sglang.multimodal_gen.plugins`).

Installed but not enabled changes nothing: the loader calls `register()` in
every sglang process, and it returns at once unless SGLANG_EXT is set (by
`python -m sglang_ext.launch_server` or by the user, inherited by children).
The off path imports nothing but `os` (already loaded): every sglang process
pays for it (`scripts/measure_plugin_overhead.py` measures it).
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
