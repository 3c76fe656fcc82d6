"""Results files hold only what the bench scripts write (scripts/bench_results.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts")

import bench_results  # noqa: E402
import gen_performance_doc  # noqa: E402

SCHEMA = {"run_id": None, "config": {"a": None}, "results": [{"mode": None, "counters": bench_results.ANY}]}


def test_undeclared_names_every_key_no_script_writes():
    report = {"run_id": "r", "config": {"a": 1, "typed_in": 2},
              "results": [{"mode": "x", "counters": {"anything": 1}}, {"mode": "y", "note": "by hand"},
                          {"mode": "z", "note": "again"}]}
    assert bench_results.undeclared(report, SCHEMA) == ["config.typed_in", "results[].note"]
    assert bench_results.undeclared({"config": None, "results": []}, SCHEMA) == []
    assert bench_results.undeclared({"results": {"mode": 1}}, SCHEMA) == ["results (a list in the schema)"]


def test_write_refuses_a_report_its_schema_lacks(tmp_path):
    path = tmp_path / "out.json"
    with pytest.raises(SystemExit, match="keys missing from the script's schema: extra"):
        bench_results.write(str(path), {"run_id": "r", "extra": 1}, SCHEMA)
    assert not path.exists()
    bench_results.write(str(path), {"run_id": bench_results.RUN_ID, "config": {"a": 1}}, SCHEMA)
    assert json.loads(path.read_text())["run_id"] == bench_results.RUN_ID


def test_kernels_say_which_packages_were_loaded(monkeypatch):
    import types

    stub = types.ModuleType("sgl_kernel")
    stub.__sgl_stub__ = True
    monkeypatch.setitem(sys.modules, "sgl_kernel", stub)
    real = types.ModuleType("flashinfer")
    real.__version__ = "0.9.1"
    monkeypatch.setitem(sys.modules, "flashinfer", real)
    assert bench_results.kernels() == {"sgl_kernel": "stand-in", "flashinfer": "0.9.1"}
    monkeypatch.delitem(sys.modules, "flashinfer")
    assert bench_results.kernels()["flashinfer"] == "not loaded"


def test_the_in_repo_stand_ins_are_reported_as_stand_ins():
    """A package replaced through sglang_ext_testkit.stand_ins must not read as a real version."""
    import subprocess

    code = f"import sys; sys.path.insert(0, {SCRIPTS!r}); import flashinfer, bench_results; print(bench_results.kernels())"
    env = {**os.environ, "SGX_STANDINS": "flashinfer"}
    out = subprocess.run([sys.executable, "-m", "sglang_ext_testkit.stand_ins", "-c", code], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'flashinfer': 'stand-in'" in out.stdout, out.stdout


def test_one_run_only_when_every_row_shares_a_run_id():
    same = gen_performance_doc._provenance([("a", {"run_id": "r1", "attention": "fa3"}),
                                            ("b", {"run_id": "r1", "attention": "fa3"})])[0]
    assert "one run (run id r1)" in same and "Attention backend: fa3." in same and "Kernels: not recorded" in same
    mixed = gen_performance_doc._provenance([("a", {"run_id": "r1"}), ("b", {"run_id": "r2"}), ("c", {})])[0]
    assert "not shown to be one run: a: run r1; b: run r2; c: run id not recorded" in mixed


def test_a_lower_bound_never_meets_a_ceiling():
    assert gen_performance_doc._target("peak", 927, "<=", 2048, "{:.0f}", lower_bound=True) == \
        "| peak | ≥ 927 | <= 2048 | not known (lower bound) |"
    assert gen_performance_doc._target("peak", 927, "<=", 2048, "{:.0f}").endswith("| met |")
    assert gen_performance_doc._target("hits", 0.95, ">=", 0.9, lower_bound=True).endswith("| met |")


def test_check_flags_a_hand_added_key_in_a_results_file(tmp_path, monkeypatch):
    """--check's schema step: the committed pi05 file passes; the same file with a typed-in key fails."""
    source = os.path.join(gen_performance_doc.BENCH_DIR, "pi05_0517.json")
    run = json.load(open(source, encoding="utf-8"))
    (tmp_path / "pi05_0517.json").write_text(json.dumps(run))
    monkeypatch.setattr(gen_performance_doc, "BENCH_DIR", str(tmp_path))
    assert gen_performance_doc.schema_problems() == []
    run["results"][0]["mode_key"] = "eager"
    run["settings"]["typed_in"] = 1
    (tmp_path / "pi05_0517.json").write_text(json.dumps(run))
    assert gen_performance_doc.schema_problems() == [
        "docs/bench/pi05_0517.json: settings.typed_in, results[].mode_key"]


