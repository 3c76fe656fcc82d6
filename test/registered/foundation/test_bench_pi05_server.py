"""scripts/bench_pi05_server.py plumbing on the CPU: the robot streams, the per-request breakdown, the
summary row, the moving-robot targets and docs/performance.md's server section (the servers themselves:
the GPU run, or `--cpu-logic-check` on sglang's server with the stand-in policy)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

import bench_pi05_server  # noqa: E402
import bench_results  # noqa: E402
import gen_performance_doc  # noqa: E402
from sglang_ext_testkit import pi05_clients as clients  # noqa: E402

STAGES = {"preprocess_ms": 1.0, "cache_lookup_ms": 0.0, "prefix_ms": 0.5, "action_denoise_ms": 12.0,
          "postprocess_ms": 0.1}


def _record(total, actions=None):
    actions = np.zeros((50, 7), np.float32) if actions is None else actions
    return clients.Record(0.1, total - 0.3, 0.2, total, actions, dict(STAGES))


def test_breakdown_splits_a_request_into_the_path_parts():
    parts = clients.breakdown(_record(16.0))
    assert parts["pipeline"] == pytest.approx(13.6) and parts["outside_pipeline"] == pytest.approx(2.4)
    assert parts["client_encode"] == 0.1 and parts["client_decode"] == 0.2
    assert parts["action_denoise"] == 12.0 and parts["total"] == 16.0
    assert set(parts) == {"total", "client_encode", "client_decode", "pipeline", "outside_pipeline",
                          "preprocess", "cache_lookup", "prefix", "action_denoise", "postprocess"}


def test_summary_row_has_percentiles_tail_ratio_and_accuracy_over_every_answer():
    records = [_record(15.0 + 0.1 * i, actions=np.full((50, 7), 1.0 + 0.001 * (i == 23), np.float32))
               for i in range(30)]
    reference = [np.ones((50, 7), np.float32)] * 30  # one answer per observation: the 24th differs
    row = bench_pi05_server.summarize("ext-fast", "openpi", records, reference)
    assert row["requests"] == 30 and row["p50_ms"] == pytest.approx(16.5, abs=0.11)
    assert row["p99_ms"] == pytest.approx(17.9) and row["p99_over_p50"] == pytest.approx(17.9 / row["p50_ms"])
    assert row["max_rel_diff_vs_exact"] == pytest.approx(1e-3, rel=1e-3) and row["checked_requests"] == 30
    assert bench_results.undeclared({"results": [row]}, bench_results.PI05_SERVER_SCHEMA) == []


def _row(server, wire, motion, p50, p99, **extra):
    return {"server": server, "wire": wire, "motion": motion, "client": "own", "p50_ms": p50, "p99_ms": p99,
            "p99_over_p50": p99 / p50, **extra}


def test_targets_are_for_moving_robots_and_compare_exact_with_unpatched():
    rows = [_row("ext-fast", "openpi", "random", 16.0, 18.0, captures_after_start=0, max_rel_diff_vs_exact=2e-3,
                 outside_pipeline_p50_ms=2.0),
            _row("ext-fast", "json", "random", 22.0, 30.0, captures_after_start=1),
            _row("ext-exact", "openpi", "random", 60.0, 70.0, captures_after_start=0),
            _row("0517", "openpi", "random", 64.0, 196.0),
            _row("ext-fast", "openpi", "fixed", 99.0, 99.0, captures_after_start=5)]  # one row, never a target
    got = {label: (value, bound) for label, value, _, bound in bench_results.pi05_server_targets(rows)}
    assert got == {
        "ext-fast openpi random: client p50 ms": (16.0, 17.0),
        "ext-fast openpi random: p99 / p50": (18.0 / 16.0, 1.2),
        "ext-fast openpi random: p50 outside the pipeline ms": (2.0, 2.5),
        "ext-fast openpi random: max relative difference from exact": (2e-3, 5e-3),
        "ext-fast openpi random: graphs captured after start": (0, 0),
        "ext-fast json random: client p50 ms": (22.0, 21.0),
        "ext-fast json random: graphs captured after start": (1, 0),
        "ext-exact openpi random: graphs captured after start": (0, 0),
        "ext-exact openpi random: p50 ms vs unpatched 0517": (60.0, 64.0),
        "ext-exact openpi random: p99 ms vs unpatched 0517": (70.0, 196.0),
    }
    rows[3]["server"] = "upstream"  # the name since 0.5.23 runs (0517: files written before)
    got = {label: (value, bound) for label, value, _, bound in bench_results.pi05_server_targets(rows)}
    assert got["ext-exact openpi random: p50 ms vs unpatched upstream"] == (60.0, 64.0)


def test_robot_streams_move_switch_tasks_and_cameras():
    cameras = ("base_0_rgb", "left_wrist_0_rgb")
    moving = clients.robot_stream(120, cameras, motion="random", task_every=50)
    states = np.stack([o.state for o in moving])
    assert len({o.state.tobytes() for o in moving}) == 120 and (np.abs(states) <= 1).all()
    assert [o.prompt for o in moving[::50]] == list(clients.TASKS[:3])
    assert [sorted(o.images) for o in moving[::50]] == [list(cameras), [cameras[0]], [cameras[1]]]
    kept = clients.robot_stream(150, cameras, motion="random", task_every=50, keep_first_camera=True)
    assert [sorted(o.images) for o in kept[::50]] == [list(cameras), [cameras[0]], list(cameras)]
    smooth = np.stack([o.state for o in clients.robot_stream(60, cameras, motion="smooth")])
    assert np.abs(np.diff(smooth, axis=0)).max() < 0.1 < np.ptp(smooth, axis=0).max()  # moves, never jumps
    fixed = clients.robot_stream(10, cameras, motion="fixed")
    assert len({o.state.tobytes() for o in fixed}) == 1 and {o.prompt for o in fixed} == {clients.PROMPT}
    assert len({o.noise.tobytes() for o in fixed}) == 10 and all(sorted(o.images) == list(cameras) for o in fixed)
    with pytest.raises(ValueError, match="motion: 'walk' is not allowed; allowed: random, smooth, fixed"):
        clients.robot_stream(1, cameras, motion="walk")


def test_graph_counts_come_from_the_server_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("Captured VLA denoise CUDA graph: batch=1\nCaptured VLA prefix CUDA graph for X\n"
                   "VLA prefix CUDA graphs were captured at load: 1 requests ran eager since (no graph for Y)\n"
                   "VLA prefix CUDA graphs were captured at load: 2 requests ran eager since (no graph for Z)\n")
    assert clients.graph_log_counts(str(log)) == {"captures": 2, "eager_after_load_prefix": 2}


def test_bad_server_or_wire_names_are_refused_with_the_allowed_ones():
    with pytest.raises(SystemExit, match="--servers: ext-slow not allowed; allowed: upstream, ext-no-transport"):
        bench_pi05_server._choices("ext-exact,ext-slow", bench_pi05_server.SERVERS, "servers")


def test_performance_doc_renders_the_server_section_and_its_targets(tmp_path, monkeypatch):
    rows = [{**bench_pi05_server.summarize("ext-fast", wire, [_record(16.0 + 0.01 * i) for i in range(20)], None),
             "motion": "random", "captures_after_start": 0} for wire in ("openpi", "json")]
    rows.append({"server": "0517", "wire": "sglang", "client": "sglang bench_pi05_openpi.py (openpi_ws)",
                 "requests": 20, "p50_ms": 31.0, "p90_ms": 33.0})
    report = {"run_id": "r1", "device": "NVIDIA H200", "torch": "2.11.0", "sglang": "0.5.17", "kernels": {},
              "attention": "server default", "command": "python3 scripts/bench_pi05_server.py",
              "client_png_encode_ms": 6.0, "settings": {"requests": 20, "warmup": 5},
              "servers": {"ext-exact": {"error": "ServerError: exited"}}, "results": rows}
    bench_results.write(str(tmp_path / "server_pi05.json"), report, bench_results.PI05_SERVER_SCHEMA)
    doc = tmp_path / "performance.md"
    # main() points the module at --bench-dir / --doc; restored after the test
    monkeypatch.setattr(gen_performance_doc, "BENCH_DIR", gen_performance_doc.BENCH_DIR)
    monkeypatch.setattr(gen_performance_doc, "DOC", gen_performance_doc.DOC)
    assert gen_performance_doc.main(["--bench-dir", str(tmp_path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "## Pi0.5 through the server" in text and "one run (run id r1)" in text
    assert "| ext-fast openpi random: client p50 ms | 16.10 | <= 17.00 | met |" in text
    assert "| ext-fast json random: client p50 ms | 16.10 | <= 21.00 | met |" in text
    assert "| ext-fast openpi random: graphs captured after start | 0.00 | <= 0.00 | met |" in text
    assert "- ext-exact: ServerError: exited" in text and "0517 | sglang | sglang's | 20 | 31.00" in text
    # the server's hops are not measured: their breakdown columns are `-`, client and stages are not
    assert "ext-fast openpi random: 0.10 - - - - - - 13.60 - 0.20  [preprocess 1.00" in text
    # a run on sglang 0.5.23, kept beside it, renders as its own section naming its release and kernels
    report.update(run_id="r2", sglang="0.5.23", kernels={"sgl_kernel": "0.4.5"}, stand_ins=["imageio_ffmpeg"])
    report["results"][-1]["server"] = "upstream"
    bench_results.write(str(tmp_path / "server_pi05_sglang_0523.json"), report, bench_results.PI05_SERVER_SCHEMA)
    assert gen_performance_doc.main(["--bench-dir", str(tmp_path), "--doc", str(doc)]) == 0
    text = doc.read_text().split("### On sglang 0.5.23: `docs/bench/server_pi05_sglang_0523.json`")
    assert len(text) == 2 and "0517 | sglang | sglang's | 20 | 31.00" in text[0], text[0][-2000:]
    assert "Release: sglang 0.5.23's Python; the kernels were 0.5.17's sgl-kernel 0.4.5" in text[1]
    assert "one run (run id r2)" in text[1] and "upstream | sglang | sglang's | 20 | 31.00" in text[1]
    data = json.loads((tmp_path / "server_pi05.json").read_text())
    data["results"][0]["hand_added"] = 1
    (tmp_path / "server_pi05.json").write_text(json.dumps(data))
    assert "results[].hand_added" in " ".join(bench_results.undeclared(data, bench_results.PI05_SERVER_SCHEMA))
