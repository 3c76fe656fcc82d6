"""The house stays readable: the limits a newcomer relies on, checked on the checkout.

README.md at most 200 lines and no line over 240 characters; docs/ at most 1,500 lines; no package
module over 500 lines; the package under its line budget (a ratchet: lower it as the package
shrinks, never raise it to fit a change); knob help says what a knob does, never what a run measured.
"""

from __future__ import annotations

import glob
import os
import re

from sglang.test.ci.ci_register import register_cpu_ci

from sglang_ext.knobs import KNOBS

register_cpu_ci(est_time=1, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PACKAGE_LINE_BUDGET = 8_966
# a measurement: a speed ratio, a time, a rate, a statistic or a machine (help may name sizes, limits, growth)
_MEASURED = re.compile(r"\d(\.\d+)?x\b|\d\s*(ms|req/s)(?![\w-])|\bmedian|\bp50\b|\bp99\b|\bH[12]00\b")


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def test_readme_is_short_with_no_long_lines():
    lines = _lines(os.path.join(REPO, "README.md"))
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 240]
    assert len(lines) <= 200 and not long, (len(lines), long)


def test_docs_are_short():
    total = sum(len(_lines(p)) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
    assert 0 < total <= 1500, total


def test_package_modules_and_size():
    sizes = {os.path.relpath(p, REPO): len(_lines(p))
             for p in glob.glob(os.path.join(REPO, "python", "sglang_ext", "**", "*.py"), recursive=True)}
    assert not {p: n for p, n in sizes.items() if n > 500}
    assert len(sizes) > 50 and sum(sizes.values()) <= PACKAGE_LINE_BUDGET, sum(sizes.values())


def test_package_modules_apply_without_whitespace_warnings():
    """The patch series carries the modules: git apply warns on trailing blanks and blank lines at EOF."""
    bad = []
    for path in glob.glob(os.path.join(REPO, "python", "sglang_ext", "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text and (text.endswith("\n\n") or not text.endswith("\n") or re.search(r"[ \t]+$", text, re.M)):
            bad.append(os.path.relpath(path, REPO))
    assert not bad, bad


def test_knob_help_carries_no_measurements():
    found = {k.name: m.group(0) for k in KNOBS for m in [_MEASURED.search(k.help)] if m}
    assert not found, found
    assert _MEASURED.search("1.28x over six passes") and _MEASURED.search("req/s medians")  # the pattern bites
