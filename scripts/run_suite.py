#!/usr/bin/env python3
"""Collect and run one CI suite of `test/registered/` in a single pytest process.

    python scripts/run_suite.py --suite base-a-test-cpu            # CPU CI
    python scripts/run_suite.py --suite base-b-test-1-gpu-small    # 1 GPU
    python scripts/run_suite.py --suite base-c-test-4-gpu-h100     # 4 GPUs
    python scripts/run_suite.py --list                             # every suite and its files
    python scripts/run_suite.py --suite NAME -- -k vit -x          # extra pytest arguments

Suites come from the `register_*_ci(...)` markers at the top of each test file,
parsed (never imported) with sglang's own `sglang/test/ci/ci_register.py`
(`ut_parse_one_file`), so a file belongs to exactly the suite sglang's CI would
put it in: `suite=...`, or `{stage}-test-{runner_config}`. That parser is loaded
from its file, without importing the `sglang` package (which costs seconds).

Exit status: pytest's; 5 (pytest: no tests collected) is reported as such and
is a failure unless --allow-empty; 2 for a bad command line, an unknown suite,
or a test file without a CI marker (it would silently never run).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import subprocess
import sys
import time
from collections import defaultdict
from types import ModuleType
from typing import Dict, List, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_ROOT = os.path.join(REPO, "test", "registered")
PYTEST_NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
DEFAULT_PYTEST_ARGS = ["-q", "-ra", "-p", "no:cacheprovider"]


def load_sglang_ci_register() -> ModuleType:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("run_suite: sglang is not installed; its CI marker parser "
                         "(sglang/test/ci/ci_register.py) is needed to read the suites")
    path = os.path.join(list(spec.submodule_search_locations)[0], "test", "ci", "ci_register.py")
    if not os.path.exists(path):
        raise SystemExit(f"run_suite: {path} not found (sglang too old? 0.5.17 has it)")
    module_spec = importlib.util.spec_from_file_location("_sglang_ci_register", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_files(root: str) -> List[str]:
    return sorted(glob.glob(os.path.join(root, "**", "test_*.py"), recursive=True))


def collect(root: str, ci_register: ModuleType):
    """({suite: [registry, ...]}, [files without any marker])."""
    suites: Dict[str, list] = defaultdict(list)
    unregistered = []
    for path in test_files(root):
        registries, _has_main = ci_register.ut_parse_one_file(path)
        if not registries:
            unregistered.append(path)
        for reg in registries:
            suites[reg.effective_suite].append(reg)
    return suites, unregistered


def rel(path: str) -> str:
    return os.path.relpath(path, REPO)


def describe(reg) -> str:
    flags = [reg.backend.name.lower(), f"est_time {reg.est_time:g}s"]
    if reg.nightly:
        flags.append("nightly")
    if reg.disabled:
        flags.append(f"disabled: {reg.disabled}")
    return f"{rel(reg.filename)}  ({', '.join(flags)})"


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    pytest_args: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", help="suite name, e.g. base-a-test-cpu")
    parser.add_argument("--list", action="store_true", help="list suites (or the suite's files) and exit")
    parser.add_argument("--nightly", action="store_true", help="include files registered with nightly=True")
    parser.add_argument("--allow-empty", action="store_true",
                        help="exit 0 instead of 5 when pytest collects no tests")
    parser.add_argument("--root", default=TEST_ROOT, help="where registered tests live (default: test/registered)")
    args = parser.parse_args(argv)

    ci_register = load_sglang_ci_register()
    suites, unregistered = collect(args.root, ci_register)
    for path in unregistered:
        print(f"run_suite: {rel(path)} has no register_*_ci(...) marker: it belongs to no suite", file=sys.stderr)

    if args.list and not args.suite:
        for name in sorted(suites):
            regs = suites[name]
            print(f"{name}: {len(regs)} file(s), est_time markers {sum(r.est_time for r in regs):g}s in all")
            for reg in sorted(regs, key=lambda r: r.filename):
                print(f"    {describe(reg)}")
        return 2 if unregistered else 0
    if not args.suite:
        parser.error("--suite is required (or --list)")
    if unregistered:
        return 2
    if args.suite not in suites:
        print(f"run_suite: no test file registers suite {args.suite!r}; known suites: "
              f"{', '.join(sorted(suites)) or '(none)'}", file=sys.stderr)
        return 2

    selected, left_out = [], []
    for reg in sorted(suites[args.suite], key=lambda r: r.filename):
        runs = reg.disabled is None and (args.nightly or not reg.nightly)
        (selected if runs else left_out).append(reg)
    files = sorted({reg.filename for reg in selected})
    # est_time is sglang CI's per-file budget in its marker, not a prediction: the wall time is
    # printed when pytest ends.
    print(f"run_suite: suite {args.suite}: {len(files)} file(s)")
    for reg in selected:
        print(f"    {describe(reg)}")
    for reg in left_out:
        print(f"    not run: {describe(reg)}")
    if args.list:
        return 0
    if not files:
        print(f"run_suite: suite {args.suite} has no enabled files", file=sys.stderr)
        return 0 if args.allow_empty else PYTEST_NO_TESTS

    cmd = [sys.executable, "-m", "pytest", *DEFAULT_PYTEST_ARGS, *[rel(f) for f in files], *pytest_args]
    print("run_suite: " + " ".join(cmd), flush=True)
    started = time.monotonic()
    status = subprocess.call(cmd, cwd=REPO)
    print(f"run_suite: suite {args.suite}: pytest exited {status} after {time.monotonic() - started:.0f} s", flush=True)
    if status == PYTEST_NO_TESTS:
        print(f"run_suite: pytest collected no tests in suite {args.suite} (exit 5)"
              + ("; allowed by --allow-empty" if args.allow_empty else ""), file=sys.stderr)
        return 0 if args.allow_empty else PYTEST_NO_TESTS
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
