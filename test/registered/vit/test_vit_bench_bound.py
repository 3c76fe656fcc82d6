"""bench_vit.py's launch-free bound: device time from profiler activities, its table and schema."""

from __future__ import annotations

import os
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts")

import bench_results  # noqa: E402
import bench_vit  # noqa: E402
import gen_performance_doc  # noqa: E402


def test_device_time_sums_kernels_and_counts_overlapping_activity_once():
    t0 = 1_796_120_713_418_420_277  # epoch nanoseconds, as the profiler records them
    us = 1000
    activities = [("gemm", t0, t0 + 10 * us), ("Memcpy HtoD (Pageable -> Device)", t0 + 5 * us, t0 + 20 * us),
                  ("norm", t0 + 30 * us, t0 + 40 * us), ("inside_norm", t0 + 32 * us, t0 + 35 * us),
                  ("Memset (Device)", t0 + 50 * us, t0 + 51 * us), ("tiny", t0 + 60 * us, t0 + 60 * us + 300)]
    out = bench_vit.device_time(reversed(activities))  # any order
    assert out["kernel_ms"] == pytest.approx((10 + 10 + 3 + 0.3) / 1000)  # copies and memsets are not kernels
    assert out["device_ms"] == pytest.approx((20 + 10 + 1 + 0.3) / 1000)  # busy [0,20] [30,40] [50,51] [60,60.3]
    assert bench_vit.device_time([]) == {"kernel_ms": 0.0, "device_ms": 0.0}


def _row(mode, **extra):
    return {"mode": mode, "profiled_requests": 50, "eager_wall_ms": 24.0, "eager_kernel_ms": 7.5,
            "eager_device_ms": 8.0, "eager_gpu_busy": 8.0 / 24.0, "launch_free_bound": 3.0, **extra}


def test_bound_table_shows_each_mode_against_its_bound_and_the_schema_takes_it():
    bucket = _row("ext-bucket (cap 16)", graph_wall_ms=16.0, graph_kernel_ms=8.5, graph_device_ms=9.6,
                  graph_gpu_busy=0.6, graph_bound=2.5)
    rows = [_row("eager-only"), bucket, _row("ext-layout (cap 16)", profile_error="RuntimeError: x"),
            {"mode": "0.5.17", "crashed": "AcceleratorError"}]
    text = bench_results.vit_bound_table(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and "0.5.17" not in text  # header + three profiled rows
    bucket_line = next(line for line in lines if line.lstrip().startswith("ext-bucket"))
    cells = bucket_line.split()
    assert cells[-4:] == ["0.6", "1.5", "2.5", "-"]  # GPU busy, speedup 24/16, graph bound, no error
    assert "RuntimeError: x" in text
    assert bench_results.vit_bound_table([{"mode": "0.5.17", "crashed": "x"}]) == ""
    report = {"config": {"profile_requests": 50}, "results": rows}
    assert bench_results.undeclared(report, bench_results.VIT_SCHEMA) == []
    doc = "\n".join(gen_performance_doc._vit_bound(rows))
    assert "launch-free bound" in doc and bucket_line in doc
    assert gen_performance_doc._vit_bound(rows[-1:]) == []


class _Runner:
    """An sglang-ext runner as the bench reads it: its engine's counters."""

    def __init__(self, miss_on_replay):
        self.engine = self
        self.misses = 0
        self.miss_on_replay = miss_on_replay

    def info(self):
        return {"misses": self.misses}


def test_profile_bound_uses_the_timed_walls_of_the_profiled_requests(monkeypatch):
    """Walls come from the timed stream (same requests, unprofiled); a graph miss under the profiler voids
    the graph numbers but keeps eager's."""
    requests = list(bench_vit.request_stream(10, 0))
    walls = {"eager": [0.020 + 0.001 * i for i in range(10)], "graph": [0.010] * 10}
    device = {False: {"kernel_ms": 6.0, "device_ms": 8.0}, True: {"kernel_ms": 7.0, "device_ms": 9.0}}
    calls = []

    def forward(vit, pixels, grid_thw, *, graph):
        calls.append((graph, pixels.shape[0]))
        if graph and vit.cuda_graph_runner.miss_on_replay:
            vit.cuda_graph_runner.misses += 1

    def profile_device(run_request, indices):
        graph_before = len(calls)
        for i in indices:
            run_request(i)
        return device[calls[graph_before][0]]

    monkeypatch.setattr(bench_vit.kit, "forward", forward)
    monkeypatch.setattr(bench_vit, "profile_device", profile_device)
    monkeypatch.setattr(bench_vit, "pixels_for", lambda tokens, seed, dtype: __import__("torch").empty(tokens, 1))

    class Vit:
        cuda_graph_runner = _Runner(miss_on_replay=False)

    out = bench_vit.profile_bound(Vit(), requests, walls, 5, dtype=None, graph=True)
    sampled = [0, 2, 4, 6, 8]  # spread over the stream
    assert [tokens for _, tokens in calls[:5]] == [requests[i][0] for i in sampled]
    eager_wall = 1000 * sum(walls["eager"][i] for i in sampled) / 5
    assert out["profiled_requests"] == 5 and out["eager_wall_ms"] == pytest.approx(eager_wall)
    assert out["launch_free_bound"] == pytest.approx(eager_wall / 8.0)
    assert out["graph_bound"] == pytest.approx(eager_wall / 9.0)
    assert out["graph_gpu_busy"] == pytest.approx(9.0 / 10.0) and "profile_error" not in out

    Vit.cuda_graph_runner = _Runner(miss_on_replay=True)
    missed = bench_vit.profile_bound(Vit(), requests, walls, 5, dtype=None, graph=True)
    assert missed["profile_error"] == "RuntimeError: the graph path missed during its profile"
    assert "graph_bound" not in missed and missed["launch_free_bound"] == pytest.approx(eager_wall / 8.0)
    assert bench_vit.profile_bound(Vit(), requests, walls, 0, dtype=None, graph=True) == {}
