"""The fork patch series (patches/sglang-0.5.17) is generated from the plugin and applies where it should.

- the committed series equals what scripts/gen_patches.py generates now (real activation,
  pristine sglang 0.5.17), and a stale copy fails the check with the regenerate command;
- every patch carries a DEP-3 header naming the runtime patch it mirrors;
- scripts/apply_patches.sh applies it to a pristine 0.5.17 tree (wheel and checkout layout) and
  refuses the real 0.5.18 and 0.5.23 trees before touching them;
- on a synthetic target the generated fork behaves like the plugin, and the generator refuses
  what it cannot reproduce (closures, decorated functions, differently bound names, ...).
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

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

from conftest import PATCHED_TREE, plugin_only  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SYNTHETIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "synthetic")
APPLY = os.path.join(REPO, "scripts", "apply_patches.sh")


def _load_gen_patches():
    if "gen_patches" in sys.modules:
        return sys.modules["gen_patches"]
    spec = importlib.util.spec_from_file_location("gen_patches", os.path.join(REPO, "scripts", "gen_patches.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_patches"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


gp = _load_gen_patches()


def _series_files(patch_dir=gp.PATCH_DIR):
    lines = open(os.path.join(patch_dir, "series"), encoding="utf-8").read().splitlines()
    return [line.split()[0] for line in lines if line.strip() and not line.startswith("#")]


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


# ---------------------------------------------------------------------------
# The committed series: up to date, DEP-3 headers
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generated():
    return gp.generate(reuse=True)


@plugin_only
def test_committed_series_is_what_the_generator_writes(generated, capsys):
    assert gp.main(["--check"], reuse=True) == 0, capsys.readouterr().err
    series = {os.path.basename(k): v for k, v in generated.items() if k.startswith("patches/sglang-")}
    assert gp.compare(series, gp.PATCH_DIR) == []
    assert "series" in series and len(series) >= 2


@plugin_only
def test_stale_patch_fails_the_check_with_the_regenerate_command(generated, tmp_path, capsys):
    stale = tmp_path / "sglang-0.5.17"
    shutil.copytree(gp.PATCH_DIR, stale)
    victim = stale / _series_files()[-1]
    text = victim.read_text()
    added = next(line for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
    victim.write_text(text.replace(added, added + "  # hand edit", 1))

    assert gp.main(["--check", "--patch-dir", str(stale)], reuse=True) == 1
    err = capsys.readouterr().err
    assert f"{victim.name}: differs from what would be generated" in err
    assert "hand edit" in err
    assert "Regenerate with: python scripts/gen_patches.py" in err

    # a patch that is no longer generated, and a missing one, are stale too
    shutil.copy(victim, stale / "left-over.patch")
    (stale / _series_files()[0]).unlink()
    assert gp.main(["--check", "--patch-dir", str(stale)], reuse=True) == 1
    err = capsys.readouterr().err
    assert "left-over.patch: is not generated any more" in err
    assert f"{_series_files()[0]}: missing" in err


@plugin_only
def test_last_update_dates_alone_do_not_make_the_series_stale(generated, tmp_path):
    copy = tmp_path / "sglang-0.5.17"
    shutil.copytree(gp.PATCH_DIR, copy)
    for name in _series_files():
        path = copy / name
        path.write_text(re.sub(r"^Last-Update: .*$", "Last-Update: 1999-01-01", path.read_text(), flags=re.M))
    series = {os.path.basename(k): v for k, v in generated.items() if k.startswith("patches/sglang-")}
    assert gp.compare(series, str(copy)) == []
    # while any other header line counts
    first = copy / _series_files()[0]
    first.write_text(first.read_text().replace("Origin: vendor", "Origin: upstream", 1))
    assert [p for p in gp.compare(series, str(copy)) if p.startswith(first.name)]


def test_every_patch_has_a_dep3_header_naming_its_runtime_patch():
    from sglang_ext.registry import PATCHES

    names = _series_files()
    assert sorted(names) == sorted(n for n in os.listdir(gp.PATCH_DIR) if n.endswith(".patch"))
    series_text = open(os.path.join(gp.PATCH_DIR, "series"), encoding="utf-8").read()
    assert "# sglang-version: 0.5.17" in series_text
    specs = {spec.name: spec for spec in PATCHES}
    mirrored = set()
    for name in names:
        fields = _header(open(os.path.join(gp.PATCH_DIR, name), encoding="utf-8").read())
        for key in ("Description", "Author", "Origin", "Forwarded", "Last-Update", "X-Runtime-Patch"):
            assert fields.get(key, "").strip(), f"{name}: no {key}"
        assert fields["Origin"].startswith("vendor, sglang-ext "), name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", fields["Last-Update"]), name
        assert fields["Forwarded"] in ("no", "not-needed") or fields["Forwarded"].startswith("http"), name
        runtime = fields["X-Runtime-Patch"]
        if name == gp.CORE_PATCH:
            assert runtime.startswith("none ("), name
            assert names.index(name) == 0, "the vendored core must come first"
            continue
        m = re.fullmatch(r"(\w+) \(([\w., ]+)\)", runtime)
        assert m, f"{name}: X-Runtime-Patch {runtime!r} is not '<registry name> (<adapter module>)'"
        spec = specs[m.group(1)]
        assert name == gp.patch_filename(spec.name)
        assert m.group(2).split(", ") == sorted({p.function.split(":")[0] for p in spec.parts})
        assert fields["Description"].splitlines()[0] == spec.summary
        assert ("Applied-Upstream" in fields) == bool(spec.upstream_since), name
        if spec.upstream_since:
            assert fields["Applied-Upstream"].startswith(spec.upstream_since), name
        mirrored.add(spec.name)
    left_out = set(gp.PLUGIN_DELIVERY_ONLY) | set(gp.NOT_EMITTABLE)
    assert mirrored == {spec.name for spec in PATCHES} - left_out, "a registry entry has no patch"
    readme = open(gp.README, encoding="utf-8").read()
    for spec in PATCHES:
        assert f"| `{spec.name}` |" in readme, f"{spec.name} missing from the patch x version matrix"


# ---------------------------------------------------------------------------
# Applying: pristine 0.5.17 (both layouts); 0.5.18 / 0.5.23 refused
# ---------------------------------------------------------------------------


def _touched_files():
    out = set()
    for name in _series_files():
        for line in open(os.path.join(gp.PATCH_DIR, name), encoding="utf-8"):
            m = re.match(r"diff --git a/python/(\S+) b/", line)
            if m:
                out.add(m.group(1))
    return sorted(out)


def _pristine_subset(dest, prefix=""):
    """The files the series touches (and _version.py) of the real 0.5.17 wheel, under dest/prefix."""
    from sglang_ext import wheels

    root = wheels.ensure_unpacked("0.5.17")
    for rel in ["sglang/_version.py"] + _touched_files():
        src = os.path.join(root, rel)
        if os.path.exists(src):
            target = os.path.join(dest, prefix, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy(src, target)
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
    for rel in _touched_files():  # --check changes nothing
        src = os.path.join(pristine, rel)
        assert not os.path.exists(src) or (base / rel).read_text() == open(src).read()

    done = _apply(str(tree))
    assert done.returncode == 0, done.stderr
    changed = 0
    for rel in _touched_files():
        text = (base / rel).read_text()
        imported = {n.module for n in ast.walk(ast.parse(text, filename=rel)) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in imported if m and m.split(".")[0] == "sglang_ext"], f"{rel} imports sglang_ext"
        src = os.path.join(pristine, rel)
        changed += not os.path.exists(src) or text != open(src).read()
    assert changed == len(_touched_files())
    assert (base / "sglang" / "ext" / "__init__.py").exists()

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


@pytest.mark.parametrize("version", ["0.5.18", "0.5.23"])
def test_series_refuses_other_sglang_releases(version):
    from sglang_ext import wheels

    root = wheels.ensure_unpacked(version)  # the real unpacked wheel; refused before anything is read
    done = _apply(root)
    assert done.returncode != 0
    assert f"this patch series is for sglang 0.5.17, but {root} is sglang {version}" in done.stderr
    assert not os.path.exists(os.path.join(root, "sglang", "ext"))


def test_apply_refuses_a_tree_without_a_version(tmp_path):
    (tmp_path / "sglang").mkdir()
    done = _apply(str(tmp_path))
    assert done.returncode != 0
    assert "cannot tell the sglang version" in done.stderr and "0.5.17" in done.stderr


# ---------------------------------------------------------------------------
# Synthetic target: the fork behaves like the plugin; unsupported code is refused
# ---------------------------------------------------------------------------

_PROBE = r"""
import dataclasses, json, sys
import fakesg.runner as runner, fakesg.models as models, fakesg.config as config
import fakesg.bucketing, fakesg.legacy_bucketing
from fakesg.bucketing import pick_bucket
cfg = config.Config(size=2, buckets=(1, 3))
try:
    config.Config(buckets=(3, 1))
    bad_buckets = None
