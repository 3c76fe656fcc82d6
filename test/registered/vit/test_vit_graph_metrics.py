"""The ViT runner's calls reach the Prometheus metrics (`sglang_ext_graph_*{cache="vit_cuda_graph"}`).

In-process, with the recording CUDA-graph fake of test_vit_cuda_graph_runner.py; the
multiprocess collection itself is tested in test/registered/graphs/test_graph_metrics.py.
"""

from __future__ import annotations

import gc

import prometheus_client  # before PROMETHEUS_MULTIPROC_DIR is set below: plain in-memory values here
import pytest
from sglang.test.ci.ci_register import register_cpu_ci
from sglang_ext_testkit.metrics import reset_metrics
from sglang_ext_testkit import internals

from conftest import ext_core  # test/registered/conftest.py
from test_vit_cuda_graph_runner import StubTower, call, fake_cuda, new_runner, vit_patch  # noqa: F401

register_cpu_ci(est_time=20, suite="base-a-test-cpu")


@pytest.fixture
def metrics_on(monkeypatch, tmp_path):
    """Call it after the patch is applied; returns the stats module the patched runner reports to."""
    used = []

    def switch_on():
        stats = ext_core("graphs.stats")  # sglang_ext's, or the patched tree's copy
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        reset_metrics(stats)
        used.append(stats)
        return stats

    yield switch_on
    for stats in used:
        reset_metrics(stats)  # the variable is unset again: the next publish switches off


def read(stats):
    out = {}
    for family in internals.metrics_registry(stats).collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_vit_runner_calls_are_current_in_the_metrics_after_each_call(vit_patch, fake_cuda, metrics_on):
    gc.collect()  # runners of earlier tests would add to the same cache label
    vit_patch(vit_graph_max_entries=1, vit_graph_policy="exact")
    stats = metrics_on()
    runner = new_runner(StubTower())
    call(runner, 8, (0, 0, 4, 8), (0, 2, 4, 8))  # capture
    call(runner, 8, (0, 0, 4, 8), (0, 2, 4, 8))  # hit
    call(runner, 8, (0, 0, 2, 8), (0, 2, 8))  # full under 'exact': eager, reason capacity
    mine = runner.engine.info()
    assert (mine["captures"], mine["hits"], mine["fallback_capacity"]) == (1, 1, 1)
    vit = [v for name, v in stats.snapshot().items() if stats.cache_label(name) == "vit_cuda_graph"]
    total = lambda field: sum(v[field] for v in vit)  # noqa: E731
    got = read(stats)
    label = (("cache", "vit_cuda_graph"),)
    assert got[("sglang_ext_graph_hits_total", label)] == total("hits")
    assert got[("sglang_ext_graph_misses_total", label)] == total("misses")
    assert got[("sglang_ext_graph_captures_total", label)] == total("captures")
    assert got[("sglang_ext_graph_eager_fallbacks_total", (("cache", "vit_cuda_graph"), ("reason", "capacity")))] \
        == total("fallback_capacity")
    assert got[("sglang_ext_graph_resident", label)] == total("size")
    assert got[("sglang_ext_graph_capacity", label)] == total("capacity")
    assert got[("sglang_ext_graph_resident_bytes", label)] == total("bytes_resident")
    call(runner, 8, (0, 0, 4, 8), (0, 2, 4, 8))  # one more hit shows at once
    assert read(stats)[("sglang_ext_graph_hits_total", label)] == total("hits") + 1


def test_bucket_mode_chunked_calls_reach_the_metrics(vit_patch, fake_cuda, metrics_on, monkeypatch):
    from test_vit_budget_mode import _probed_runner, merged_call

    gc.collect()
    stats = metrics_on()
    runner = _probed_runner(vit_patch, monkeypatch, vit_graph_above_ladder="split")
    merged_call(runner, 26, (0, 0, 4, 12, 20, 26), (0, 4, 12, 20, 26), 1)  # above the ladder: two chunks
    assert runner.engine.info()["chunked_calls"] == 1
    vit = [v for name, v in stats.snapshot().items() if stats.cache_label(name) == "vit_cuda_graph"]
    assert read(stats)[("sglang_ext_graph_chunked_calls_total", (("cache", "vit_cuda_graph"),))] == sum(
        v["chunked_calls"] for v in vit) >= 1
