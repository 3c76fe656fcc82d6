"""scripts/run_suite.py: suites are read from the register_*_ci markers with sglang's own parser."""

from __future__ import annotations

import os
import runpy
import textwrap

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
run_suite = runpy.run_path(os.path.join(REPO, "scripts", "run_suite.py"), run_name="run_suite")

# Test files of a scratch tree define the markers themselves (parsing is by AST; importing
# sglang in each tiny pytest run would cost seconds).
HEADER = "def register_cpu_ci(*a, **k): pass\ndef register_cuda_ci(*a, **k): pass\n"


def write(root, name, body):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + textwrap.dedent(body))
    return path


@pytest.fixture
def tree(tmp_path):
    write(tmp_path, "a/test_cpu_one.py", """
        register_cpu_ci(est_time=3, suite="base-a-test-cpu")
        def test_one(): assert 1 + 1 == 2
    """)
    write(tmp_path, "b/test_gpu.py", """
        register_cuda_ci(est_time=30, stage="base-b", runner_config="1-gpu-small")
        def test_gpu(): assert True
    """)
    write(tmp_path, "b/test_gpu4.py", """
        register_cuda_ci(est_time=60, stage="base-c", runner_config="4-gpu-h100")
        def test_gpu4(): assert True
    """)
    write(tmp_path, "c/test_disabled.py", """
        register_cpu_ci(est_time=1, suite="base-a-test-cpu", disabled="flaky")
        def test_never(): raise AssertionError("a disabled file ran")
    """)
    write(tmp_path, "c/test_nightly.py", """
        register_cpu_ci(est_time=1, suite="base-a-test-cpu", nightly=True)
        def test_nightly(): raise AssertionError("a nightly file ran")
    """)
    return tmp_path


def test_suite_names_follow_sglang(tree):
    suites, unregistered = run_suite["collect"](str(tree), run_suite["load_sglang_ci_register"]())
    assert unregistered == []
    names = {name: sorted(os.path.basename(r.filename) for r in regs) for name, regs in suites.items()}
    assert names == {
        "base-a-test-cpu": ["test_cpu_one.py", "test_disabled.py", "test_nightly.py"],
        "base-b-test-1-gpu-small": ["test_gpu.py"],
        "base-c-test-4-gpu-h100": ["test_gpu4.py"],
    }


def test_runs_only_enabled_files_of_the_suite(tree, capsys):
    assert run_suite["main"](["--suite", "base-a-test-cpu", "--root", str(tree)]) == 0
    out = capsys.readouterr().out
    assert "suite base-a-test-cpu: 1 file(s)" in out
    assert "not run: " in out and "disabled: flaky" in out and "nightly" in out


def test_nightly_flag_includes_nightly_files(tree):
    assert run_suite["main"](["--suite", "base-a-test-cpu", "--nightly", "--root", str(tree)]) == 1  # it fails


def test_unknown_suite_is_an_error_listing_known_suites(tree, capsys):
    assert run_suite["main"](["--suite", "base-a-test-cpuu", "--root", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "base-a-test-cpuu" in err and "base-b-test-1-gpu-small" in err


def test_marker_sglang_cannot_see_is_an_error(tree, capsys):
    # sglang's parser reads only top-level calls: a marker inside try/if never registers the file.
    write(tree, "d/test_hidden.py", """
        try:
            register_cpu_ci(est_time=1, suite="base-a-test-cpu")
        except ImportError:
            pass
        def test_hidden(): pass
    """)
    assert run_suite["main"](["--suite", "base-a-test-cpu", "--root", str(tree)]) == 2
    assert "test_hidden.py has no register_*_ci(...) marker" in capsys.readouterr().err


def test_no_tests_collected_is_reported_and_fails_unless_allowed(tree, capsys):
    write(tree, "e/test_empty.py", """
        register_cpu_ci(est_time=1, suite="empty-suite")
    """)
    assert run_suite["main"](["--suite", "empty-suite", "--root", str(tree)]) == 5
    assert "collected no tests in suite empty-suite (exit 5)" in capsys.readouterr().err
    assert run_suite["main"](["--suite", "empty-suite", "--allow-empty", "--root", str(tree)]) == 0


def test_pytest_arguments_after_double_dash_are_passed_on(tree):
    # -k deselects the only test: pytest exits 5
    assert run_suite["main"](["--suite", "base-a-test-cpu", "--root", str(tree), "--", "-k", "nothing_matches"]) == 5
