"""`python -m sglang_ext.serve <sglang serve args> [--ext-* flags]`: `sglang serve` with sglang-ext switched on
here and (through the environment) in every child process."""

from __future__ import annotations

import sys

from sglang_ext.tools.launcher import main

PROG = "python -m sglang_ext.serve"


def run_sglang_serve(argv: list[str]) -> None:
    from sglang.cli.main import main as sglang_main

    sys.argv = ["sglang", "serve", *argv]
    sglang_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], PROG, run_sglang_serve))
