"""bench_vit.py's launch-free bound (issue 14): device time from profiler activities, its table and schema."""

from __future__ import annotations

import os
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts")
sys.path.insert(0, SCRIPTS)

import bench_results  # noqa: E402
import bench_vit  # noqa: E402
import gen_performance_doc  # noqa: E402


def test_device_time_sums_kernels_and_counts_overlapping_activity_once():
    activities = [("gemm", 0.0, 10.0), ("Memcpy HtoD (Pageable -> Device)", 5.0, 20.0), ("norm", 30.0, 40.0),
                  ("inside_norm", 32.0, 35.0), ("Memset (Device)", 50.0, 51.0)]
    out = bench_vit.device_time(reversed(activities))  # any order
    assert out["kernel_ms"] == pytest.approx((10 + 10 + 3) / 1000)  # copies and memsets are not kernels
    assert out["device_ms"] == pytest.approx((20 + 10 + 1) / 1000)  # busy spans [0,20], [30,40], [50,51]
    assert bench_vit.device_time([]) == {"kernel_ms": 0.0, "device_ms": 0.0}


def _row(mode, **extra):
    return {"mode": mode, "profiled_requests": 50, "eager_wall_ms": 24.0, "eager_kernel_ms": 7.5,
            "eager_device_ms": 8.0, "eager_gpu_busy": 8.0 / 24.0, "launch_free_bound": 3.0, **extra}


def test_bound_table_shows_each_mode_against_its_bound_and_the_schema_takes_it():
    bucket = _row("ext-bucket (cap 16)", graph_wall_ms=16.0, graph_kernel_ms=8.5, graph_device_ms=9.6,
                  graph_gpu_busy=0.6, graph_bound=2.5)
    rows = [_row("eager-only"), bucket, _row("ext-layout (cap 16)", profile_error="RuntimeError: x"),
            {"mode": "0.5.17", "crashed": "AcceleratorError"}]
    text = bench_vit.bound_table(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and "0.5.17" not in text  # header + three profiled rows
    bucket_line = next(line for line in lines if line.lstrip().startswith("ext-bucket"))
    cells = bucket_line.split()
    assert cells[-4:] == ["0.6", "1.5", "2.5", "-"]  # GPU busy, speedup 24/16, graph bound, no error
    assert "RuntimeError: x" in text
    assert bench_vit.bound_table([{"mode": "0.5.17", "crashed": "x"}]) == ""
    report = {"config": {"profile_requests": 50}, "results": rows}
    assert bench_results.undeclared(report, bench_vit.SCHEMA) == []
    doc = "\n".join(gen_performance_doc._vit_bound(rows))
    assert "launch-free bound" in doc and bucket_line in doc
    assert gen_performance_doc._vit_bound(rows[-1:]) == []