except ValueError as exc:
    bad_buckets = str(exc)
out = {
    "config": [cfg.describe(), cfg.checked, [f.name for f in dataclasses.fields(cfg)], bad_buckets,
               config.Config().buckets],
    "legacy_alias": fakesg.legacy_bucketing is fakesg.bucketing,
    "one_ext_runner": models.ExtRunner is runner.ExtRunner,
    "run": repr(runner.Runner(2).run([1, 2])),
    "run_tag": repr(runner.Runner(1).run([7], tag="t")),
    "kind": runner.Runner.kind(),
    "describe": runner.Runner(3).describe(),
    "orig_is_kept": runner.Runner._ext_orig_run.__name__,
    "runner_name": runner.runner_name(),
    "models": sorted(models.runners),
    "ext_runner": repr(models.make("ext", 2).run([5])),
    "ext_runner_is_runner": issubclass(models.runners["ext"], runner.Runner),
    "bucket": pick_bucket(5, (4, 8)),
}
try:
    runner.Runner(1).run([])
except Exception as exc:
    out["error"] = [type(exc).__name__, str(exc), isinstance(exc, ValueError)]
print(json.dumps(out))
"""


def _synthetic_modules():
    return [m for m in sys.modules if m in ("fakesg", "fake_adapter", "bad_adapter") or m.startswith("fakesg.")]


@pytest.fixture
def synthetic(monkeypatch):
    """fakesg patched through PatchContext by fake_adapter (as the plugin would); rolled back after."""
    from sglang_ext.patching import PatchContext

    monkeypatch.syspath_prepend(SYNTHETIC)
    monkeypatch.setenv("SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES", "7")
    for name in _synthetic_modules():
        monkeypatch.delitem(sys.modules, name)
    import fake_adapter
    import fakesg.models
    import fakesg.runner

    import fakesg.config

    contexts = {name: PatchContext(name, None) for name in ("fake_runner", "fake_models", "fake_config")}
    fake_adapter.patch_runner(contexts["fake_runner"], fakesg.runner)
    fake_adapter.patch_models(contexts["fake_models"], fakesg.models)
    fake_adapter.patch_config(contexts["fake_config"], fakesg.config)
    yield contexts, fake_adapter
    for ctx in reversed(list(contexts.values())):
        ctx.rollback()
    for name in _synthetic_modules():
        sys.modules.pop(name, None)


def _synthetic_specs(names):
    from sglang_ext.registry import Part, PatchSpec

    return [PatchSpec(name=n, summary=f"synthetic {n}", targets=(), upstream_pr="sgl-project/sglang#1",
                      retire_when="never", parts=(Part("fakesg.runner", "fake_adapter:patch_runner"),))
            for n in names]


def test_synthetic_fork_behaves_like_the_plugin(synthetic, tmp_path):
    contexts, fake_adapter = synthetic
    collected = gp.collect(contexts, {name: [fake_adapter] for name in contexts}, package="fakesg",
                           upstream_root=os.path.join(SYNTHETIC, "upstream"))
    assert collected["errors"] == []
    files = gp.render_series(collected, _synthetic_specs(contexts), pristine_root=SYNTHETIC, package="fakesg",
                             path_prefix="")
    order = [line for line in files["series"].splitlines() if line and not line.startswith("#")]
    assert order == [gp.CORE_PATCH, "fake-runner.patch", "fake-models.patch", "fake-config.patch"]
    assert "class ExtRunner" not in files["fake-models.patch"]  # imported from fakesg.runner instead
    assert "\n+Config.__post_init__ = __post_init__\n" in files["fake-config.patch"]  # after @dataclass

    # what the plugin does, in this process
    scope = {}
    exec(_PROBE.replace("print(json.dumps(out))", ""), scope)
    expected = json.loads(json.dumps(scope["out"]))  # as the fork's probe reports it
    assert expected["run"].startswith("('patched', (2, (1, 2)), 6,")
    assert expected["models"] == ["cpu", "ext"]
    assert expected["kind"] == "ext" and expected["orig_is_kept"] == "run"
    assert expected["config"] == ["size=2 buckets=(1, 3)", 1, ["size", "buckets"], "buckets must increase", [4, 8]]
    assert expected["legacy_alias"] and expected["one_ext_runner"]

    # the same calls on a copy of the pristine tree with the generated series applied
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(SYNTHETIC, "fakesg"), tree / "fakesg")
    for name in order:
        (tmp_path / name).write_text(files[name])
        done = subprocess.run(["git", "apply", "-p1", str(tmp_path / name)], cwd=tree, capture_output=True,
                              text=True, env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
        assert done.returncode == 0, done.stderr
    assert "sglang_ext" not in (tree / "fakesg" / "runner.py").read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tree), SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES="7")
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    fork = json.loads(probe.stdout)
    assert fork == expected
    assert fork["error"] == ["ExtConfigError", "empty input", True]


def _refusals(contexts, adapter):
    return gp.collect(contexts, {name: [adapter] for name in contexts}, package="fakesg",
                      upstream_root=os.path.join(SYNTHETIC, "upstream"))["errors"]


def test_generator_refuses_what_it_cannot_reproduce(synthetic):
    from sglang_ext.patching import PatchContext

    import bad_adapter
    import fakesg.runner as runner

    cases = {
        "closure": lambda ctx: ctx.transplant_method(runner.Runner, bad_adapter.make_closure(2)),
        "lambda": lambda ctx: ctx.setattr(runner.Runner, "size", lambda self: 1),
        "decorated": lambda ctx: ctx.transplant_method(runner.Runner, bad_adapter.describe),
        "rebound": lambda ctx: ctx.transplant_method(runner.Runner, bad_adapter.key),
        "renamed_recursion": lambda ctx: ctx.transplant_method(runner.Runner, bad_adapter._ext_describe_twice,
                                                               name="describe"),
        "raw_function": lambda ctx: ctx.setattr(runner, "helper", bad_adapter.make_closure),
    }
    expected = {
        "closure": "is a closure (captures scale)",
        "lambda": "installed with ctx.setattr (function)",
        "decorated": "is a closure",  # functools.wraps wrapper: caught before its decorator
        "rebound": "uses math, which fakesg.runner binds to another object",
        "renamed_recursion": "refers to itself by its adapter name",
        "raw_function": "is not transplanted; install it with ctx.transplant_function",
    }
    for case, apply in cases.items():
        ctx = PatchContext(case, None)
        try:
            apply(ctx)
            errors = _refusals({case: ctx}, bad_adapter)
        finally:
            ctx.rollback()
        assert any(expected[case] in e for e in errors), f"{case}: {errors}"
        with pytest.raises(gp.GenerationError, match="cannot generate the series faithfully"):
            gp.render_series({"patches": {case: []}, "errors": errors, "files": {}}, _synthetic_specs([case]),
                             pristine_root=SYNTHETIC, package="fakesg")


def test_import_rewriting_refuses_a_bare_sglang_ext_import():
    assert gp.rewrite_imports("from sglang_ext.graphs.cache import X\n", "m.py") == \
        "from sglang.ext.graphs.cache import X\n"
    assert gp.rewrite_imports("from sglang_ext.upstream.multimodal_gen.runtime.vla import cuda_graph\n", "m.py") \
        == "from sglang.multimodal_gen.runtime.vla import cuda_graph\n"
    with pytest.raises(gp.GenerationError, match="binds `sglang_ext`"):
        gp.rewrite_imports("import sglang_ext.graphs\n", "m.py")
    with pytest.raises(gp.GenerationError, match="names an sglang_ext module"):
        gp.rewrite_imports("import importlib\nimportlib.import_module('sglang_ext.graphs')\n", "m.py")


# ---------------------------------------------------------------------------
# The CI run against the patched tree really imports it
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not PATCHED_TREE, reason="only meaningful with EXT_TEST_TREE=patched")
def test_patched_tree_is_the_sglang_under_test():
    import sglang

    tree = os.environ.get("EXT_PATCHED_TREE")
    assert tree, "scripts/check_patched_tree.sh sets EXT_PATCHED_TREE to the patched copy"
    print(f"sglang under test: {sglang.__file__}")
    assert os.path.realpath(sglang.__file__).startswith(os.path.realpath(tree) + os.sep)
    assert os.path.exists(os.path.join(os.path.dirname(sglang.__file__), "ext", "__init__.py"))
    from sglang_ext import activation

    assert activation.statuses() == {}, "the plugin must not be active on the patched tree"


@pytest.mark.skipif(shutil.which("quilt") is None, reason="quilt is not installed")
def test_quilt_push_applies_the_series_to_a_checkout(tmp_path):
    tree = tmp_path / "checkout"
    _pristine_subset(str(tree), "python")
    done = subprocess.run(["quilt", "push", "-a"], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "QUILT_PATCHES": gp.PATCH_DIR})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Now at patch {os.path.join(gp.PATCH_DIR, _series_files()[-1])}" in done.stdout
    assert (tree / "python" / "sglang" / "ext" / "__init__.py").exists()


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
        assert "this patch series is for sglang 0.5.17" in done.stderr and "is sglang 0.5.18" in done.stderr
