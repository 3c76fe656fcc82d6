#!/usr/bin/env python3
"""Find code restated from upstream: runs of consecutive lines identical to released sglang source.

The project contains only code we wrote (patches wrap, subclass or replace the small piece that
changes). This lists every run of at least --run (default 8) consecutive non-trivial lines of
python/, test/ and scripts/ that also occur, consecutively and in that order, in the `sglang/`
tree of a released wheel (default 0.5.17 and 0.5.19, unpacked by sglang_ext's wheel cache).
Lines are compared stripped of indentation and trailing comments; blank lines, comments,
docstring quotes, imports, and short lines (brackets, `else:`, `return x`) are not counted and
do not break a run.

    python scripts/check_restated.py              # exit 1 and one line per run found
    python scripts/check_restated.py --run 6      # stricter
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from typing import Dict, Iterable, List, Sequence, Set, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("python", "test", "scripts")
RUN = 8  # the shortest run reported, in significant lines
MIN_CHARS = 12  # shorter lines (`else:`, `)`, `return out`) say nothing about where code came from


def significant(lines: Sequence[str]) -> List[Tuple[int, str]]:
    """(line number, normalized text) of the lines that count."""
    out = []
    for number, raw in enumerate(lines, 1):
        text = raw.split("  #")[0].strip()
        if (len(text) < MIN_CHARS or text.startswith(("#", '"""', "'''", "import ", "from ", "@"))
                or text in ('"""', "'''")):
            continue
        out.append((number, text))
    return out


def _digest(texts: Iterable[str]) -> bytes:
    return hashlib.blake2b("\n".join(texts).encode(), digest_size=12).digest()


def upstream_windows(roots: Sequence[str], run: int) -> Set[bytes]:
    """Digests of every `run` consecutive significant lines of the upstream trees."""
    seen: Set[bytes] = set()
    for root in roots:
        for folder, _, files in os.walk(os.path.join(root, "sglang")):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                        texts = [t for _, t in significant(f.read().splitlines())]
                    seen.update(_digest(texts[i:i + run]) for i in range(len(texts) - run + 1))
    return seen


def restated_runs(path: str, windows: Set[bytes], run: int) -> List[Tuple[int, int]]:
    """(first line, last line) of each maximal run of `path` made of upstream windows."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = significant(f.read().splitlines())
    hits = [_digest(t for _, t in lines[i:i + run]) in windows for i in range(len(lines) - run + 1)]
    runs, i = [], 0
    while i < len(hits):
        if not hits[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(hits) and hits[j + 1]:
            j += 1
        runs.append((lines[i][0], lines[j + run - 1][0]))
        i = j + 1
    return runs


def our_files() -> List[str]:
    out = []
    for top in SCANNED:
        for folder, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            out += [os.path.join(folder, n) for n in sorted(files) if n.endswith(".py")]
    return out


def find(versions: Sequence[str], run: int) -> Dict[str, List[Tuple[int, int]]]:
    sys.path.insert(0, os.path.join(REPO, "test"))
    from sglang_ext_testkit import wheels

    windows = upstream_windows([wheels.ensure_unpacked(v) for v in versions], run)
    found = {}
    for path in our_files():
        runs = restated_runs(path, windows, run)
        if runs:
            found[os.path.relpath(path, REPO)] = runs
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default="0.5.17,0.5.19")
    ap.add_argument("--run", type=int, default=RUN, help="shortest run reported (significant lines)")
    args = ap.parse_args(argv)
    found = find(args.versions.split(","), args.run)
    for path, runs in sorted(found.items()):
        for first, last in runs:
            print(f"{path}:{first}-{last}: restated from sglang {args.versions}")
    print(f"check_restated: {sum(len(r) for r in found.values())} runs of >= {args.run} upstream lines "
          f"in {len(found)} files")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
