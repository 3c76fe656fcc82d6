"""The fork patch series (patches/sglang-0.5.17): generated from the plugin, applies where it should,
and activates the vendored copy wherever sglang loads plugins.

- the committed series equals what scripts/gen_patches.py generates now, and a stale, missing or
  left-over patch fails the check with the regenerate command;
- the generator vendors what activation reaches (registry adapters, what they import, also by
  module-name strings), renames it to sglang.ext, and refuses test-only helpers;
- every patch carries a DEP-3 header; every registry entry's adapters are carried by a patch;
- scripts/apply_patches.sh applies it to a pristine 0.5.17 tree (wheel and checkout layout) and
  refuses the real 0.5.18 and 0.5.23 trees before touching them;
- on a patched tree, `sglang.srt.plugins.load_plugins()` activates the vendored copy (knobs
  honoured, bad input stops start-up) while the installed plugin stands aside. That the vendored
  patches then behave like the plugin's is the whole CPU suite's job on that tree
  (scripts/check_patched_tree.sh).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=45, suite="base-a-test-cpu")

from conftest import PATCHED_TREE  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
APPLY = os.path.join(REPO, "scripts", "apply_patches.sh")


def _load_gen_patches():
    spec = importlib.util.spec_from_file_location("gen_patches", os.path.join(REPO, "scripts", "gen_patches.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gp = _load_gen_patches()


def _series_files(patch_dir=gp.PATCH_DIR):
    lines = open(os.path.join(patch_dir, "series"), encoding="utf-8").read().splitlines()
    return [line.split()[0] for line in lines if line.strip() and not line.startswith("#")]


def _patch_text(name):
    return open(os.path.join(gp.PATCH_DIR, name), encoding="utf-8").read()


def _header(text):
    head, sep, _ = text.partition("\n---\n")
    assert sep, "no '---' line between the DEP-3 header and the diff"
    fields, key = {}, None
    for line in head.splitlines():
        if line.startswith(" "):
            assert key is not None, f"continuation line before any field: {line!r}"
            fields[key] += "\n" + line[1:]
        else:
            key, _, value = line.partition(": ")
            assert re.fullmatch(r"[A-Z][A-Za-z-]*", key), f"bad header field {line!r}"
            fields[key] = value
    return fields


def _new_files(text):
    """{path under python/: content} of the files a patch creates."""
    out, path = {}, None
    for line in text.splitlines():
        m = re.match(r"diff --git a/python/(\S+) b/", line)
        if m:
            path = m.group(1)
        elif line == "--- /dev/null":
            out[path] = []
        elif path in out and line.startswith("+") and not line.startswith("+++"):
            out[path].append(line[1:])
    return {p: "\n".join(lines) + "\n" for p, lines in out.items()}


# ---------------------------------------------------------------------------
# Generated, and checked
# ---------------------------------------------------------------------------


def test_committed_series_is_what_the_generator_writes(capsys):
    assert gp.main(["--check"]) == 0, capsys.readouterr().err
    generated = gp.generate()
    assert gp.stale(generated) == []
    names = _series_files()
    assert names[0] == gp.CORE_PATCH and names[-1] == gp.HOOK_PATCH
    assert sorted(names) == sorted(n for n in os.listdir(gp.PATCH_DIR) if n.endswith(".patch"))


def test_stale_series_fails_the_check_with_the_regenerate_command(tmp_path, capsys):
    stale = tmp_path / "sglang-0.5.17"
    shutil.copytree(gp.PATCH_DIR, stale)
    victim = stale / _series_files()[1]
    text = victim.read_text()
    added = next(line for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
    victim.write_text(text.replace(added, added + "  # hand edit", 1))
    shutil.copy(victim, stale / "left-over.patch")
    (stale / gp.HOOK_PATCH).unlink()

    assert gp.main(["--check", "--patch-dir", str(stale)]) == 1
    err = capsys.readouterr().err
    assert f"{victim.name}: differs from what would be generated" in err and "hand edit" in err
    assert "left-over.patch: is not generated any more" in err
    assert f"{gp.HOOK_PATCH}: missing" in err
    assert "Regenerate with: python scripts/gen_patches.py" in err


# ---------------------------------------------------------------------------
# What is vendored, and how
# ---------------------------------------------------------------------------


def test_vendors_what_activation_reaches_and_no_test_helpers():
    from sglang_ext.registry import PATCHES

    vendored = gp.vendored_modules(PATCHES)
    adapters = {p.function.split(":")[0] for spec in PATCHES for p in spec.parts}
    assert adapters <= set(vendored)
    # reached by imports (graphs through the adapters, mg_worker inside a function), by the
    # module-name string of pi05_graphs (the upstream vla.cuda_graph module), and parent packages
    for module in ("sglang_ext", "sglang_ext.activation", "sglang_ext.patching", "sglang_ext.graphs.cache",
                   "sglang_ext.mg_worker.entries", "sglang_ext.pi05.vla_cuda_graph", "sglang_ext.pi05"):
        assert module in vendored, module
    # the plugin's own delivery (entry point, launchers, doctor) and the test helpers stay out
    for module in ("sglang_ext.plugin", "sglang_ext.launch_server", "sglang_ext.tools.doctor", "sglang_ext.tools.cli",
                   "sglang_ext_testkit.wheels", "sglang_ext_testkit", "sglang_ext_testkit.pi05_random"):
        assert module not in vendored, module
    carried = set()
    for name in _series_files():
        carried |= set(_new_files(_patch_text(name)))
    expected = {gp.tree_path(m) for m in vendored} | {gp.tree_path(d) for d in gp.DATA}
    assert carried == expected


def test_vendored_code_names_only_sglang_ext_copies(tmp_path):
    """No vendored file imports or names (in a string) the installed sglang_ext; prose about the
    plugin's own modules (not vendored) keeps their names."""
    vendored = {}
    for name in _series_files():
        vendored.update(_new_files(_patch_text(name)))
    for path, text in vendored.items():
        if not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(text, filename=path)):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "sglang_ext" for a in node.names), (path, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "sglang_ext", (path, node.lineno)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not re.match(r"sglang_ext[.:]", node.value) or " " in node.value, (path, node.value)
    registry = vendored["sglang/ext/registry.py"]
    assert '"sglang.ext.vit.runner:patch_runner"' in registry
    assert "python -m sglang_ext.launch_server" in vendored["sglang/ext/knobs.py"]  # docs of the plugin


def test_generator_follows_imports_and_strings_and_refuses_test_helpers(tmp_path, monkeypatch):
    from sglang_ext.registry import Part, PatchSpec

    pkg = tmp_path / "sglang_ext"
    for rel, text in {
        "__init__.py": "",
        "activation.py": "import importlib\n",
        "adapters/__init__.py": "",
        "adapters/a.py": "from ..helpers import h\n\n\ndef patch(ctx, m):\n    from sglang_ext import extra\n"
                         "    return importlib.import_module('sglang_ext.more:thing')\n",
        "more.py": "",
        "helpers.py": "import sglang_ext_testkit as t  # noqa\n" "h = 1\n",
        "extra.py": "X = 'sglang_ext is named in prose only'\n",
        "unused.py": "",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    monkeypatch.setattr(gp, "PYTHON_DIR", str(tmp_path))
    spec = PatchSpec(name="fake", summary="fake", targets=(), parts=(Part("m", "sglang_ext.adapters.a:patch"),),
                     upstream_pr="none", retire_when="never")
    with pytest.raises(gp.GenerationError, match="sglang_ext.helpers imports the test-only sglang_ext_testkit"):
        gp.vendored_modules([spec])
    (pkg / "helpers.py").write_text("h = 1\n")
    # a relative import, an import inside a function, a module-name string; not the unused module
    assert gp.vendored_modules([spec]) == ["sglang_ext", "sglang_ext.activation", "sglang_ext.adapters",
                                           "sglang_ext.adapters.a", "sglang_ext.extra", "sglang_ext.helpers",
                                           "sglang_ext.more"]
    text = gp.vendored_text("sglang_ext.adapters.a", gp.vendored_modules([spec]))
    assert "from ..helpers import h" in text and "from sglang.ext import extra" in text
    assert "'sglang.ext.more:thing'" in text and "sglang_ext" not in text.split("\n", 1)[1]
    missing = PatchSpec(name="gone", summary="gone", targets=(), parts=(Part("m", "sglang_ext.adapters.b:p"),),
                        upstream_pr="none", retire_when="never")
    with pytest.raises(gp.GenerationError, match="names sglang_ext.adapters.b, which has no source"):
        gp.vendored_modules([missing])


def test_every_patch_has_a_dep3_header_and_every_registry_entry_a_patch():
    from sglang_ext.registry import PATCHES

    specs = {spec.name: spec for spec in PATCHES}
    assert "# sglang-version: 0.5.17" in open(os.path.join(gp.PATCH_DIR, "series"), encoding="utf-8").read()
    carried = set()
    for name in _series_files():
        fields = _header(_patch_text(name))
        for key in ("Description", "Author", "Origin", "Forwarded", "X-Runtime-Patch"):
            assert fields.get(key, "").strip(), f"{name}: no {key}"
        assert fields["Forwarded"] in ("no", "not-needed"), name
        runtime = fields["X-Runtime-Patch"]
        if name in (gp.CORE_PATCH, gp.HOOK_PATCH):
            assert runtime.startswith("none ("), name
            continue
        m = re.fullmatch(r"(\w+) \(([\w., ]+)\)", runtime)
        assert m, f"{name}: X-Runtime-Patch {runtime!r} is not '<registry name> (<adapter modules>)'"
        spec = specs[m.group(1)]
        assert name == gp.patch_filename(spec.name)
        assert fields["Description"].splitlines()[0] == spec.summary
        assert ("Applied-Upstream" in fields) == bool(spec.upstream_since), name
        for module in m.group(2).split(", "):
            assert gp.tree_path(module) in _new_files(_patch_text(name)), (name, module)
            carried.add(module)
    for spec in PATCHES:
        assert {p.function.split(":")[0] for p in spec.parts} <= carried, f"{spec.name}: adapters not carried"
        for readme in gp.READMES:
            assert f"| `{spec.name}` |" in open(readme, encoding="utf-8").read(), (readme, spec.name)


def test_hook_activates_the_vendored_copy_at_the_start_of_load_plugins():
    text = _patch_text(gp.HOOK_PATCH)
    assert re.findall(r"^diff --git a/python/(\S+) ", text, re.M) == [gp.HOOK_FILE]
    added = [line[1:].strip() for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert "_activate_sglang_ext(force=True)" in added
    # inserted right after the idempotence guard, before any entry-point plugin runs
    body = text.split("@@", 2)[2]
    assert body.index("_plugins_loaded = True") < body.index("+    _activate_sglang_ext(force=True)") \
        < body.index("plugins = load_plugins_by_group(")
    with pytest.raises(gp.GenerationError, match="not pristine"):
        gp.hooked(gp.hooked(open(os.path.join(_pristine_root(), gp.HOOK_FILE), encoding="utf-8").read()))


# ---------------------------------------------------------------------------
# Applying: pristine 0.5.17 (both layouts); 0.5.18 / 0.5.23 refused
# ---------------------------------------------------------------------------


def _pristine_root():
    from sglang_ext_testkit import wheels

    return wheels.ensure_unpacked("0.5.17")


def _changed_files():
    """Files of the pristine tree that the series changes (the rest it creates)."""
    out = set()
    for name in _series_files():
        text = _patch_text(name)
        out |= set(re.findall(r"^diff --git a/python/(\S+) ", text, re.M)) - set(_new_files(text))
    return sorted(out)


def _touched_files():
    """Every file the series changes or creates (paths under python/)."""
    out = set()
    for name in _series_files():
        out |= set(re.findall(r"^diff --git a/python/(\S+) ", _patch_text(name), re.M))
    return sorted(out)


def _pristine_subset(dest, prefix=""):
    root = _pristine_root()
    for rel in ["sglang/_version.py"] + _changed_files():
        target = os.path.join(dest, prefix, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy(os.path.join(root, rel), target)
    return root


def _apply(*args):
    return subprocess.run(["bash", APPLY, *args], capture_output=True, text=True)


@pytest.mark.parametrize("layout", ["wheel", "checkout"])
def test_series_applies_to_a_pristine_0_5_17_tree(tmp_path, layout):
    prefix = "" if layout == "wheel" else "python"
    tree = tmp_path / "tree"
    pristine = _pristine_subset(str(tree), prefix)
    base = tree / prefix if prefix else tree

    check = _apply("--check", str(tree))
    assert check.returncode == 0, check.stderr
    assert f"{layout} layout" in check.stdout
    assert not (base / "sglang" / "ext").exists()  # --check changes nothing
    for rel in _changed_files():
        assert (base / rel).read_text() == open(os.path.join(pristine, rel)).read()

    done = _apply(str(tree))
    assert done.returncode == 0, done.stderr
    for rel in _changed_files():
        assert (base / rel).read_text() != open(os.path.join(pristine, rel)).read(), rel
    for name in _series_files():
        for rel, text in _new_files(_patch_text(name)).items():
            assert (base / rel).read_text() == text, rel

    patched = {rel: (base / rel).read_text() for rel in _touched_files()}
    again = _apply(str(tree))  # a patched tree is recognised and left as it is
    assert again.returncode == 0, again.stderr
    assert "already has every patch of sglang-0.5.17 applied; nothing to do" in again.stdout
    assert {rel: (base / rel).read_text() for rel in _touched_files()} == patched

    first = next(r for r in _touched_files() if os.path.exists(os.path.join(pristine, r)))  # half patched
    shutil.copy(os.path.join(pristine, first), base / first)
    half = _apply(str(tree))
    assert half.returncode != 0
    assert "does not apply cleanly" in half.stderr and "not already applied either" in half.stderr
    assert "nothing was changed" in half.stderr


@pytest.mark.parametrize("version", ["0.5.18", "0.5.22"])
def test_series_refuses_releases_without_one(version):
    from sglang_ext_testkit import wheels

    root = wheels.ensure_unpacked(version)  # the real unpacked wheel; refused before anything is read
    done = _apply(root)
    assert done.returncode != 0
    assert f"no patch series for sglang {version} (series exist for sglang 0.5.17 0.5.23)" in done.stderr
    assert not os.path.exists(os.path.join(root, "sglang", "ext"))


def test_a_series_given_for_another_release_is_refused():
    from sglang_ext_testkit import wheels

    root = wheels.ensure_unpacked("0.5.23")
    done = _apply("--check", "--series", os.path.join(REPO, "patches", "sglang-0.5.17"), root)  # on a 0.5.23 tree
    assert done.returncode != 0
    assert f"this patch series is for sglang 0.5.17, but {root} is sglang 0.5.23" in done.stderr


def test_every_supported_release_has_its_series_and_it_applies_to_that_wheel(tmp_path):
    """--check of each release's series against a copy of that release's pristine wheel."""
    from sglang_ext_testkit import wheels

    for version in gp.SERIES_VERSIONS:
        series = os.path.join(REPO, "patches", f"sglang-{version}")
        assert f"# sglang-version: {version}" in open(os.path.join(series, "series"), encoding="utf-8").read()
        tree = tmp_path / version
        shutil.copytree(os.path.join(wheels.ensure_unpacked(version), "sglang"), tree / "sglang",
                        ignore=shutil.ignore_patterns("test", "*.so"))
        done = _apply("--check", str(tree))
        assert done.returncode == 0, done.stderr
        assert f"sglang {version}" in done.stdout


def test_apply_refuses_a_tree_without_a_version(tmp_path):
    (tmp_path / "sglang").mkdir()
    done = _apply(str(tmp_path))
    assert done.returncode != 0
    assert "cannot tell the sglang version" in done.stderr and "0.5.17 0.5.23" in done.stderr


@pytest.mark.parametrize("tag, ok", [("v0.5.17", True), ("v0.5.18", False)])
def test_apply_reads_the_release_tag_of_a_checkout_without_a_build(tmp_path, tag, ok):
    tree = tmp_path / "sglang-checkout"
    _pristine_subset(str(tree), "python")
    (tree / "python" / "sglang" / "_version.py").unlink()  # generated at build time, not in git
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path), "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-q", "-m", "release"],
                ["git", "tag", tag]):
        subprocess.run(cmd, cwd=tree, check=True, env=env, capture_output=True)
    done = _apply("--check", str(tree))
    if ok:
        assert done.returncode == 0, done.stderr
        assert "(sglang 0.5.17, checkout layout, -p1)" in done.stdout
    else:
        assert done.returncode != 0
        assert "no patch series for sglang 0.5.18" in done.stderr


@pytest.mark.skipif(shutil.which("quilt") is None and not os.environ.get("EXT_CI_REQUIRE_QUILT"),
                    reason="quilt is not installed (.ci/run installs it and requires this test)")
def test_quilt_push_applies_the_series_to_a_checkout(tmp_path):
    """README's `quilt push -a` path, on a pristine copy of the installed 0.5.17."""
    assert shutil.which("quilt"), "EXT_CI_REQUIRE_QUILT is set but quilt is not on PATH"
    tree = tmp_path / "checkout"
    _pristine_subset(str(tree), "python")
    done = subprocess.run(["quilt", "push", "-a"], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "QUILT_PATCHES": gp.PATCH_DIR})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Now at patch {os.path.join(gp.PATCH_DIR, _series_files()[-1])}" in done.stdout
    assert (tree / "python" / "sglang" / "ext" / "activation.py").exists()


