"""Entry point of sglang's plugin loader (`sglang.srt.plugins`, and on
sglang >= 0.5.21 also `sglang.multimodal_gen.plugins`).

Installed but not enabled changes nothing: the loader calls `register()` in
every sglang process, and it returns at once unless SGLANG_EXT=1 (set by
`python -m sglang_ext.launch_server` or by the user, inherited by children).
"""

from __future__ import annotations


def register() -> None:
    from sglang_ext.activation import activate

    activate()
