"""scripts/mutation_smoke.py: its mutant list matches this tree, and its runner reports what each mutant
did (caught, survived, never imported, stale list, failing baseline), shown on a tiny synthetic package
in tmp_path, never on the real suite (CI runs that: .ci/run)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=12, suite="base-a-test-cpu")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(REPO, "scripts", "mutation_smoke.py")


def load_script():
    spec = importlib.util.spec_from_file_location("mutation_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_every_mutant_matches_this_tree_and_names_cpu_tests():
    ms = load_script()
    assert ms.stale_entries(ms.MUTANTS, os.path.join(REPO, "python"), REPO) == []
    for m in ms.MUTANTS:
        with open(os.path.join(REPO, "python", m.file), encoding="utf-8") as f:
            assert f.read().count(m.original) == 1, m.name
        for node in m.tests:  # the smoke runs on the CPU machine: every test it names must be a CPU test
            with open(os.path.join(REPO, node.split("::")[0]), encoding="utf-8") as f:
                assert "register_cpu_ci(" in f.read(), (m.name, node)
    covered = {m.file for m in ms.MUTANTS}
    for central in ("vit/runner.py", "vit/engine.py", "vit/strategy.py", "graphs/cache.py", "graphs/workspace.py", "graphs/agreement.py",
                    "prefill_cp/bucket.py", "knobs.py", "tools/launcher.py"):
        assert f"sglang_ext/{central}" in covered, central


CALC = "def add(a, b):\n    return a + b\n\n\ndef scale(a):\n    return a * 2\n"
TESTS = """from toypkg.calc import add, scale


def test_add():
    assert add(2, 3) == 5


def test_scale_is_positive():
    assert scale(1) > 0


def test_broken():
    assert add(1, 1) == 3
"""


@pytest.fixture
def toy(tmp_path):
    """toypkg (src/) with its tests (tests/), and an identical toypkg earlier on PYTHONPATH (decoy/):
    runs that imported it instead of the mutated copy would see no mutant at all."""
    for folder in ("src", "decoy"):
        package = tmp_path / folder / "toypkg"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "calc.py").write_text(CALC)
        (package / "unused.py").write_text("LIMIT = 3\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_calc.py").write_text(TESTS)
    return tmp_path


def smoke(root, mutants, *args):
    path = root / "mutants.json"
    path.write_text(json.dumps(mutants))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(root / "decoy")
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # toy tests need no plugin (hypothesis would cost seconds)
    return subprocess.run(
        [sys.executable, SCRIPT, "--mutants-json", str(path), "--source-root", str(root / "src"), "--package",
         "toypkg", "--cwd", str(root), "--preload", "pytest", "--timeout", "60", *args],
        capture_output=True, text=True, env=env, timeout=120)


def mutant(name, original, replacement, tests, file="toypkg/calc.py"):
    return dict(name=name, file=file, original=original, replacement=replacement, tests=tests)


def row(stdout, name):
    (line,) = [line for line in stdout.splitlines() if re.match(rf"{re.escape(name)}\s", line)]
    return line.split()


def test_caught_surviving_and_never_imported_mutants_are_reported(toy):
    done = smoke(toy, [
        mutant("add-subtracts", "return a + b", "return a - b", ["tests/test_calc.py::test_add"]),
        mutant("scale-triples", "return a * 2", "return a * 3", ["tests/test_calc.py::test_scale_is_positive"]),
        mutant("limit-changes", "LIMIT = 3", "LIMIT = 4", ["tests/test_calc.py::test_add"], file="toypkg/unused.py"),
    ], "--baseline")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert re.search(r"baseline \(2 tests, unmutated, toypkg from \S+/src/toypkg\): passed", out), out
    assert row(out, "add-subtracts")[1:2] + row(out, "add-subtracts")[3:] == ["caught", "test_calc.py::test_add"]
    assert row(out, "scale-triples")[1] == "survived"  # the test passes with the bug in place
    assert row(out, "limit-changes")[1] == "error" and "never imported the mutated module" in out
    assert "FAILED: 2 of 3 mutants not caught (scale-triples, limit-changes)" in done.stderr
    assert (toy / "src" / "toypkg" / "calc.py").read_text() == CALC  # only the temporary copy was mutated


def test_all_caught_exits_0_with_the_table(toy):
    done = smoke(toy, [mutant("add-subtracts", "return a + b", "return a - b", ["tests/test_calc.py::test_add"])])
    assert done.returncode == 0, done.stdout + done.stderr
    assert row(done.stdout, "add-subtracts")[1] == "caught" and "all 1 mutants caught" in done.stdout


def test_a_stale_list_fails_before_anything_runs(toy):
    done = smoke(toy, [
        mutant("twice", "return a", "return 0", ["tests/test_calc.py::test_add"]),  # in add and in scale
        mutant("gone", "return a ** 2", "return 0", ["tests/test_calc.py::test_add"]),
        mutant("renamed-test", "return a + b", "return a - b", ["tests/test_calc.py::test_sum"]),
    ])
    assert done.returncode == 3, done.stdout + done.stderr
    assert "twice: snippet found 2 times in toypkg/calc.py" in done.stderr
    assert "gone: snippet found 0 times in toypkg/calc.py" in done.stderr
    assert "renamed-test: tests/test_calc.py has no test_sum" in done.stderr
    assert "preloaded" not in done.stdout  # nothing ran


def test_the_baseline_must_pass_unmutated(toy):
    done = smoke(toy, [mutant("add-subtracts", "return a + b", "return a - b", ["tests/test_calc.py::test_broken"])],
                 "--baseline")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "baseline" in done.stdout and "failed: tests/test_calc.py::test_broken" in done.stdout
    assert "the named tests must pass on the unmutated tree" in done.stderr
    assert "add-subtracts" not in done.stdout.split("baseline")[-1]  # no mutant ran after it
