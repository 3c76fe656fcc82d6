"""Only our own code: no run of 8 consecutive non-trivial lines identical to released sglang.

Runs scripts/check_restated.py over python/, test/ and scripts/ against the sglang 0.5.17 and
0.5.19 wheels (downloaded once into the wheel cache), and checks that the check itself finds a
restated run when one is planted.
"""

from __future__ import annotations

import os
import sys

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import check_restated  # noqa: E402

from conftest import released_source_root  # noqa: E402  (test/registered/conftest.py)

VERSIONS = ("0.5.17", "0.5.19")


def test_no_upstream_code_is_restated():
    windows = check_restated.upstream_windows([released_source_root(v) for v in VERSIONS], check_restated.RUN)
    found = {os.path.relpath(p, REPO): check_restated.restated_runs(p, windows, check_restated.RUN)
             for p in check_restated.our_files()}
    found = {p: runs for p, runs in found.items() if runs}
    assert not found, "restated from sglang " + ", ".join(VERSIONS) + ": " + "; ".join(
        f"{p}:{a}-{b}" for p, runs in sorted(found.items()) for a, b in runs)


def test_a_planted_upstream_function_is_found(tmp_path):
    root = released_source_root("0.5.17")
    source = os.path.join(root, "sglang", "srt", "managers", "mm_utils.py")
    with open(source, encoding="utf-8") as f:
        upstream = f.read().splitlines()
    start = next(i for i, line in enumerate(upstream) if line.startswith("def get_embedding_chunk("))
    planted = tmp_path / "planted.py"
    planted.write_text("x = 1\n" + "\n".join(upstream[start:start + 45]) + "\n")
    windows = check_restated.upstream_windows([root], check_restated.RUN)
    assert check_restated.restated_runs(str(planted), windows, check_restated.RUN)
