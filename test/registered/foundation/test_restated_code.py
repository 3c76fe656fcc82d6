"""Only our own code: no run of 60 consecutive Python tokens identical to released sglang.

Runs scripts/check_restated.py over python/, test/ and scripts/ against the sglang 0.5.17 and
0.5.19 wheels (downloaded once into the wheel cache), and checks that the check itself finds a
restated function when one is planted, verbatim or reformatted.
"""

from __future__ import annotations

import os

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import check_restated  # noqa: E402

from conftest import released_source_root  # noqa: E402  (test/registered/conftest.py)

VERSIONS = ("0.5.17", "0.5.19")


@pytest.fixture(scope="module")
def upstream():
    """The released trees' token windows, read once for every test here."""
    return check_restated.Upstream([released_source_root(v) for v in VERSIONS])


def test_no_upstream_code_is_restated(upstream):
    found = upstream.find()
    assert not found, "restated from sglang " + ", ".join(VERSIONS) + ": " + "; ".join(
        f"{p}:{a}-{b}" for p, runs in sorted(found.items()) for a, b in runs)


def _upstream_function(root):
    with open(os.path.join(root, "sglang", "srt", "managers", "mm_utils.py"), encoding="utf-8") as f:
        upstream = f.read().splitlines()
    start = next(i for i, line in enumerate(upstream) if line.startswith("def get_embedding_chunk("))
    return upstream[start:start + 45]


def _found(upstream, text, tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(text)
    return upstream.runs(str(planted))


def test_a_planted_upstream_function_is_found(upstream, tmp_path):
    root = released_source_root("0.5.17")
    runs = _found(upstream, "x = 1\n" + "\n".join(_upstream_function(root)) + "\n", tmp_path)
    assert runs and runs[0][0] >= 2


def test_a_reformatted_upstream_function_is_found(upstream, tmp_path):
    """Re-indented into a class, its comments dropped and its docstring reworded: the same tokens."""
    root = released_source_root("0.5.17")
    body = []
    for line in _upstream_function(root):
        code = line.split("  #")[0].rstrip()
        if not code.strip().startswith("#"):
            body.append("    " + code)
    text = "class Holder:\n" + "\n".join(body) + "\n"
    quote = chr(34) * 3
    if quote in text:  # reword the docstring
        head, _, rest = text.partition(quote)
        _, _, tail = rest.partition(quote)
        text = head + quote + "Reworded, and longer than the short strings kept as written." + quote + tail
    assert text.count("\n") > 20 and "class Holder:" in text
    assert _found(upstream, text, tmp_path)
    assert not _found(upstream, "def ours(a, b):\n    return [a[i] + b[i] for i in range(len(a))]\n" * 20, tmp_path)
