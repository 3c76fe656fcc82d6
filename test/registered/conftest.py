"""Shared fixtures: run the same tests against the plugin or against the patched fork tree.

EXT_TEST_TREE=plugin (default): patches are applied through the installed plugin's
activation (strict mode), and rolled back after each test.
EXT_TEST_TREE=patched: sglang on sys.path is a 0.5.17 tree with patches/ applied, which
vendors sglang-ext as `sglang.ext`; the installed plugin stands aside there, and
`ext_patches` drives the fork's own copy (`sglang.ext.activation`) the same way.
"""

import importlib
import os
import sys

import pytest

# The test tooling (test/sglang_ext_testkit, installed with the checkout) is taken from this tree, here
# and in every process a test starts (servers, `python -m sglang_ext_testkit...`): a mutated copy of the
# tree (scripts/mutation_smoke.py) tests its own. The bench scripts the tests check import from scripts/.
TESTKIT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS_ROOT = os.path.join(os.path.dirname(TESTKIT_ROOT), "scripts")
for _root in (SCRIPTS_ROOT, TESTKIT_ROOT):
    if _root not in sys.path:
        sys.path.insert(0, _root)
if TESTKIT_ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTKIT_ROOT, os.environ.get("PYTHONPATH")) if p)

PATCHED_TREE = os.environ.get("EXT_TEST_TREE", "plugin") == "patched"
# Set by .ci/run: the Triton kernel checks must run there, so a missing triton fails them instead of skipping.
REQUIRE_TRITON_ENV = "EXT_CI_REQUIRE_TRITON"

# Warnings sglang and its dependencies raise on a CPU machine at import (no Triton, AWQ or GGUF on the CPU,
# deprecations inside their own code): nothing a test here can act on; ours still show.
THIRD_PARTY_WARNINGS = ("sglang", "transformers", "fastapi", "starlette", "torch", "_pytest")


def pytest_configure(config):
    for package in THIRD_PARTY_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:::{package}(\\..*)?$")
    config.addinivalue_line("filterwarnings", "ignore::pytest.PytestAssertRewriteWarning")


plugin_only = pytest.mark.skipif(
    PATCHED_TREE, reason="tests the installed plugin itself; on the patched tree it stands aside for sglang.ext"
)


def import_triton(module: str = "triton"):
    """`module` (triton, or a part such as triton.backends.nvidia), imported.

    Without it the test skips, except where EXT_CI_REQUIRE_TRITON is set (CI): there it fails.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get(REQUIRE_TRITON_ENV):
            pytest.fail(f"{REQUIRE_TRITON_ENV} is set but {module} does not import: {exc}", pytrace=False)
        pytest.skip(f"{module} does not import ({exc}); {REQUIRE_TRITON_ENV} unset")


def released_source_root(version: str) -> str:
    """Source root (the directory holding `sglang/`) of the released sglang `version` wheel.

    Downloaded once into `sglang_ext_testkit.wheels`' cache (~/.cache/sglang-ext/wheels), then reused.
    CI has network: a failed download fails the test, in one line, instead of skipping it.
    """
    from sglang_ext_testkit import wheels

    try:
        return wheels.ensure_unpacked(version)
    except RuntimeError as exc:
        pytest.fail(f"sglang {version} wheel unavailable: {str(exc).splitlines()[0]}", pytrace=False)


@pytest.fixture(scope="session")
def released_tree():
    """`released_tree("0.5.23")` -> source root of that release (see released_source_root)."""
    return released_source_root


def upstream(name: str):
    """The installed sglang's module or attribute that the registry calls `name` (sglang_ext_testkit.upstream)."""
    from sglang_ext_testkit.upstream import upstream as _upstream

    return _upstream(name)


def _runs_here(function: str) -> bool:
    """Whether the registry part `function` ("sglang_ext.x:y") runs on the installed sglang (planned, not applied)."""
    from sglang_ext import activation
    from sglang_ext.knobs import load_settings
    from sglang_ext.registry import PATCHES
    from sglang_ext.versions import installed_sglang_version

    version = installed_sglang_version()
    plan = activation.plan(load_settings({"SGLANG_EXT": "1"}), version=version)
    return any(plan[spec.name].state == activation.ARMED and any(p.function == function for p in spec.parts_on(version))
               for spec in PATCHES)


