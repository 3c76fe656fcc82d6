"""Entry point of sglang's plugin loader (`sglang.srt.plugins`, and on
sglang >= 0.5.21 also `sglang.multimodal_gen.plugins`).

The loader calls `register()` in every sglang process; unless SGLANG_EXT is set it returns at once,
importing nothing but `os` (scripts/measure_plugin_overhead.py measures that).
"""

from __future__ import annotations

import os


def register() -> None:
    # Unset, empty or "0": off without importing anything. Any other value goes to
    # activate(), which validates it (a bad value stops start-up).
    if os.environ.get("SGLANG_EXT", "").strip() in ("", "0"):
        return
    import sys

    from sglang_ext.activation import activate
    from sglang_ext.errors import ExtConfigError, SglangExtActivationError
    from sglang_ext.tools.launcher import USAGE_EXIT  # a bad setting is a usage error, as in the launchers

    try:
        activate()
    except SglangExtActivationError as exc:
        if not isinstance(exc.__cause__, ExtConfigError):
            raise  # strict mode: the traceback shows where the patch failed
        # A bad setting: one line and exit 2, no traceback. SystemExit, not os._exit: it passes the loader
        # (which catches Exception), runs finally blocks and atexit handlers, ends a multiprocessing child
        # with this status, and a program that embeds sglang (an Engine in a notebook) can still catch it.
        print(exc, file=sys.stderr, flush=True)
        raise SystemExit(USAGE_EXIT) from None
