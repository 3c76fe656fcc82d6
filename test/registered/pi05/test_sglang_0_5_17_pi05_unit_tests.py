"""sglang 0.5.17's own Pi0.5 unit tests still pass with every sglang-ext patch applied.

The patches change PiGemma's projections, the action metadata and the Pi0.5
pipeline config in place; the unit tests that ship with the installed sglang
(`sglang/multimodal_gen/test/unit/`) pin 0.5.17's behaviour of those pieces
(loader key mapping, metadata fields, runtime helpers). They run in a child
process so that activation happens before sglang's test modules import anything.
"""

from __future__ import annotations

import os
import subprocess
import sys

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=70, suite="base-a-test-cpu")

UNIT_TESTS = (
    "test_pi05_action_api.py",
    "test_parallel_linear_weight_loading.py",
    "test_pi05_runtime_helpers.py",
)

_CHILD = """
import importlib, os, sys
import pytest
# the plugin, or on the patched tree the copy the fork series vendors (sglang.ext)
patched = os.environ.get("EXT_TEST_TREE", "plugin") == "patched"
activation = importlib.import_module("sglang.ext.activation" if patched else "sglang_ext.activation")
statuses = activation.activate(eager=True)
assert statuses["pi05_merged_linear"].state == "applied", statuses["pi05_merged_linear"]
assert statuses["pi05_config"].state == "applied", statuses["pi05_config"]
import sglang
unit = os.path.join(os.path.dirname(sglang.__file__), "multimodal_gen", "test", "unit")
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", unit]
                     + [os.path.join(unit, name) for name in sys.argv[1:]]))
"""


def test_installed_sglang_pi05_unit_tests_pass_with_patches(tmp_path):
    env = dict(os.environ, SGLANG_EXT="1", SGLANG_EXT_STRICT="1")
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, *UNIT_TESTS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1:] or [""]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in summary[0] and "failed" not in summary[0], summary
