"""The wheel: pulls neither torch nor sglang, ships every module and the fingerprint tables,
and declares the plugin entry points and the console script."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_ext import wheels

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # build from a copy: an in-tree build would leave build/ and egg-info in the checkout
    tree = tmp_path_factory.mktemp("tree")
    shutil.copy(os.path.join(REPO, "setup.py"), tree)
    shutil.copytree(os.path.join(REPO, "python"), tree / "python",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           str(tree), "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = glob.glob(str(out / "sglang_ext-*.whl"))
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        meta = {n.split("/", 1)[1]: zf.read(n).decode() for n in names if ".dist-info/" in n}
    return names, meta


def test_wheel_requires_nothing_outside_an_extra(wheel):
    _, meta = wheel
    requires = [line for line in meta["METADATA"].splitlines() if line.startswith("Requires-Dist:")]
    assert requires, "the optional sglang pin (extra) is missing"
    assert all("extra ==" in line for line in requires), requires  # torch and sglang stay the user's


def test_wheel_ships_every_module_and_the_fingerprint_tables(wheel):
    names, _ = wheel
    src = os.path.join(REPO, "python")
    modules = {os.path.relpath(p, src) for p in glob.glob(os.path.join(src, "sglang_ext", "**", "*.py"),
                                                          recursive=True)}
    missing = sorted(m for m in modules if m.replace(os.sep, "/") not in names)
    assert not missing, f"not in the wheel (a package without __init__.py?): {missing}"
    for v in wheels.RECORDED_RELEASES:
        assert f"sglang_ext/fingerprints/sglang-{v}.json" in names


def test_wheel_declares_entry_points(wheel):
    _, meta = wheel
    text = meta["entry_points.txt"]
    for group in ("[sglang.srt.plugins]", "[sglang.multimodal_gen.plugins]"):
        section = text.split(group, 1)[1].split("[", 1)[0]
        assert "sglang_ext = sglang_ext.plugin:register" in section, group
    assert "sglang-ext = sglang_ext.cli:main" in text.split("[console_scripts]", 1)[1].split("[", 1)[0]


def test_readme_test_command_is_what_ci_runs():
    """A newcomer's test command (README) and CI (.ci/run) install and run the same things."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read()
    command = "bash scripts/install_cpu_env.sh && .venv/bin/python scripts/run_suite.py --suite base-a-test-cpu"
    assert command in readme
    assert 'VENV="${VENV:-.venv}"' in ci and "SUITE=base-a-test-cpu" in ci
    assert 'bash scripts/install_cpu_env.sh "$VENV"' in ci
    assert '"$PY" scripts/run_suite.py --suite "$SUITE"' in ci
    assert "pip install --no-deps ." in readme and "`pip install sglang-ext` does not work" in readme
