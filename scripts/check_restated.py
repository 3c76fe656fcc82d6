#!/usr/bin/env python3
"""Find code restated from upstream: token runs identical to released sglang source.

The project contains only code we wrote (patches wrap, subclass or replace the small piece that
changes). This lists every run of at least --run (default 60) consecutive Python tokens of
python/, test/ and scripts/ that also occur, consecutively and in that order, in the `sglang/`
tree of a released wheel (default 0.5.17 and 0.5.19, unpacked by sglang_ext's wheel cache).
Tokens, not lines: a copy re-wrapped, re-indented, with its comments dropped or its strings and
docstrings reworded is still found (comments, line breaks and indentation are not tokens here;
a string literal longer than 24 characters counts as one token "S", shorter ones as written). Renaming every identifier would hide a copy; review
is the check for that.

    python scripts/check_restated.py              # exit 1 and one line per run found
    python scripts/check_restated.py --run 40     # stricter
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tokenize
from typing import Dict, List, Sequence, Tuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("python", "test", "scripts")
RUN = 60  # the shortest run reported, in tokens (about six lines of code)
SHORT_STRING = 24  # shorter string literals (keys, names) are compared as written: tables of them differ
_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
_FSTRING = tuple(getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, n))


class Vocabulary:
    """Token text -> small integer, shared by upstream and our files so their ids compare."""

    def __init__(self):
        self.ids: Dict[str, int] = {}

    def id(self, text: str) -> int:
        return self.ids.setdefault(text, len(self.ids) + 1)


def tokens(source: str, vocab: Vocabulary) -> Tuple[np.ndarray, np.ndarray]:
    """(token ids, line of each token) of `source`, normalized as the module docstring says; a file
    that does not tokenize gives what came before the error."""
    ids: List[int] = []
    lines: List[int] = []
    fstring_depth = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in _SKIPPED:
                continue
            if _FSTRING and tok.type == _FSTRING[0]:
                fstring_depth += 1
                if fstring_depth == 1:
                    ids.append(vocab.id("S"))
                    lines.append(tok.start[0])
                continue
            if _FSTRING and tok.type == _FSTRING[2]:
                fstring_depth -= 1
                continue
            if fstring_depth:
                continue
            long_string = tok.type == tokenize.STRING and len(tok.string) > SHORT_STRING
            ids.append(vocab.id("S" if long_string else tok.string))
            lines.append(tok.start[0])
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return np.asarray(ids, dtype=np.uint64), np.asarray(lines, dtype=np.int64)


def window_hashes(ids: np.ndarray, run: int) -> np.ndarray:
    """A 64-bit polynomial hash of every `run` consecutive token ids (wrapping arithmetic)."""
    if len(ids) < run:
        return np.zeros(0, dtype=np.uint64)
    count = len(ids) - run + 1
    out = np.zeros(count, dtype=np.uint64)
    base = np.uint64(1_000_003)
    with np.errstate(over="ignore"):
        for j in range(run):
            out = out * base + ids[j:j + count]
    return out


def upstream_windows(roots: Sequence[str], run: int, vocab: Vocabulary) -> np.ndarray:
    """Sorted hashes of every `run`-token window of the upstream trees' Python files."""
    parts = []
    for root in roots:
        for folder, _, files in os.walk(os.path.join(root, "sglang")):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                        parts.append(window_hashes(tokens(f.read(), vocab)[0], run))
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)


def restated_runs(path: str, windows: np.ndarray, run: int, vocab: Vocabulary) -> List[Tuple[int, int]]:
    """(first line, last line) of each maximal run of `path`'s tokens made of upstream windows."""
    with open(path, encoding="utf-8", errors="replace") as f:
        ids, lines = tokens(f.read(), vocab)
    ours = window_hashes(ids, run)
    at = np.minimum(np.searchsorted(windows, ours), max(len(windows) - 1, 0))
    hits = windows[at] == ours if len(windows) else np.zeros(len(ours), dtype=bool)
    runs, i = [], 0
    while i < len(hits):
        if not hits[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(hits) and hits[j + 1]:
            j += 1
        runs.append((int(lines[i]), int(lines[j + run - 1])))
        i = j + 1
    return runs


def our_files() -> List[str]:
    out = []
    for top in SCANNED:
        for folder, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            out += [os.path.join(folder, n) for n in sorted(files) if n.endswith(".py")]
    return out


class Upstream:
    """Every `run`-token window of released sglang trees, read once; where files of ours repeat them."""

    def __init__(self, roots: Sequence[str], run: int = RUN):
        self.run, self.vocab = run, Vocabulary()
        self.windows = upstream_windows(roots, run, self.vocab)

    def runs(self, path: str) -> List[Tuple[int, int]]:
        return restated_runs(path, self.windows, self.run, self.vocab)

    def find(self) -> Dict[str, List[Tuple[int, int]]]:
        """{path relative to the repository: its runs} over python/, test/ and scripts/."""
        found = {os.path.relpath(path, REPO): self.runs(path) for path in our_files()}
        return {path: runs for path, runs in found.items() if runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default="0.5.17,0.5.19")
    ap.add_argument("--run", type=int, default=RUN, help="shortest run reported (tokens)")
    args = ap.parse_args(argv)
    from sglang_ext_testkit import wheels  # installed with the checkout

    found = Upstream([wheels.ensure_unpacked(v) for v in args.versions.split(",")], args.run).find()
    for path, runs in sorted(found.items()):
        for first, last in runs:
            print(f"{path}:{first}-{last}: restated from sglang {args.versions}")
    print(f"check_restated: {sum(len(r) for r in found.values())} runs of >= {args.run} upstream tokens "
          f"in {len(found)} files")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