def where_part_runs(function: str):
    """Marks a test of what one registry part adds: it runs on the releases where that part applies
    (a backport part is `before` a release; a patch upstream has is "not needed")."""
    return pytest.mark.skipif(not _runs_here(function), reason=f"{function} does not apply to this sglang release")


def ext_core(name: str):
    """The sglang-ext module `name` (e.g. "graphs.stats", "activation") that the sglang under test uses.

    Plugin: `sglang_ext.<name>`. Patched tree: the copy the fork series vendors as
    `sglang.ext.<name>`, a different module object (its stats registry, its classes); tests
    that read state of patched sglang objects through the core must use this.
    """
    import importlib

    return importlib.import_module(("sglang.ext." if PATCHED_TREE else "sglang_ext.") + name)


@pytest.fixture
def ext_patches(monkeypatch):
    """Call `ext_patches(**knobs)` to switch sglang-ext on (strict) with the given knob values.

    Knob names are KNOBS names (e.g. vit_graph_max_entries=2); values are strings or ints.
    Returns the activation statuses of the copy the sglang under test uses (see `ext_core`).
    """
    activation = ext_core("activation")

    def _activate(**knobs):
        for name, value in knobs.items():
            monkeypatch.setenv("SGLANG_EXT_" + name.upper(), str(value))
        monkeypatch.setenv("SGLANG_EXT", "1")
        monkeypatch.setenv("SGLANG_EXT_STRICT", "1")
        activation.deactivate()
        return activation.activate(eager=True)

    yield _activate
    activation.deactivate()


def _ext_variable(name: str) -> bool:
    return name == "SGLANG_EXT" or name.startswith("SGLANG_EXT_")


@pytest.fixture(scope="module", autouse=True)
def sglang_ext_off_between_files():
    """No test file sees another's sglang-ext state (CI runs every file in one process, in any order).

    When a file ends, whatever it left applied is rolled back and the SGLANG_EXT* variables are
    what they were when it started (a test that set one without monkeypatch). Deactivation
    restores names modules bound from patched code too (patching._unpatched), so a file that
    imported sglang modules while patched leaves them as sglang's. sglang 0.5.23's process-wide runtime
    context (published server args, parallel stamps) is reset as its own tests reset it: a Pi0.5 file's
    single-rank topology must not meet a later file's CP overrides."""
    saved = {name: value for name, value in os.environ.items() if _ext_variable(name)}
    yield
    ext_core("activation").deactivate()
    runtime_context = sys.modules.get("sglang.srt.runtime_context")
    if hasattr(runtime_context, "reset_context"):  # 0.5.23
        runtime_context.reset_context()
    for name in [name for name in os.environ if _ext_variable(name) and name not in saved]:
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture
def set_knob(monkeypatch):
    """`set_knob("pi05_fast", 1)`: a knob changed under a running activation (as a new server
    process would see it): the environment and the settings that patched code reads."""
    knobs = ext_core("knobs")

    def _set(name: str, value) -> None:
        monkeypatch.setenv("SGLANG_EXT_" + name.upper(), str(value))
        if knobs._active is not None:
            knobs.use(knobs.load_settings())

    return _set


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def sglang_ext_wheel(tmp_path_factory):
    """The wheel `pip install --no-deps .` builds from this checkout, built once per session.

    Built from a copy: an in-tree build would leave build/ and egg-info in the checkout.
    """
    import glob
    import shutil
    import subprocess
    import sys

    tree = tmp_path_factory.mktemp("tree")
    shutil.copy(os.path.join(REPO, "setup.py"), tree)
    shutil.copytree(os.path.join(REPO, "python"), tree / "python",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           str(tree), "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = glob.glob(str(out / "sglang_ext-*.whl"))
    return path
