"""Fingerprints: what the digest ignores and what it catches; the committed tables and the
support matrix are exactly what the generators produce from the real wheels."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import textwrap

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only
from sglang_ext import fingerprint
from sglang_ext_testkit import wheels
from sglang_ext.registry import PATCHES
from sglang_ext.versions import installed_sglang_version

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_tree(root, source):
    pkg = root / "pkg"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent(source))
    fingerprint._parse.cache_clear()
    return str(root)


BASE = '''
    class Runner:
        """Doc."""

        def run(self, x, y=2):
            return x + y  # add

    LIMIT = {"cuda": 1}
'''


def prints(tmp_path, name, source):
    root = write_tree(tmp_path / name, source)
    return {q: fingerprint.fingerprint("pkg.mod", q, source_root=root) for q in ("Runner", "Runner.run", "LIMIT")}


def test_digest_ignores_formatting_comments_and_docstrings(tmp_path):
    reformatted = '''
        class Runner:
            """Another docstring, reworded."""
            def run(
                self,
                x,
                y = 2,
            ):
                # a new comment
                return (x + y)
        LIMIT = {
            "cuda": 1,
        }
    '''
    assert prints(tmp_path, "a", BASE) == prints(tmp_path, "b", reformatted)


@pytest.mark.parametrize("changed", [
    BASE.replace("x + y", "x - y"),            # behaviour
    BASE.replace("y=2", "y=3"),                # default value
    BASE.replace('"cuda": 1', '"cuda": 2'),    # a module-level table
])
def test_digest_catches_code_changes(tmp_path, changed):
    base, other = prints(tmp_path, "a", BASE), prints(tmp_path, "b", changed)
    assert base != other
    assert sum(base[q] != other[q] for q in base) >= 1


def test_absent_definition_and_module_fingerprint_to_none(tmp_path):
    root = write_tree(tmp_path / "a", BASE)
    assert fingerprint.fingerprint("pkg.mod", "Runner.missing", source_root=root) is None
    assert fingerprint.fingerprint("pkg.nomodule", "Runner", source_root=root) is None
    assert fingerprint.fingerprint("pkg.mod", "Runner.run", source_root=root) is not None


@plugin_only  # on EXT_TEST_TREE=patched the sglang on sys.path is the patched copy, by design
def test_installed_sglang_matches_its_recorded_table():
    version = installed_sglang_version()
    table = fingerprint.reference_table(version)
    assert table, f"no table for the installed sglang {version}"
    for spec in PATCHES:
        for t in spec.targets:
            assert fingerprint.fingerprint_key(t.key_in(version)) == table[t.key], t.key


def test_committed_tables_are_what_the_generator_writes(released_tree, capsys):
    for v in wheels.RECORDED_RELEASES:
        released_tree(v)  # download/unpack if the cache is cold (CI fills it with gen_fingerprints --check)
    gen = load_script("gen_fingerprints")
    assert gen.main(["--check"]) == 0, capsys.readouterr().err
    assert sorted(fingerprint.recorded_versions()) == sorted(wheels.RECORDED_RELEASES)
    for v in wheels.RECORDED_RELEASES:
        with open(os.path.join(gen.TABLE_DIR, f"sglang-{v}.json")) as f:
            table = json.load(f)
        assert table["sglang"] == v and table["generated_by"] == "scripts/gen_fingerprints.py"
        assert set(table["fingerprints"]) == {t.key for s in PATCHES for t in s.targets}


def test_check_mode_names_stale_entries_and_the_fix(released_tree, tmp_path, monkeypatch, capsys):
    gen = load_script("gen_fingerprints")
    tables = tmp_path / "fingerprints"
    shutil.copytree(gen.TABLE_DIR, tables)
    path = tables / "sglang-0.5.17.json"
    data = json.loads(path.read_text())
    key = sorted(data["fingerprints"])[0]
    data["fingerprints"][key] = "0" * 16  # a hand edit
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    monkeypatch.setattr(gen, "TABLE_DIR", str(tables))
    monkeypatch.setattr(gen, "support_matrix_main", lambda argv: 0)  # the real docs are not under test here
    assert gen.main(["--check", "--versions", "0.5.17"]) == 1
    err = capsys.readouterr().err
    assert "fingerprint tables are out of date" in err and f"fingerprints differ: {key}" in err
    assert "regenerate with: python scripts/gen_fingerprints.py" in err
    assert gen.main(["--versions", "0.5.17"]) == 0  # regenerating repairs it
    assert json.loads(path.read_text()) == json.load(open(os.path.join(REPO, "python", "sglang_ext",
                                                                        "fingerprints", "sglang-0.5.17.json")))


def test_support_matrix_is_up_to_date(capsys):
    gen = load_script("gen_support_matrix")
    assert gen.main(["--check"]) == 0, capsys.readouterr().err


def test_support_matrix_cells_follow_the_tables():
    gen = load_script("gen_support_matrix")
    by_name = {s.name: s for s in PATCHES}
    for spec in PATCHES:
        assert gen.cell(spec, "0.5.17") == "applies"
    # 0.5.12 predates the prefill CP bucket graph code; 0.5.23 has the mg plugin group.
    assert gen.cell(by_name["prefill_cp_bucket"], "0.5.12") == "absent"
    assert gen.cell(by_name["mg_worker_activation"], "0.5.23") == "not needed (upstream 0.5.21)"
    assert gen.cell(by_name["vit_cuda_graph"], "0.5.19") == "skipped (fingerprint changed)"
    # init_cuda_graphs reviewed on 0.5.21-0.5.22 (Target.also): the ViT patch applies there, prefill CP does not
    assert gen.cell(by_name["vit_cuda_graph"], "0.5.21") == gen.cell(by_name["vit_cuda_graph"], "0.5.22") == "applies"
    assert gen.cell(by_name["prefill_cp_bucket"], "0.5.22") == "skipped (fingerprint changed)"


def test_renames_give_each_release_its_own_names():
    """The registry is written in the newest shape; RENAMES gives an older release its names."""
    from sglang_ext.registry import resolve
    mg = "sglang.multimodal_gen.runtime"
    assert resolve(f"{mg}.vla.cuda_graph:VLADenoiseGraphRunner", "0.5.17") == (
        f"{mg}.vla.denoise_cuda_graph:VLADenoiseGraphRunner")
    assert resolve(f"{mg}.entrypoints.action.api", "0.5.17") == f"{mg}.entrypoints.vla.api"
    assert resolve(f"{mg}.entrypoints.action.api", "0.5.18") == f"{mg}.entrypoints.action.api"
    assert resolve("sglang.srt.layers.cp.utils:is_cp_active", "0.5.19") == "sglang.srt.layers.cp.utils:is_cp_v2_active"
    assert resolve("sglang.srt.layers.cp.utils:is_cp_active", "0.5.20") == "sglang.srt.layers.cp.utils:is_cp_active"
    assert resolve("sglang.srt.layers.cp.bcg.bcg:PrefillCPBCGInput", "0.5.22") == "sglang.srt.layers.cp.bcg:PrefillCPBCGInput"
    assert resolve("sglang.srt.layers.cp.bcg.bcg:PrefillCPBCGInput", "0.5.23") == "sglang.srt.layers.cp.bcg.bcg:PrefillCPBCGInput"
    assert resolve("sglang.srt.layers.cp.utils", "0.5.17") == "sglang.srt.layers.cp.utils"  # only the one definition
