"""scripts/bench_prefill_cp.py runs on the CPU against real sglang: a small run writes its results file,
and the patched bucket choice never crashes where unpatched sglang's does."""

from __future__ import annotations

import json

from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only  # noqa: E402  (test/registered/conftest.py)

register_cpu_ci(est_time=30, suite="base-a-test-cpu")


@plugin_only  # the bench activates the installed plugin, which stands aside on a patched tree
def test_a_small_run_writes_every_cp_size_and_the_patch_never_crashes(tmp_path):
    import bench_prefill_cp  # scripts/, on the path (conftest.py)

    out = tmp_path / "prefill_cp.json"
    assert bench_prefill_cp.main(["--batches", "300", "--calls", "5", "--rounds", "1", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert [row["cp"] for row in run["admission"]] == list(bench_prefill_cp.CP_SIZES)
    for row in run["admission"]:
        ext, unpatched = row["ext"], row["unpatched"]
        assert row["batches"] == 300 == ext["graph"] + ext["graph_larger"] + ext["eager_no_fit"] + ext["eager"]
        assert "crash" not in ext and unpatched["eager"] == ext["eager"]
        # each batch unpatched sglang crashes on takes a larger bucket (or, none fitting, runs eager)
        assert ext["graph_larger"] + ext["eager_no_fit"] == unpatched["crash"]
    assert sum(row["unpatched"]["crash"] for row in run["admission"]) > 0  # the stream reaches the bug
    assert {row["cp"] for row in run["decision"]} == set(bench_prefill_cp.CP_SIZES)