@pytest.mark.parametrize("backend", ["triton_attn", "fa3"])
def test_bench_vit_kernels_record_is_what_its_schema_declares(backend):
    """bench_vit.py's one `kernels` record: packages loaded (bench_results.kernels) + what ran (kit.kernel_report)."""
    import bench_vit

    record = bench_vit.kernels_now(backend)
    assert set(record) == set(bench_results.VIT_KERNELS_SCHEMA) - ({"fa3"} if backend != "fa3" else set())
    assert record["attention_backend"] == backend and record["sgl_kernel_ops"] in ("real", "native torch")
    report = {"config": {"attention": backend}, "results": [{"mode": "eager-only", "kernels": record}]}
    assert bench_results.undeclared(report, bench_results.VIT_SCHEMA) == []
    report["results"][0]["kernels"] = {**record, "typed_in": 1}
    assert bench_results.undeclared(report, bench_results.VIT_SCHEMA) == ["results[].kernels.typed_in"]


def test_readme_headlines_are_the_results_files_numbers_and_link_their_tables(tmp_path, monkeypatch):
    """The README's headline table: written from docs/bench/*.json, each row linking a heading of
    docs/performance.md, and what README.md holds now (CI's --check fails otherwise)."""
    import re

    for name in ("BENCH_DIR", "DOC"):  # main() points them at its arguments; restored after the test
        monkeypatch.setattr(gen_performance_doc, name, getattr(gen_performance_doc, name))

    block = gen_performance_doc.render_readme_block()
    headings = [line[3:] for line in gen_performance_doc.render().splitlines() if line.startswith("## ")]
    links = re.findall(r"\]\((docs/performance\.md#[^)]+)\)", block)
    assert links == [gen_performance_doc._anchor(h) for h in (gen_performance_doc.VIT_HEADING,
                                                             gen_performance_doc.VIT_SERVER_HEADING,
                                                             gen_performance_doc.PI05_HEADING,
                                                             gen_performance_doc.PI05_SERVER_HEADING,
                                                             gen_performance_doc.CP_HEADING)]
    assert set(links) <= {gen_performance_doc._anchor(h) for h in headings}
    bench = os.path.join(SCRIPTS, "..", "docs", "bench")
    fast = [r for r in json.load(open(os.path.join(bench, "pi05_0517-ext.json")))["results"]
            if r["mode"] == "graph-fast"][0]
    assert f"| {fast['p50_ms']:.1f} ms (`--ext-pi05-fast`)" in block
    served = {(r["server"], r["wire"], r["motion"]): r
              for r in json.load(open(os.path.join(bench, "server_pi05.json")))["results"]}
    assert f"| {served[('ext-fast', 'openpi', 'random')]['p50_ms']:.1f} ms fast (p99 " in block
    vit = [r for r in json.load(open(os.path.join(bench, "vit.json")))["results"] if r["mode"].startswith("ext-")][0]
    assert f"{vit['speedup_vs_eager']:.2f}x eager's requests/s" in block
    server = json.load(open(os.path.join(bench, "vit_server.json")))
    ext1, off1 = ([r["req_s"] for r in server["passes"] if (r["concurrency"], r["images"], r["config"]) == (1, "1", c)
                   and r["req_s"] is not None] for c in ("ext", "graphs-off"))
    import statistics

    assert f"| {statistics.median(ext1) / statistics.median(off1):.2f}x / " in block and "at concurrency 1 / " in block
    readme = open(gen_performance_doc.README, encoding="utf-8").read()
    assert f"{gen_performance_doc.README_BEGIN}\n{block}{gen_performance_doc.README_END}" in readme
    # --check names the README when its lines are stale
    stale = tmp_path / "README.md"
    stale.write_text(readme.replace(block, block.replace(f"{fast['p50_ms']:.1f} ms", "9.9 ms")))
    assert gen_performance_doc.main(["--check", "--readme", str(stale)]) == 1
    assert gen_performance_doc.main(["--check"]) == 0
    # results from elsewhere (a GPU run's folder) write their doc there and leave README.md alone
    (tmp_path / "bench").mkdir()
    gen_performance_doc.main(["--bench-dir", str(tmp_path / "bench"), "--doc", str(tmp_path / "perf.md")])
    assert (tmp_path / "perf.md").exists()
    assert open(gen_performance_doc.README, encoding="utf-8").read() == readme
