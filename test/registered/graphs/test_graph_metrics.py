"""Prometheus metrics of the graph caches (`sglang_ext.graphs.stats.publish`), on CPU.

A child process runs real `BoundedGraphCache`s (fake graphs: the GPU is the only fake),
registered under the names the Pi0.5 runners use, with PROMETHEUS_MULTIPROC_DIR set, as
sglang's `--enable-metrics` sets it for its schedulers. The parent then collects that folder
twice: with prometheus_client's MultiProcessCollector, and through sglang 0.5.17's own
`/metrics` route (`set_prometheus_multiproc_dir` + `add_prometheus_middleware`, the code the
HTTP server runs). Without the variable, nothing is created and prometheus_client is not imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci
from sglang_ext_testkit.metrics import reset_metrics
from sglang_ext_testkit import internals

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r'''
import json, sys
from sglang_ext.graphs import stats
from sglang_ext_testkit import internals
from sglang_ext.graphs.cache import BoundedGraphCache
from graph_core_fakes import run_step

events, graphs = [], []
prefix = BoundedGraphCache("vla.prefix", 2)                      # LRU: evicts
action = BoundedGraphCache("vla.action-denoise", 1, policy="exact")  # full: runs eager (capacity)
other = BoundedGraphCache("not-a-runner", 4)                     # no metrics for unknown names
stats.register("vla.prefix", prefix.info)
stats.register("vla.action-denoise", action.info)
stats.register("not-a-runner", other.info)
stats.publish()
for key in [1, 2, 1, 3, 1, 2, 2, 4]:
    run_step(prefix, key, events, graphs, nbytes=100 * key)
for key in ["a", "b", "a", "c", "a"]:
    run_step(action, key, events, graphs, nbytes=64)
run_step(action, "a", events, graphs)            # a hit
run_step(other, "x", events, graphs)
before_clear = prefix.info().as_dict()
prefix.clear()                                  # counters restart at 0; Prometheus counters must not drop
run_step(prefix, 9, events, graphs, nbytes=7)
print("INFO " + json.dumps({"prefix_before_clear": before_clear, "prefix": prefix.info().as_dict(),
                            "action": action.info().as_dict(), "pid": __import__("os").getpid(),
                            "prometheus_imported": "prometheus_client" in sys.modules,
                            "created": internals.metrics_registry() is not None}))
'''


def run_child(env_extra):
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("INFO "))
    return json.loads(line[len("INFO "):])


def samples(text):
    """{(sample name, frozenset(labels)): value} from an exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("sglang_ext_"):
                out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def expected(info, pid):
    p, a, before = info["prefix"], info["action"], info["prefix_before_clear"]
    pid = str(pid)
    c = lambda cache, **kw: frozenset({"cache": cache, **kw}.items())  # noqa: E731
    g = lambda cache: frozenset({"cache": cache, "pid": pid}.items())  # noqa: E731
    out = {}
    for family in ("hits", "misses", "captures", "evictions"):
        out[(f"sglang_ext_graph_{family}_total", c("pi05_prefix_graph"))] = before[family] + p[family]
        out[(f"sglang_ext_graph_{family}_total", c("pi05_action_graph"))] = a[family]
    out[("sglang_ext_graph_eager_fallbacks_total", c("pi05_action_graph", reason="capacity"))] = a["rejections"]
    out[("sglang_ext_graph_resident", g("pi05_prefix_graph"))] = p["size"]
    out[("sglang_ext_graph_resident", g("pi05_action_graph"))] = a["size"]
    out[("sglang_ext_graph_resident_bytes", g("pi05_prefix_graph"))] = p["bytes_resident"]
    out[("sglang_ext_graph_resident_bytes", g("pi05_action_graph"))] = a["bytes_resident"]
    out[("sglang_ext_graph_capacity", g("pi05_prefix_graph"))] = p["capacity"]
    out[("sglang_ext_graph_capacity", g("pi05_action_graph"))] = a["capacity"]
    return out


def test_off_creates_nothing_and_never_imports_prometheus_client():
    info = run_child({})
    assert info["prometheus_imported"] is False and info["created"] is False


