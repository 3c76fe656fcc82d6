"""The README's Quick start, read from README.md itself (import it to use it).

Each step is the ```bash block after a `<!-- quickstart:NAME -->` marker; its command lines are
what a newcomer pastes, in order. `no_gpu_line()` is the line the README says step 3 ends with
on a machine without a GPU, and the exit status it names.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Tuple

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
README = os.path.join(REPO, "README.md")
STEPS = ("install", "test", "serve")
_STEP = re.compile(r"<!-- quickstart:(\w+) -->\n```bash\n(.*?)```", re.S)
_NO_GPU = re.compile(r"without an NVIDIA GPU.*?exit\s+status\s+(\d+):\s*```\n(.*?)\n```", re.S | re.I)


def readme_text() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def quickstart_steps(text: str = "") -> Dict[str, List[str]]:
    """{step: [command line, ...]} in README order; raises ValueError unless the steps are
    exactly STEPS, in that order, each with at least one command."""
    found = [(name, [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")])
             for name, body in _STEP.findall(text or readme_text())]
    if [name for name, _ in found] != list(STEPS) or not all(lines for _, lines in found):
        raise ValueError(f"README quick start steps are {[name for name, _ in found]}, each needs commands; "
                         f"expected {list(STEPS)}")
    return dict(found)


def no_gpu_line(text: str = "") -> Tuple[int, List[str]]:
    """(documented exit status, the fragments of the documented line between its `...`)."""
    match = _NO_GPU.search(text or readme_text())
    if match is None:
        raise ValueError("README does not show the line step 3 ends with on a machine without a GPU")
    return int(match.group(1)), [part.strip() for part in match.group(2).split("...") if part.strip()]