# ---------------------------------------------------------------------------
# A patched tree activates its vendored copy wherever sglang loads plugins
# ---------------------------------------------------------------------------

_PROBE = r"""
import json, os, sys
import sglang.srt.plugins as plugins
results = []
for env in json.loads(sys.argv[1]):  # one start-up per environment (the import of sglang is shared)
    for key, value in env.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    plugins._plugins_loaded = False
    out = {}
    try:
        plugins.load_plugins()
    except BaseException as exc:  # what sglang's own callers would see
        out["error"] = [type(exc).__name__, str(exc)]
    else:
        import sglang.ext.activation as fork
        import sglang_ext.activation as plugin
        out["fork"] = {name: st.state for name, st in fork.statuses().items()}
        out["plugin"] = {name: st.state for name, st in plugin.activate().items()}  # SGLANG_EXT=1: stands aside
        out["sglang_ext"] = sys.modules["sglang_ext"].__file__
        fork.deactivate()
    results.append(out)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory):
    """The patched tree under test, or a fresh one: the installed sglang as symlinks (byte code
    included), real copies of the files the series changes, the series applied."""
    if PATCHED_TREE:
        return os.environ["EXT_PATCHED_TREE"]
    import sglang

    tree = tmp_path_factory.mktemp("patched")
    shutil.copytree(os.path.dirname(sglang.__file__), tree / "sglang", symlinks=True, copy_function=os.symlink)
    for rel in _changed_files():
        (tree / rel).unlink()
        shutil.copy(os.path.join(os.path.dirname(sglang.__file__), os.path.relpath(rel, "sglang")), tree / rel)
    done = _apply(str(tree))
    assert done.returncode == 0, done.stderr
    return str(tree)


def test_load_plugins_on_a_patched_tree_activates_the_vendored_copy(patched_tree, tmp_path):
    from sglang_ext.registry import PATCH_NAMES

    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_EXT")}
    child_env["PYTHONPATH"] = os.pathsep.join([patched_tree, os.path.join(REPO, "python")])
    starts = [{"SGLANG_EXT_DISABLE": "no_such_patch"},
              {"SGLANG_EXT_DISABLE": "vit_cuda_graph"},  # master switch off: the fork is on all the same
              {"SGLANG_EXT_DISABLE": None, "SGLANG_EXT": "1"}]  # the plugin would activate, were it not a fork
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(starts)], capture_output=True, text=True,
                          env=child_env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    bad, built_in, switched_on = json.loads(done.stdout.splitlines()[-1])

    # bad input stops start-up with one line: a BaseException, which sglang's plugin loader cannot swallow
    name, message = bad["error"]
    assert name == "SglangExtActivationError"
    assert "SGLANG_EXT_DISABLE" in message and "no_such_patch" in message and "vit_cuda_graph" in message
    assert "\n" not in message
    # every patch armed (it applies when its module is imported), the disabled one left alone
    # each patch as the registry declares it for this release (armed; on 0.5.23 also not needed / not ported)
    from sglang_ext import activation
    from sglang_ext.knobs import load_settings
    from sglang_ext.versions import installed_sglang_version

    plan = activation.plan(load_settings({"SGLANG_EXT": "1"}), version=installed_sglang_version())
    declared = {name: plan[name].state for name in PATCH_NAMES}
    assert built_in["fork"] == {**declared, "vit_cuda_graph": "disabled"}
    assert switched_on["fork"] == declared
    assert switched_on["plugin"] == {}, "the installed plugin must stand aside on a patched tree"
    assert switched_on["sglang_ext"].startswith(os.path.join(REPO, "python"))


@pytest.mark.skipif(not PATCHED_TREE, reason="only meaningful with EXT_TEST_TREE=patched")
def test_patched_tree_is_the_sglang_under_test():
    import sglang

    tree = os.environ.get("EXT_PATCHED_TREE")
    assert tree, "scripts/check_patched_tree.sh sets EXT_PATCHED_TREE to the patched copy"
    print(f"sglang under test: {sglang.__file__}")
    assert os.path.realpath(sglang.__file__).startswith(os.path.realpath(tree) + os.sep)
    from sglang_ext import activation

    assert activation.sglang_carries_sglang_ext() == os.path.dirname(sglang.__file__)
    assert activation.activate(force=True) == {}, "the installed plugin must stand aside on the patched tree"