def test_a_child_process_metrics_reach_the_multiprocess_collector(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    info = run_child({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert info["created"] is True
    # the scenario did what it is meant to show
    assert info["prefix_before_clear"]["evictions"] >= 2 and info["action"]["rejections"] >= 2
    assert info["action"]["hits"] >= 2 and info["prefix"]["hits"] == 0
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    got = samples(generate_latest(registry).decode())
    want = expected(info, info["pid"])
    assert {k: got.get(k) for k in want} == want
    assert not [k for k in got if "not-a-runner" in str(k)]
    # after clear() the counters kept what was counted before it
    assert got[("sglang_ext_graph_captures_total", frozenset({"cache": "pi05_prefix_graph"}.items()))] == (
        info["prefix_before_clear"]["captures"] + 1)


def test_sglang_metrics_route_serves_them(tmp_path, monkeypatch):
    """sglang 0.5.17's own path: set_prometheus_multiproc_dir() in the launcher, children inherit
    the variable, the HTTP server's /metrics collects the folder."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils import common

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # restored (unset) afterwards
    monkeypatch.setattr(common.tempfile, "tempdir", str(tmp_path))  # its TemporaryDirectory lands here
    common.set_prometheus_multiproc_dir()
    folder = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    assert folder.startswith(str(tmp_path))
    info = run_child({"PROMETHEUS_MULTIPROC_DIR": folder})
    app = FastAPI()
    common.add_prometheus_middleware(app)
    response = TestClient(app).get("/metrics")
    assert response.status_code == 200
    got = samples(response.text)
    want = expected(info, info["pid"])
    assert {k: got.get(k) for k in want} == want


def test_prefill_cp_bucket_decisions_reach_the_metrics(monkeypatch, tmp_path):
    """The prefill CP runner's counters (real adapter code; the runner is a bare object)."""
    import prometheus_client  # noqa: F401  (before the variable: in-memory values in this process)

    from sglang_ext.prefill_cp.bucket import (PREFILL_CP_BUCKET_STATS_NAME, PrefillCPBucketCounters,
                                             record_bucket_decision)
    from sglang_ext.graphs import stats
    from sglang_ext.graphs.buckets import BucketDecision

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    reset_metrics(stats)
    try:
        runner = type("PrefillRunner", (), {})()
        counters = PrefillCPBucketCounters()  # registered as the patched runner registers it
        stats.register(PREFILL_CP_BUCKET_STATS_NAME, counters.as_dict, owner=runner)
        captured = [64, 128, 256]
        record_bucket_decision(counters, BucketDecision(live_size=100, bucket=128), captured)
        record_bucket_decision(counters, BucketDecision(live_size=100, bucket=256), captured)  # larger bucket
        record_bucket_decision(counters, BucketDecision(live_size=300, bucket=None), captured)
        record_bucket_decision(counters, None, captured)
        got = {}
        for family in internals.metrics_registry().collect():
            for s in family.samples:
                if not s.name.endswith("_created"):
                    got[(s.name, tuple(sorted(s.labels.items())))] = s.value
        label = ("cache", "prefill_cp_bucket")
        assert got[("sglang_ext_graph_hits_total", (label,))] == counters.admitted == 2
        assert got[("sglang_ext_graph_padding_tokens_total", (label,))] == counters.padding_rows_total == 28 + 156
        assert got[("sglang_ext_graph_eager_fallbacks_total", (label, ("reason", "no_fit")))] == 1
        assert got[("sglang_ext_graph_eager_fallbacks_total", (label, ("reason", "unknown_layout")))] == 1
    finally:
        reset_metrics(stats)


def test_reserved_memory_gauge_survives_repeated_publishes(monkeypatch, tmp_path):
    """Found on the H200: with CUDA initialised, the second publish raised KeyError and switched the
    metrics off for good. Here torch.cuda reports itself initialised (the GPU is the only fake)."""
    import prometheus_client  # noqa: F401  (before the variable: in-memory values in this process)
    import torch

    from sglang_ext.graphs import stats
    from sglang_ext.graphs.cache import BoundedGraphCache

    reserved = [1 << 20]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    reset_metrics(stats)
    cache = BoundedGraphCache("vla.prefix", 2)
    name = stats.register("vla.prefix", cache.info)
    try:
        for step in range(3):
            reserved[0] = (step + 1) << 20
            cache.admit(step)
            cache.put(step, object(), nbytes=10)
            stats.publish()
        assert stats._prom["on"] is True, "publishing switched itself off"
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in internals.metrics_registry().collect() for s in family.samples}
        assert got[("sglang_ext_cuda_memory_reserved_bytes", ())] == 3 << 20
        assert got[("sglang_ext_graph_captures_total", (("cache", "pi05_prefix_graph"),))] == 3
        assert got[("sglang_ext_graph_resident", (("cache", "pi05_prefix_graph"),))] == 2
    finally:
        internals.unregister(name)
        reset_metrics(stats)
