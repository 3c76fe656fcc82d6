"""The README's Quick start, parsed from README.md, pasted twice into bash in a fresh copy of the
checkout with a fresh `.venv`: every command as written, in order, each run ending the same way.

What is not run as written, and why:
- `bash scripts/install_cpu_env.sh` (minutes: it downloads or unpacks torch, sglang and their
  dependencies) is CI's own first step (`.ci/run`, checked by test_packaging.py). Here `.venv` is
  made the cheap way: a new venv that sees this interpreter's packages, with sglang-ext installed
  into it from its wheel, as the script's last step does. `source .venv/bin/activate` runs as written.
- the test step gets `--list`: the same interpreter, suite and test files, without running the
  suite inside itself.
- the serve step writes its model into this test's own folder instead of /tmp/tiny-vl (other
  runs on the same machine use that path). Without a GPU it must end with the README's no-GPU
  line and exit status; on a GPU it would start a server, so this test needs a machine without one.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only
from fresh_venv import fresh_venv, user_env
from readme_quickstart import REPO, STEPS, no_gpu_line, quickstart_steps

register_cpu_ci(est_time=90, suite="base-a-test-cpu")

pytestmark = [
    plugin_only,  # the installed plugin's delivery (console script, launcher), not the patched tree
    pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="step 3 would start a real server"),
]

INSTALL_LINE = "bash scripts/install_cpu_env.sh"
README_MODEL_DIR = "/tmp/tiny-vl"
CHECKOUT = ("README.md", "setup.py", "python", "scripts", "test", "requirements")


def fresh_checkout(dest) -> str:
    """The files a clone has that the quick start uses (no .venv, no build outputs)."""
    os.makedirs(dest)
    for name in CHECKOUT:
        src = os.path.join(REPO, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name),
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", ".venv"))
        else:
            shutil.copy(src, dest)
    return str(dest)


def as_run_here(step: str, line: str, model_dir: str) -> str:
    """The README line as this test runs it (see the module docstring for each change)."""
    if step == "install" and line == INSTALL_LINE:
        return ": .venv was made by the test"
    if step == "test":
        return line + " --list"
    if step == "serve":
        return line.replace(README_MODEL_DIR, model_dir)
    return line


def paste(checkout: str, commands, logs) -> list:
    """Run `commands` in one bash session (as pasted into one terminal); per command: its exit
    status, stdout and stderr."""
    os.makedirs(logs, exist_ok=True)
    script = []
    for i, command in enumerate(commands):
        # braces, not a subshell: `source .venv/bin/activate` must change this session
        script.append(f'{{ {command}\n}} >"{logs}/{i}.out" 2>"{logs}/{i}.err"; echo $? >"{logs}/{i}.rc"')
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=checkout, env=user_env(), timeout=900,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

    def read(i, ext):
        with open(os.path.join(logs, f"{i}.{ext}"), encoding="utf-8") as f:
            return f.read()

    return [(int(read(i, "rc")), read(i, "out"), read(i, "err")) for i in range(len(commands))]


def mtimes(folder) -> dict:
    return {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in sorted(os.listdir(folder))}


def test_steps_are_install_test_serve_and_the_install_is_what_ci_runs_first():
    steps = quickstart_steps()
    assert list(steps) == list(STEPS)
    assert steps["install"] == [INSTALL_LINE, "source .venv/bin/activate"]
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read()
    assert 'bash scripts/install_cpu_env.sh "$VENV"' in ci and 'VENV="${VENV:-.venv}"' in ci
    assert any(README_MODEL_DIR in line for line in steps["serve"])


def test_quick_start_pasted_twice_in_a_fresh_checkout(tmp_path, sglang_ext_wheel):
    steps = quickstart_steps()
    documented_status, no_gpu_fragments = no_gpu_line()
    checkout = fresh_checkout(tmp_path / "sglang-ext")
    fresh_venv(os.path.join(checkout, ".venv"), sglang_ext_wheel, see_running_env=True)
    model_dir = str(tmp_path / "tiny-vl")
    lines = [(step, line) for step in STEPS for line in steps[step]]
    commands = [as_run_here(step, line, model_dir) for step, line in lines]
    serve_model, serve_launch = (i for i, (step, _) in enumerate(lines) if step == "serve")

    for run in (1, 2):
        results = paste(checkout, commands, tmp_path / f"run{run}")
        for i, ((step, line), (rc, out, err)) in enumerate(zip(lines, results)):
            where = f"run {run}, {step}: {line}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
            if i == serve_launch:
                assert rc == documented_status, where
                assert out == "" and err.count("\n") == 1, where  # one line on stderr, nothing else
                at = 0
                for fragment in no_gpu_fragments:  # the README's line, with `...` for what varies
                    at = err.find(fragment, at)
                    assert at >= 0, f"{fragment!r} not in order in the launcher's line; {where}"
                continue
            assert rc == 0, where
            assert "Traceback" not in err, where
            if step == "test":
                assert "run_suite: suite base-a-test-cpu:" in out and "test_readme_quickstart.py" in out, where
            if i == serve_model:
                assert out == f"{model_dir}\n", where
                if run == 1:
                    assert err == "", where
                else:  # the same model is there already: nothing written, said in one line
                    assert err.count("\n") == 1 and "already holds this model" in err, where
        if run == 1:
            written = mtimes(model_dir)
    assert mtimes(model_dir) == written  # the second run rewrote nothing
