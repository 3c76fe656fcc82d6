"""Only our own code: no run of 60 consecutive Python tokens identical to released sglang.

Runs scripts/check_restated.py over python/, test/ and scripts/ against the sglang 0.5.17 and
0.5.19 wheels (downloaded once into the wheel cache), and checks that the check itself finds a
restated function when one is planted, verbatim or reformatted.
"""

from __future__ import annotations

import os

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import check_restated  # noqa: E402

from conftest import released_source_root  # noqa: E402  (test/registered/conftest.py)

VERSIONS = ("0.5.17", "0.5.19")


def test_no_upstream_code_is_restated():
    roots = [released_source_root(v) for v in VERSIONS]
    vocab = check_restated.Vocabulary()
    windows = check_restated.upstream_windows(roots, check_restated.RUN, vocab)
    found = {os.path.relpath(p, REPO): check_restated.restated_runs(p, windows, check_restated.RUN, vocab)
             for p in check_restated.our_files()}
    found = {p: runs for p, runs in found.items() if runs}
    assert not found, "restated from sglang " + ", ".join(VERSIONS) + ": " + "; ".join(
        f"{p}:{a}-{b}" for p, runs in sorted(found.items()) for a, b in runs)


def _upstream_function(root):
    with open(os.path.join(root, "sglang", "srt", "managers", "mm_utils.py"), encoding="utf-8") as f:
        upstream = f.read().splitlines()
    start = next(i for i, line in enumerate(upstream) if line.startswith("def get_embedding_chunk("))
    return upstream[start:start + 45]


def _found(root, text, tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(text)
    vocab = check_restated.Vocabulary()
    windows = check_restated.upstream_windows([root], check_restated.RUN, vocab)
    return check_restated.restated_runs(str(planted), windows, check_restated.RUN, vocab)


def test_a_planted_upstream_function_is_found(tmp_path):
    root = released_source_root("0.5.17")
    runs = _found(root, "x = 1\n" + "\n".join(_upstream_function(root)) + "\n", tmp_path)
    assert runs and runs[0][0] >= 2


def test_a_reformatted_upstream_function_is_found(tmp_path):
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
    assert _found(root, text, tmp_path)
    assert not _found(root, "def ours(a, b):\n    return [a[i] + b[i] for i in range(len(a))]\n" * 20, tmp_path)
