"""The wheel: pulls neither torch nor sglang, ships every module and the fingerprint tables,
and declares the plugin entry points and the console script. Installed the README's way
(`pip install --no-deps`) into an empty venv, every command says in one line that sglang /
torch are missing, and exits 2."""

from __future__ import annotations

import glob
import os
import subprocess
import zipfile

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from fresh_venv import fresh_venv, user_env
from readme_quickstart import quickstart_steps
from sglang_ext_testkit import wheels

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture(scope="module")
def wheel(sglang_ext_wheel):
    with zipfile.ZipFile(sglang_ext_wheel) as zf:
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
    assert "sglang-ext = sglang_ext.tools.cli:main" in text.split("[console_scripts]", 1)[1].split("[", 1)[0]


def test_readme_test_command_is_what_ci_runs():
    """A newcomer's install and test steps (README quick start) and CI (.ci/run) install and run the
    same things: the venv the install step activates is the one CI's test step runs."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read()
    steps = quickstart_steps(readme)
    assert steps["install"] == ["bash scripts/install_cpu_env.sh", "source .venv/bin/activate"]
    assert steps["test"] == ["python scripts/run_suite.py --suite base-a-test-cpu"]
    assert 'VENV="${VENV:-.venv}"' in ci and 'PY="$VENV/bin/python"' in ci and "SUITE=base-a-test-cpu" in ci
    assert 'bash scripts/install_cpu_env.sh "$VENV"' in ci
    assert '"$PY" scripts/run_suite.py --suite "$SUITE"' in ci
    assert "pip install --no-deps ." in readme and "`pip install sglang-ext` does not work" in readme


@pytest.fixture(scope="module")
def empty_venv(tmp_path_factory, sglang_ext_wheel):
    """sglang-ext alone in a new venv: no sglang, no torch, no safetensors."""
    return os.path.dirname(fresh_venv(tmp_path_factory.mktemp("empty") / "venv", sglang_ext_wheel))


@pytest.mark.parametrize("argv, stream, names", [
    (["sglang-ext", "doctor"], "stderr", ["sglang-ext: PROBLEM \u2014 sglang and torch are not installed in "]),
    (["sglang-ext", "doctor", "--no-import"], "stderr", ["sglang-ext: PROBLEM \u2014 sglang is not installed in "]),
    (["python", "-m", "sglang_ext.launch_server", "--model-path", "m"], "stderr",
     ["python -m sglang_ext.launch_server: error: sglang and torch are not installed in "]),
    (["python", "-m", "sglang_ext.serve", "--model-path", "m"], "stderr",
     ["python -m sglang_ext.serve: error: sglang and torch are not installed in "]),
])
def test_without_sglang_and_torch_every_command_says_so_in_one_line(empty_venv, tmp_path, argv, stream, names):
    exe = os.path.join(empty_venv, argv[0])
    proc = subprocess.run([exe, *[a.format(tmp=tmp_path) for a in argv[1:]]], cwd=tmp_path, env=user_env(),
                          capture_output=True, text=True, timeout=120)
    text, other = (proc.stdout, proc.stderr) if stream == "stdout" else (proc.stderr, proc.stdout)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert text.count("\n") == 1 and other == "" and "Traceback" not in text, proc.stdout + proc.stderr
    for name in names:
        assert name in text, text
    assert os.path.join(empty_venv, "python") in text  # names the interpreter that lacks them
    assert "pip install --no-deps ." in text and "bash scripts/install_cpu_env.sh" in text  # what to do
    assert os.listdir(tmp_path) == []  # nothing written
