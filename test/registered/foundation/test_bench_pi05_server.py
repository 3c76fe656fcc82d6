"""scripts/bench_pi05_server.py plumbing on the CPU: the per-request breakdown, the summary row, the
issue 26 targets and docs/performance.md's server section (the servers themselves: the GPU run, or
`--cpu-logic-check` on sglang's server with the stand-in policy)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import bench_pi05_server  # noqa: E402
import bench_results  # noqa: E402
import gen_performance_doc  # noqa: E402
from sglang_ext_testkit import pi05_clients as clients  # noqa: E402

STAGES = {"preprocess_ms": 1.0, "cache_lookup_ms": 0.0, "prefix_ms": 0.5, "action_denoise_ms": 12.0,
          "postprocess_ms": 0.1}
HOPS = {"http_parse_ms": 0.1, "http_decode_ms": 0.2, "to_worker_ms": 0.3, "worker_queue_ms": 0.05,
        "worker_forward_ms": 14.0, "from_worker_ms": 0.25, "server_total_ms": 14.9}


def _record(total, actions=None, hops=True):
    actions = np.zeros((50, 7), np.float32) if actions is None else actions
    return clients.Record(0.1, total - 0.3, 0.2, total, actions, {**STAGES, **(HOPS if hops else {})})


def test_breakdown_splits_a_request_into_the_path_parts():
    parts = clients.breakdown(_record(16.0))
    assert parts["pipeline"] == pytest.approx(13.6) and parts["outside_pipeline"] == pytest.approx(2.4)
    assert parts["worker_other"] == pytest.approx(14.0 - 13.6)
    assert parts["transport"] == pytest.approx(15.7 - 14.9)
    assert parts["client_encode"] == 0.1 and parts["client_decode"] == 0.2
    unpatched = clients.breakdown(_record(16.0, hops=False))
    assert "transport" not in unpatched and unpatched["outside_pipeline"] == pytest.approx(2.4)


def test_summary_row_has_percentiles_tail_ratio_and_accuracy():
    records = [_record(15.0 + 0.1 * i, actions=np.full((50, 7), 1.0 + 0.001 * (i == 3), np.float32))
               for i in range(30)]
    reference = [np.ones((50, 7), np.float32)] * 8
    row = bench_pi05_server.summarize("ext-fast", "openpi", records, reference)
    assert row["requests"] == 30 and row["p50_ms"] == pytest.approx(16.5, abs=0.11)
    assert row["p99_ms"] == pytest.approx(17.9) and row["p99_over_p50"] == pytest.approx(17.9 / row["p50_ms"])
    assert row["max_rel_diff_vs_exact"] == pytest.approx(1e-3, rel=1e-3) and row["checked_requests"] == 30
    assert bench_results.undeclared({"results": [row]}, bench_pi05_server.SCHEMA) == []
    targets = bench_pi05_server.targets([row])
    assert [t[0] for t in targets] == ["ext-fast openpi: client p50 ms", "ext-fast openpi: p50 outside the pipeline ms",
                                       "ext-fast openpi: p99 / p50"]
    assert targets[0][3] == 17.0 and targets[1][3] == 2.5 and targets[2][3] == 1.3


def test_bad_server_or_wire_names_are_refused_with_the_allowed_ones():
    with pytest.raises(SystemExit, match="--servers: ext-slow not allowed; allowed: 0517, ext-no-transport"):
        bench_pi05_server._choices("ext-exact,ext-slow", bench_pi05_server.SERVERS, "servers")


def test_performance_doc_renders_the_server_section_and_its_targets(tmp_path, monkeypatch):
    rows = [bench_pi05_server.summarize("ext-fast", wire, [_record(16.0 + 0.01 * i) for i in range(20)], None)
            for wire in ("openpi", "json")]
    rows.append({"server": "0517", "wire": "sglang", "client": "sglang bench_pi05_openpi.py (openpi_ws)",
                 "requests": 20, "p50_ms": 31.0, "p90_ms": 33.0})
    report = {"run_id": "r1", "device": "NVIDIA H200", "torch": "2.11.0", "sglang": "0.5.17", "kernels": {},
              "attention": "server default", "command": "python3 scripts/bench_pi05_server.py",
              "client_png_encode_ms": 6.0, "settings": {"requests": 20, "warmup": 5},
              "servers": {"ext-exact": {"error": "ServerError: exited"}}, "results": rows}
    bench_results.write(str(tmp_path / "server_pi05.json"), report, bench_pi05_server.SCHEMA)
    doc = tmp_path / "performance.md"
    # main() points the module at --bench-dir / --doc; restored after the test
    monkeypatch.setattr(gen_performance_doc, "BENCH_DIR", gen_performance_doc.BENCH_DIR)
    monkeypatch.setattr(gen_performance_doc, "DOC", gen_performance_doc.DOC)
    assert gen_performance_doc.main(["--bench-dir", str(tmp_path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "## Pi0.5 through the server" in text and "one run (run id r1)" in text
    assert "| ext-fast openpi: client p50 ms | 16.10 | <= 17.00 | met |" in text
    assert "| ext-fast json: client p50 ms | 16.10 | <= 19.00 | met |" in text
    assert "- ext-exact: ServerError: exited" in text and "0517 | sglang | 20 | 31.00" in text
    data = json.loads((tmp_path / "server_pi05.json").read_text())
    data["results"][0]["hand_added"] = 1
    (tmp_path / "server_pi05.json").write_text(json.dumps(data))
    assert "results[].hand_added" in " ".join(bench_results.undeclared(data, bench_pi05_server.SCHEMA))
