#!/usr/bin/env bash
# CI for the fork patch series:
#   1. patches/ equals what scripts/gen_patches.py generates from the adapters now;
#   2. the series of the venv's sglang release (patches/sglang-<release>) applies (git apply --check,
#      then git apply) to a copy of that pristine sglang installed in the venv;
#   3. the project's CPU suite passes against that patched copy with the installed plugin NOT active:
#      the copy vendors sglang-ext as sglang.ext and the tests drive that one (EXT_TEST_TREE=patched:
#      tests of the installed plugin itself skip, the rest must pass unchanged).
#
#   scripts/check_patched_tree.sh [--keep]     (VENV=.venv, SUITE=base-a-test-cpu)
# --keep: leave the patched copy in place (its path is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(cd "${VENV:-.venv}" && pwd)"
PY="$VENV/bin/python"
SUITE="${SUITE:-base-a-test-cpu}"
keep=0
[ "${1:-}" = "--keep" ] && keep=1

echo "check_patched_tree: regenerate and compare (scripts/gen_patches.py --check)"
"$PY" scripts/gen_patches.py --check

# The pristine sglang the plugin patches at run time: the venv's installed package.
site_pkg="$(env -u PYTHONPATH "$PY" -c 'import os, sglang; print(os.path.dirname(sglang.__file__))')"
version="$(env -u PYTHONPATH "$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))')"
[ -f "patches/sglang-${version%%+*}/series" ] || { echo "check_patched_tree: the venv has sglang $version, which has no series under patches/" >&2; exit 1; }

tree="$(mktemp -d "${TMPDIR:-/tmp}/sglang-${version%%+*}-patched.XXXXXX")"
if [ "$keep" = 0 ]; then trap 'rm -rf "$tree"' EXIT; fi
# -a keeps modification times, so the byte code cached beside unpatched files stays valid
# (imports of sglang model modules cost 10-30 s each without it).
cp -a "$site_pkg" "$tree/sglang"
bash scripts/apply_patches.sh "$tree"

# this checkout's sglang_ext (the installed plugin, standing aside) comes after the patched tree
pythonpath="$tree:$PWD/python"
under_test="$(cd /tmp && env -u SGLANG_EXT PYTHONPATH="$pythonpath" "$PY" -c 'import sglang; print(sglang.__file__)')"
echo "check_patched_tree: sglang under test: $under_test"
case "$under_test" in
  "$tree"/*) ;;
  *) echo "check_patched_tree: PYTHONPATH=$pythonpath does not select the patched tree" >&2; exit 1 ;;
esac

echo "check_patched_tree: suite $SUITE against the patched tree, plugin off"
set +e
env -u SGLANG_EXT PYTHONPATH="$pythonpath" EXT_TEST_TREE=patched EXT_PATCHED_TREE="$tree" \
  "$PY" scripts/run_suite.py --suite "$SUITE"
status=$?
set -e
[ "$keep" = 1 ] && echo "check_patched_tree: patched tree kept at $tree"
if [ "$status" != 0 ]; then
  echo "check_patched_tree: FAILED: suite $SUITE on the patched tree exited with $status" >&2
  exit "$status"
fi
echo "check_patched_tree: the patched tree passes suite $SUITE"
