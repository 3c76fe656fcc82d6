"""`python -m sglang_ext.launch_server <args> [--ext-* flags]`: `python -m sglang.launch_server` with sglang-ext
switched on here and (through the environment) in every child process."""

from __future__ import annotations

import runpy
import sys

from sglang_ext.tools.launcher import main

PROG = "python -m sglang_ext.launch_server"


def run_sglang_launch_server(argv: list[str]) -> None:
    """Run `python -m sglang.launch_server` with `argv` (alter_sys: children re-import it as `__mp_main__`)."""
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], PROG, run_sglang_launch_server))
