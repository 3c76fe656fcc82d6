"""Which Python packages a command needs and this interpreter lacks, and the one line that says so (sglang-ext
declares no dependencies, so commands check here and exit 2 instead of a ModuleNotFoundError traceback).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import List, Optional, Sequence

# How to get an environment that has them (README, Quick start).
HOW_TO_INSTALL = ("install sglang-ext into the environment that has sglang 0.5.17 and its torch "
                  "(pip install --no-deps .), or build the test environment from the sglang-ext clone: "
                  "bash scripts/install_cpu_env.sh")


def missing_modules(names: Sequence[str]) -> List[str]:
    """The top-level modules of `names` that this interpreter cannot import (found, never imported)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def interpreter() -> str:
    """This interpreter as a user would type it: relative to the working directory when below it."""
    exe = sys.executable or "python"
    try:
        rel = os.path.relpath(exe)
    except ValueError:  # another drive (Windows)
        return exe
    return exe if rel.startswith("..") else rel


def missing_message(missing: Sequence[str], what: Optional[str] = None) -> str:
    """One line: which packages (that `what` needs) this interpreter lacks, and what to do."""
    names = " and ".join(missing) if len(missing) <= 2 else ", ".join(missing[:-1]) + " and " + missing[-1]
    verb = "is" if len(missing) == 1 else "are"
    needs = f"{what} needs {names}, which {verb}" if what else f"{names} {verb}"
    return f"{needs} not installed in {interpreter()}; {HOW_TO_INSTALL}"
