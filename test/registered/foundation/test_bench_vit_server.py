"""scripts/bench_vit_server.py's verdicts from a run's numbers (CPU): ratios against graphs-off, the
ceiling, 'below graphs off' beyond graphs-off's own spread, eligible calls replayed, reserved growth,
unequal KV pools."""

from __future__ import annotations

import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=90, suite="base-a-test-cpu")


import bench_results  # noqa: E402
import bench_vit_server  # noqa: E402

MIB = 2**20


def _row(config, c, req_s, completed=100):
    return {"backend": "fa3", "config": config, "concurrency": c, "images": "1", "req_s": req_s, "completed": completed,
            "pass": 0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0}


def _report():
    passes = ([_row("graphs-off", 8, v) for v in (20.0, 24.0, 30.0)] + [_row("ext", 8, v) for v in (19.0, 21.0, 22.0)]
              + [_row("vit-free", 8, v) for v in (30.0, 33.0, 36.0)]
              + [_row("graphs-off", 32, v) for v in (40.0, 41.0, 42.0)] + [_row("ext", 32, v) for v in (37.0, 38.0, 39.0)])
    ext = dict(backend="fa3", config="ext", startup_s=50.0, vit_calls=166, captures_after_start=0, error=None,
               metrics_start={"graph_hits_total": 0, "graph_eager_fallbacks_total": 0, "graph_gate_fallbacks_total": 0},
               metrics_warm={"graph_hits_total": 10, "graph_eager_fallbacks_total": 5, "graph_gate_fallbacks_total": 2,
                             "cuda_memory_reserved_bytes": 1000 * MIB},
               metrics_after_passes={"cuda_memory_reserved_bytes": 1010 * MIB},
               metrics_end={"graph_hits_total": 106, "graph_eager_fallbacks_total": 60, "graph_gate_fallbacks_total": 53,
                            "cuda_memory_reserved_bytes": 1500 * MIB})  # after the accuracy requests
    return {"passes": passes, "servers": [ext, dict(backend="fa3", config="graphs-off", metrics_end={}, startup_s=60.0,
                                                          vit_calls=0, captures_after_start=0, error=None)]}


def test_ratios_are_medians_against_graphs_off_per_slot():
    report = _report()
    assert bench_results.ratios(report) == {("fa3", 8, "1"): pytest.approx(21.0 / 24.0),
                                               ("fa3", 32, "1"): pytest.approx(38.0 / 41.0)}
    assert bench_results.ratios(report, "vit-free") == {("fa3", 8, "1"): pytest.approx(33.0 / 24.0)}


def test_per_pass_ratios_pair_each_pass_with_graphs_off_of_the_same_pass():
    report = _report()
    for i, row in enumerate(report["passes"]):
        row["pass"] = i % 3  # c=8: off 20 / 24 / 30, ext 19 / 21 / 22 in passes 0 / 1 / 2
    assert bench_results.paired_ratios(report) == {("fa3", 8, "1"): pytest.approx(21.0 / 24.0),
                                                      ("fa3", 32, "1"): pytest.approx(38.0 / 41.0)}
    report["passes"][3]["req_s"] = 28.0  # per pass 1.4, 0.875, 0.733: the median of the ratios
    assert bench_results.paired_ratios(report)[("fa3", 8, "1")] == pytest.approx(21.0 / 24.0)
    report["passes"][5]["req_s"] = 36.0  # per pass 1.4, 0.875, 1.2
    assert bench_results.paired_ratios(report)[("fa3", 8, "1")] == pytest.approx(36.0 / 30.0)
    assert bench_results.ratios(report)[("fa3", 8, "1")] == pytest.approx(28.0 / 24.0)
    line = next(x for x in bench_results.vit_server_table(report).splitlines() if " ext " in x and "   8 " in x)
    assert "1.17x" in line and "1.20x" in line


def test_ttft_p99_is_the_median_over_passes_per_slot():
    report = _report()
    for row, p99 in zip([r for r in report["passes"] if r["config"] == "ext" and r["concurrency"] == 8],
                        (300.0, 100.0, 250.0)):
        row["ttft_p99_ms"] = p99
    assert bench_results.ttft_p99(report, "ext") == {("fa3", 8, "1"): 250.0, ("fa3", 32, "1"): 200.0}
    assert bench_results.ttft_p99(report, "upstream-graphs-on") == {}
    import gen_performance_doc  # scripts/, on the path above

    rows = [r for r in gen_performance_doc._vit_server_targets(report) if "TTFT p99" in r]
    assert rows == ["| fa3 c=8 img=1: ext TTFT p99, ms (median over passes), against graphs-off's | 250.0 | <= 200.0 "
                    "| NOT met |",
                    "| fa3 c=32 img=1: ext TTFT p99, ms (median over passes), against graphs-off's | 200.0 | <= 200.0 "
                    "| met |"]


def test_below_graphs_off_only_beyond_its_slowest_pass():
    # c=8: ext's median 21 is above graphs-off's slowest pass (20): noise; c=32: 38 < 40: below
    assert bench_results.below_graphs_off(_report()) == [("fa3", 32, "1")]


def test_eligible_calls_leave_the_gates_eager_calls_out():
    ext, off = _report()["servers"]
    # from the end of the warm-up: 96 hits, 55 fallbacks of which 51 by the gate: 96 of 100 eligible calls
    assert bench_results.eligible_replayed(ext) == pytest.approx(0.96)
    assert bench_results.eligible_replayed(off) is None


def test_reserved_growth_counts_from_the_warm_up_to_the_last_timed_pass():
    report = _report()
    ext, off = report["servers"]
    # the accuracy requests come after the passes: not counted when the passes' reading exists
    report["accuracy"] = [dict(backend="fa3", config="ext", concurrency=1, requests=200, max_abs=0.0, beyond_0_05=0,
                               floor_max_abs=None, error=None)]
    assert bench_results.reserved_growth(report, ext) == (pytest.approx(10.0), 600)
    assert bench_results.reserved_growth(report, off) is None
    assert "+10 (600 req)" in bench_results.vit_server_table(report)


def test_unequal_kv_pools_are_named_and_the_table_warns():
    report = _report()
    assert bench_results.unequal_kv_pools(report) == {}  # runs before the pools were recorded
    ext, off = report["servers"]
    ext["kv_tokens"], off["kv_tokens"] = 131072, 131072
    assert bench_results.unequal_kv_pools(report) == {} and "WARNING" not in bench_results.vit_server_table(report)
    ext["kv_tokens"] = 52000
    assert bench_results.unequal_kv_pools(report) == {"fa3": {"ext": 52000, "graphs-off": 131072}}
    assert "WARNING fa3: the servers' KV pools differ (ext 52000, graphs-off 131072)" in bench_results.vit_server_table(report)


def test_the_table_keeps_configs_an_older_run_named():
    report = _report()
    report["passes"].append(dict(_row("ext-triton-rotary", 8, 25.0)))
    assert "ext-triton-rotary" not in bench_results.VIT_SERVER_CONFIGS
    line = next(x for x in bench_results.vit_server_table(report).splitlines() if "ext-triton-rotary" in x)
    assert "25.00 (25.00-25.00)" in line and "1.04x" in line


def test_reserved_growth_of_a_run_without_timed_passes_counts_the_accuracy_requests():
    report = _report()
    report["passes"] = []
    ext = report["servers"][0]
    ext["metrics_after_passes"] = None  # no timed pass: judged to the end of the run
    report["accuracy"] = [dict(backend=backend, config=name, concurrency=c, requests=200, max_abs=0.0,
                               beyond_0_05=0, floor_max_abs=None, error=error)
                          for backend, name, c, error in (("fa3", "ext", 1, None), ("fa3", "ext", 16, None),
                                                          ("fa3", "ext", 1, "died"), ("fa3", "upstream-graphs-on", 1, None),
                                                          ("triton_attn", "ext", 1, None))]
    assert bench_results.reserved_growth(report, ext) == (pytest.approx(500.0), 400)
    report["accuracy"][1]["samples"] = 3  # three passes at concurrency 16
    assert bench_results.reserved_growth(report, ext) == (pytest.approx(500.0), 800)


def test_graphs_off_counts_its_reference_passes_and_its_floor_passes_where_it_was_the_floor():
    rows = [dict(backend="fa3", config="ext", concurrency=1, requests=100, samples=1, floor_max_abs=None),
            dict(backend="fa3", config="ext", concurrency=16, requests=100, samples=3, floor_max_abs=0.1)]
    assert bench_results.accuracy_requests({"accuracy": rows}, "fa3", "graphs-off") == 100 + 100 * (1 + 3)
    rows[1]["floor_server"] = "graphs-off-2"
    rows.append(dict(backend="fa3", config="graphs-off-2", concurrency=16, requests=100, samples=3,
                     floor_max_abs=0.1, floor_server="graphs-off-2"))
    assert bench_results.accuracy_requests({"accuracy": rows}, "fa3", "graphs-off") == 100 + 100
    assert bench_results.accuracy_requests({"accuracy": rows}, "fa3", "graphs-off-2") == 300
    assert bench_results.accuracy_requests({"accuracy": rows}, "fa3", "ext") == 400


def test_targets_compare_concurrency_16_with_the_floor_of_graphs_off_against_itself():
    import gen_performance_doc  # scripts/, on the path above

    report = _report()
    report["accuracy"] = [
        dict(backend="fa3", config="ext", concurrency=1, requests=200, max_abs=0.0, beyond_0_05=0, floor_max_abs=None,
             error=None),
        dict(backend="fa3", config="ext", concurrency=16, requests=200, max_abs=0.097, beyond_0_05=12,
             floor_max_abs=0.0789, error=None),
        dict(backend="fa3", config="upstream-graphs-on", concurrency=16, requests=200, max_abs=None, beyond_0_05=None,
             floor_max_abs=0.0789, error="died")]
    rows = [r for r in gen_performance_doc._vit_server_targets(report) if "graphs-off" in r and "c=" in r]
    assert "| fa3 c=1: requests beyond 0.05 of graphs-off (layout sizes) | 0 | <= 0 | met |" in rows
    report["config"] = {"accuracy_sizes": "random"}
    assert ("| fa3 c=1: requests beyond 0.05 of graphs-off (random sizes) | 0 | <= 0 | met |"
            in gen_performance_doc._vit_server_targets(report))
    del report["config"]
    assert ("| fa3 c=16: max abs logprob difference from graphs-off (layout sizes), against graphs-off's own "
            "(floor) | 0.0970 | <= 0.0789 | NOT met |") in rows
    report["accuracy"][1]["max_abs"] = 0.05
    assert any("| 0.0500 | <= 0.0789 | met |" in r for r in gen_performance_doc._vit_server_targets(report))
    assert not any("beyond 0.05 of graphs-off (layout sizes), against" in r for r in rows)  # no floor count
    report["accuracy"][1]["floor_beyond_0_05"] = 9
    assert ("| fa3 c=16: requests beyond 0.05 of graphs-off (layout sizes), against graphs-off's own (floor) | 12 "
            "| <= 9 | NOT met |") in gen_performance_doc._vit_server_targets(report)
    report["accuracy"][1].update(samples=3, floor_server="graphs-off-2")
    assert ("| fa3 c=16: requests beyond 0.05 of graphs-off (layout sizes), against graphs-off-2's (floor), largest "
            "of 3 passes each | 12 | <= 9 | NOT met |") in gen_performance_doc._vit_server_targets(report)


def test_a_deterministic_inference_run_is_named_so_in_its_targets_and_notes():
    import gen_performance_doc  # scripts/, on the path above

    report = _report()
    report["accuracy"] = [dict(backend="fa3", config="ext", concurrency=16, requests=200, samples=3, max_abs=0.0,
                               beyond_0_05=0, floor_max_abs=0.0, floor_beyond_0_05=0, floor_server="graphs-off-2")]
    report["config"] = {"command": "python scripts/bench_vit_server.py --accuracy 200"}
    assert not any("deterministic" in r for r in gen_performance_doc._vit_server_targets(report))
    assert not any("deterministic" in n for n in gen_performance_doc._vit_server_notes(report))
    report["config"]["command"] += " --server-arg=--enable-deterministic-inference"
    rows = gen_performance_doc._vit_server_targets(report)
    assert ("| fa3 (deterministic inference) c=16: requests beyond 0.05 of graphs-off (layout sizes), against "
            "graphs-off-2's (floor), largest of 3 passes each | 0 | <= 0 | met |") in rows
    assert all("(deterministic inference)" in r for r in rows[2:] if r)
    assert any("--enable-deterministic-inference" in n for n in gen_performance_doc._vit_server_notes(report))


def test_accuracy_takes_the_stream_it_is_asked_for(monkeypatch):
    asked = []
    monkeypatch.setattr(bench_vit_server, "signatures", lambda server, specs, concurrency: [[0.0]] * len(specs))
    for name in ("random_size_stream", "build_stream"):
        monkeypatch.setattr(f"sglang_ext_testkit.vl_stream.{name}",
                            lambda unit, n, seed, name=name: asked.append(name) or [None] * n)
    bench_vit_server.accuracy({"graphs-off": "off", "ext": "ext"}, "fa3", 28, 2, sizes="layouts")
    bench_vit_server.accuracy({"graphs-off": "off", "ext": "ext"}, "fa3", 28, 2)
    assert asked == ["build_stream", "random_size_stream"]


def test_the_floor_is_graphs_off_against_itself_per_request_and_counts_beyond_0_05(monkeypatch):
    monkeypatch.setattr(bench_vit_server, "BATCHED_SAMPLES", 2)
    same = [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    answers = {  # in the order accuracy() asks: c=1 graphs-off, ext; c=16 graphs-off, graphs-off twice, ext twice
        # the largest max and the largest count come from different passes of each server
        "graphs-off": iter([same, same, [[0.0, 0.06], [1.0, 1.01], [2.0, 2.07]], [[0.0, 0.2], [1.0, 1.0], [2.0, 2.0]]]),
        "ext": iter([same, [[0.0, 0.07], [1.0, 1.06], [2.0, 2.06]], [[0.0, 0.0], [1.0, 1.3], [2.0, 2.0]]])}

    def signatures(server, specs, concurrency):
        return next(answers[server])

    monkeypatch.setattr(bench_vit_server, "signatures", signatures)
    monkeypatch.setattr("sglang_ext_testkit.vl_stream.random_size_stream", lambda unit, n, seed: [None] * 3)
    monkeypatch.setattr("sglang_ext_testkit.vl_stream.build_stream", lambda *a, **k: pytest.fail("not the default"))
    rows = bench_vit_server.accuracy({"graphs-off": "graphs-off", "ext": "ext"}, "fa3", 28, 3)
    by_c = {r["concurrency"]: r for r in rows}
    assert (by_c[1]["max_abs"], by_c[1]["floor_max_abs"], by_c[1]["floor_beyond_0_05"]) == (0.0, None, None)
    assert by_c[1]["samples"] == 1 and by_c[16]["samples"] == 2
    # the largest of each server's passes, apart: ext's max from its second pass, its count from its first
    assert (by_c[16]["max_abs"], by_c[16]["beyond_0_05"]) == (0.3, 3)
    floor = by_c[16]["floor_max_abs"], by_c[16]["floor_beyond_0_05"], by_c[16]["floor_server"]
    assert floor == (0.2, 2, "graphs-off")
    assert not any(answers[name].__length_hint__() for name in answers)  # every pass asked for, none more


def test_a_second_graphs_off_server_gives_the_floor_where_it_runs(monkeypatch):
    monkeypatch.setattr(bench_vit_server, "BATCHED_SAMPLES", 2)
    same = [[0.0, 0.0], [1.0, 1.0]]
    answers = {"graphs-off": iter([same, same]),  # its reference at 1 and 16; graphs-off-2: compared at 1, floor at 16
               "graphs-off-2": iter([same, [[0.0, 0.3], [1.0, 1.0]], same]),
               "ext": iter([same, [[0.0, 0.1], [1.0, 1.0]], same])}
    monkeypatch.setattr(bench_vit_server, "signatures", lambda server, specs, concurrency: next(answers[server]))
    monkeypatch.setattr("sglang_ext_testkit.vl_stream.build_stream", lambda unit, n, seed: [None] * 2)
    servers = {name: name for name in answers}
    rows = bench_vit_server.accuracy(servers, "fa3", 28, 2)
    by_c = {r["concurrency"]: r for r in rows if r["config"] == "ext"}
    floor = by_c[16]["floor_max_abs"], by_c[16]["floor_beyond_0_05"], by_c[16]["floor_server"]
    assert floor == (0.3, 1, "graphs-off-2")
    assert (by_c[16]["max_abs"], by_c[16]["beyond_0_05"]) == (0.1, 1) and by_c[1]["floor_server"] is None
    off_2 = {r["concurrency"]: r for r in rows if r["config"] == "graphs-off-2"}  # compared at 1, the floor at 16
    assert (off_2[1]["max_abs"], off_2[16]["max_abs"], off_2[16]["beyond_0_05"]) == (0.0, 0.3, 1)
    assert not any(answers[name].__length_hint__() for name in answers)


def test_every_server_of_the_run_is_compared_diagnostics_too_in_the_runs_order(monkeypatch):
    monkeypatch.setattr(bench_vit_server, "BATCHED_SAMPLES", 1)
    shifted = {"ext-no-replay": 0.2, "ext": 0.1}
    monkeypatch.setattr(bench_vit_server, "signatures",
                        lambda server, specs, concurrency: [[0.0, shifted.get(server, 0.0)]])
    monkeypatch.setattr("sglang_ext_testkit.vl_stream.build_stream", lambda unit, n, seed: [None])
    rows = bench_vit_server.accuracy({n: n for n in ("graphs-off", "ext-no-replay", "ext")}, "fa3", 28, 1)
    at_16 = [(r["config"], r["max_abs"], r["beyond_0_05"]) for r in rows if r["concurrency"] == 16]
    assert at_16 == [("ext-no-replay", 0.2, 1), ("ext", 0.1, 1)]


def test_a_failing_floor_server_is_named_and_the_others_are_still_compared(monkeypatch):
    monkeypatch.setattr(bench_vit_server, "BATCHED_SAMPLES", 1)
    same = [[0.0, 0.0]]

    def signatures(server, specs, concurrency):
        if server == "graphs-off-2" and concurrency == 16:
            raise RuntimeError("died")
        return same

    monkeypatch.setattr(bench_vit_server, "signatures", signatures)
    monkeypatch.setattr("sglang_ext_testkit.vl_stream.build_stream", lambda unit, n, seed: [None])
    rows = bench_vit_server.accuracy({n: n for n in ("graphs-off", "graphs-off-2", "ext")}, "fa3", 28, 1)
    at_16 = {r["config"]: r for r in rows if r["concurrency"] == 16}
    assert at_16["graphs-off-2"]["error"] == "RuntimeError: died" and at_16["graphs-off-2"]["max_abs"] is None
    assert (at_16["ext"]["max_abs"], at_16["ext"]["floor_max_abs"], at_16["ext"]["error"]) == (0.0, None, None)
    assert "graphs-off-2        16 error: RuntimeError: died" in bench_results.vit_server_table(
        dict(_report(), accuracy=rows))


def test_the_table_names_graphs_off_as_the_floor_of_runs_before_graphs_off_2():
    old = dict(backend="fa3", config="ext", concurrency=16, requests=200, max_abs=0.1, beyond_0_05=5,
               floor_max_abs=0.06, floor_beyond_0_05=None, error=None)  # no samples, no floor_server
    line = bench_results.vit_server_table(dict(_report(), accuracy=[old])).splitlines()[-1]
    assert line.split()[-2:] == ["1", "graphs-off"] and "0.0600" in line


def _dataset_args(seed, num_prompts=8, **more):
    return SimpleNamespace(dataset_name="image", num_prompts=num_prompts, image_count=1, random_image_count=False,
                           seed=seed, image_resolution="random:224x224-896x896", random_input_len=32,
                           random_output_len=8, **more)


def test_a_dataset_under_way_in_another_thread_is_waited_for_not_built_again():
    builds = []

    def make(args, tokenizer, model_id):
        builds.append(args.seed)
        time.sleep(0.3)
        return [f"request of seed {args.seed}"]

    get_dataset = bench_vit_server._one_build_per_key(make)
    prebuild = threading.Thread(target=get_dataset, args=(_dataset_args(1008), None, "m"))
    prebuild.start()
    time.sleep(0.05)  # the timed run asks while the prebuild is still building
    assert get_dataset(_dataset_args(1008), None, "m") == ["request of seed 1008"]
    prebuild.join()
    assert get_dataset(_dataset_args(1032), None, "m") == ["request of seed 1032"]
    assert builds == [1008, 1032]


def test_prebuilt_arguments_are_the_ones_bench_serving_parses_and_nothing_runs(tmp_path):
    serving = bench_vit_server._serving_module(str(tmp_path))
    real = serving.run_benchmark
    argv = bench_vit_server._serving_argv(0, "/models/m", 8, "1-4", 64, 1008, "random:224x224-896x896", os.devnull)
    saved = list(sys.argv)
    args = bench_vit_server._parsed_args(serving, argv)
    assert serving.run_benchmark is real and sys.argv == saved
    assert (args.dataset_name, args.num_prompts, args.seed, args.image_count, args.random_image_count,
            args.max_concurrency, args.tokenizer) == ("image", 64, 1008, 4, True, 8, "/models/m")


class _FakeServing:
    """sglang.benchmark.serving's surface that prebuild_datasets uses; cli_main parses two flags."""

    def __init__(self, reaches_run=True):
        self.reaches_run, self.built = reaches_run, []
        self.get_dataset = bench_vit_server._one_build_per_key(self.make)

    def make(self, args, tokenizer, model_id):
        self.built.append((args.num_prompts, args.seed, model_id, tokenizer))
        return []

    def cli_main(self):
        argv = sys.argv
        if self.reaches_run:
            self.run_benchmark(SimpleNamespace(
                dataset_name="image", num_prompts=int(argv[argv.index("--num-prompts") + 1]),
                seed=int(argv[argv.index("--seed") + 1]), image_count=1, random_image_count=False,
                image_resolution="r", random_input_len=32, random_output_len=8, served_model_name=None,
                model=argv[argv.index("--model") + 1]))

    def run_benchmark(self, args):
        raise AssertionError("a prebuild must not run a benchmark")

    @staticmethod
    def get_tokenizer(model):
        return f"tokenizer of {model}"


def test_prebuild_builds_every_planned_dataset_in_its_thread(monkeypatch, tmp_path):
    fake = _FakeServing()
    monkeypatch.setattr(bench_vit_server, "_serving_module", lambda workdir: fake)
    thread = bench_vit_server.prebuild_datasets("/models/m", [(64, "1-4", 128, 999), (1, "1", 16, 1001)],
                                                str(tmp_path), "r")
    thread.join(timeout=10)
    assert fake.built == [(128, 999, "/models/m", "tokenizer of /models/m"), (16, 1001, "/models/m",
                                                                             "tokenizer of /models/m")]


def test_a_prebuild_that_cannot_parse_builds_nothing_and_raises_nothing(monkeypatch, tmp_path, capsys):
    fake = _FakeServing(reaches_run=False)
    monkeypatch.setattr(bench_vit_server, "_serving_module", lambda workdir: fake)
    bench_vit_server.prebuild_datasets("/models/m", [(8, "1", 64, 1008)], str(tmp_path), "r").join(timeout=10)
    assert fake.built == []
    assert "datasets: not prebuilt: RuntimeError: sglang.bench_serving's cli_main did not reach run_benchmark" in (
        capsys.readouterr().out)


def test_the_trace_plugin_writes_the_reserved_memory_as_a_reading_not_a_sum(monkeypatch, tmp_path):
    import server_trace  # scripts/, on the path above
    import torch

    monkeypatch.setenv("SGX_SERVER_TRACE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(server_trace, "_TOTALS", {})
    for reserved in (100 * MIB, 140 * MIB):
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda reserved=reserved: reserved)
        server_trace._LAST_WRITE[0] = 0.0  # due for a write
        server_trace._drain_events()
    after = server_trace.read_totals(str(tmp_path))
    assert after[server_trace.RESERVED] == [140.0 * MIB, 1]
    assert server_trace.RESERVED not in server_trace.difference(after, {})  # a reading, not a total to difference


def test_the_unpatched_graphs_on_server_counts_upstreams_own_captures(monkeypatch, tmp_path):
    """Capture-count mode wraps only the real ViTCudaGraphRunner.create_graph, writes every capture at once,
    and the bench reads the count as that server's captures; other servers are not counted this way."""
    import server_trace
    from sglang.srt.multimodal import vit_cuda_graph_runner as upstream
    from sglang.srt.managers.scheduler import Scheduler

    monkeypatch.setenv("SGX_SERVER_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("SGX_SERVER_TRACE", "captures")
    monkeypatch.setattr(server_trace, "_TOTALS", {})
    calls = []
    monkeypatch.setattr(upstream.ViTCudaGraphRunner, "create_graph", lambda self, *a, **k: calls.append(a) or len(calls))
    run_batch = Scheduler.run_batch
    server_trace.activate()
    assert Scheduler.run_batch is run_batch  # nothing else wrapped in this mode
    runner = object.__new__(upstream.ViTCudaGraphRunner)
    assert [runner.create_graph(n) for n in (64, 128, 256)] == [1, 2, 3]  # the original's answers
    server = SimpleNamespace(get_text=lambda path: "", capture_dir=str(tmp_path))
    assert bench_vit_server.metrics(server)["graph_captures_total"] == 3.0
    env = lambda name: bench_vit_server.server_env(name, str(tmp_path))  # noqa: E731
    assert env("upstream-graphs-on")["SGX_SERVER_TRACE"] == "captures" and "SGX_SERVER_TRACE_DIR" in env("upstream-graphs-on")
    assert not {"SGX_SERVER_TRACE", "SGX_SERVER_TRACE_DIR"} & (set(env("ext")) | set(env("graphs-off")))


def test_a_server_without_sglang_ext_metrics_reports_reserved_memory_from_its_trace(tmp_path):
    import json

    import server_trace

    (tmp_path / "4242.json").write_text(json.dumps({server_trace.RESERVED: [float(300 * MIB), 1]}))
    server = SimpleNamespace(get_text=lambda path: "# sglang's own metrics, none of sglang-ext's\n",
                             trace_dir=str(tmp_path))
    assert bench_vit_server.metrics(server)["cuda_memory_reserved_bytes"] == 300 * MIB
    server.trace_dir = None  # not traced: no reading
    assert bench_vit_server.metrics(server)["cuda_memory_reserved_bytes"] == 0.0
    ext_text = 'sglang_ext_cuda_memory_reserved_bytes{pid="7"} 104857600.0\n'
    server.get_text = lambda path: ext_text
    assert bench_vit_server.metrics(server)["cuda_memory_reserved_bytes"] == 100 * MIB  # untraced: /metrics
    server.trace_dir = str(tmp_path)
    assert bench_vit_server.metrics(server)["cuda_memory_reserved_bytes"] == 300 * MIB  # traced: the trace, for all


def test_ext_growth_target_names_graphs_off_growth_on_the_same_stream():
    import gen_performance_doc

    report = _report()
    report["servers"][1].update(metrics_warm={"cuda_memory_reserved_bytes": 2000 * MIB},
                                metrics_after_passes={"cuda_memory_reserved_bytes": 2070 * MIB})
    rows = [r for r in gen_performance_doc._vit_server_targets(report) if "reserved memory growth" in r]
    assert rows == ["| fa3: reserved memory growth after warm-up, MiB (600 requests; graphs-off +70 MiB) | 10 | <= 64 "
                    "| met |"]


def test_growth_target_shows_ext_against_graphs_off_at_the_end_and_at_start_up_and_each_later_pass():
    import gen_performance_doc

    report = _report()
    ext, off = report["servers"]
    ext["metrics_start"]["cuda_memory_reserved_bytes"] = 900 * MIB
    ext["reserved_mib_after_pass"] = [1010, 1012, 1012]
    off.update(metrics_start={"cuda_memory_reserved_bytes": 400 * MIB},
               metrics_warm={"cuda_memory_reserved_bytes": 950 * MIB},
               metrics_after_passes={"cuda_memory_reserved_bytes": 950 * MIB})
    assert bench_results.reserved_against(report, ext) == (pytest.approx(60.0), pytest.approx(500.0))
    assert bench_results.reserved_against(report, off, "vit-free") is None  # no such server
    rows = [r for r in gen_performance_doc._vit_server_targets(report) if "reserved memory growth" in r]
    assert rows == ["| fa3: reserved memory growth after warm-up, MiB (600 requests; graphs-off +0 MiB; ext ends "
                    "+60 MiB from graphs-off, +500 at start-up; after each pass +2, +0) | 10 | <= 64 | met |"]


def test_each_pass_adds_the_reserved_memory_to_the_servers_series_and_the_end_of_run_reading_does_not(monkeypatch):
    readings = iter([100 * MIB, 0.0, RuntimeError("down"), 130 * MIB, 190 * MIB])

    def metrics(server):
        value = next(readings)
        if isinstance(value, Exception):
            raise value
        return dict(graph_hits_total=0.0, graph_eager_fallbacks_total=0.0, graph_captures_total=0.0,
                    cuda_memory_reserved_bytes=value)

    monkeypatch.setattr(bench_vit_server, "metrics", metrics)
    live = {"ext": SimpleNamespace()}
    records = {"ext": {"metrics_start": {"graph_captures_total": 0.0}}}
    for _ in range(4):  # a reading, none (untraced: 0), a failed read, a reading
        bench_vit_server.collect_metrics(live, records, after_pass=True)
    bench_vit_server.collect_metrics(live, records)  # after the accuracy requests
    assert records["ext"]["reserved_mib_after_pass"] == [100, None, None, 130]
    assert records["ext"]["metrics_end"]["cuda_memory_reserved_bytes"] == 190 * MIB
    # the key is declared: the run's results file can be written
    assert bench_results.undeclared({"servers": list(records.values())}, bench_results.VIT_SERVER_SCHEMA) == []


def test_ext_against_graphs_off_reads_the_end_of_the_run_without_passes_and_gives_none_for_a_failed_server():
    import gen_performance_doc

    report = _report()
    ext, off = report["servers"]
    ext.pop("metrics_after_passes")
    ext["metrics_start"]["cuda_memory_reserved_bytes"] = 900 * MIB
    ext["reserved_mib_after_pass"] = [1000, None, 1010]
    off.update(metrics_start={"cuda_memory_reserved_bytes": 400 * MIB},
               metrics_end={"cuda_memory_reserved_bytes": 1400 * MIB})
    assert bench_results.reserved_against(report, ext) == (pytest.approx(100.0), pytest.approx(500.0))
    assert any("after each pass ?, ?" in r for r in gen_performance_doc._vit_server_targets(report))
    off["metrics_start"]["cuda_memory_reserved_bytes"] = 0.0  # no reading
    assert bench_results.reserved_against(report, ext) is None
    off["metrics_start"]["cuda_memory_reserved_bytes"] = 400 * MIB
    off["error"] = "metrics: died"  # its last reading is older than ext's
    assert bench_results.reserved_against(report, ext) is None


def test_vit_free_is_not_compared_for_accuracy(monkeypatch):
    monkeypatch.setattr(bench_vit_server, "BATCHED_SAMPLES", 1)
    asked = []

    def signatures(server, specs, concurrency):
        asked.append(server)
        return [[0.0, 0.0]]

    monkeypatch.setattr(bench_vit_server, "signatures", signatures)
    monkeypatch.setattr("sglang_ext_testkit.vl_stream.build_stream", lambda unit, n, seed: [None])
    rows = bench_vit_server.accuracy({n: n for n in ("graphs-off", "vit-free", "ext")}, "fa3", 28, 1)
    assert "vit-free" not in asked and {r["config"] for r in rows} == {"ext"}


def _rows_of_slice(job):
    """A stand-in for bench_vit_server._build_slice in the spawned workers: one row per request."""
    args, workdir = job
    return [(args.seed, i, workdir) for i in range(args.num_prompts)]


def _threads_of_slice(job):
    import torch

    return [(os.environ.get("OMP_NUM_THREADS"), os.environ.get("TOKENIZERS_PARALLELISM"), torch.get_num_threads())]


def test_slice_workers_run_one_thread_each(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # a parent's setting does not reach the workers' libraries
    rows = bench_vit_server.build_in_slices(_dataset_args(1016, 300), str(tmp_path), worker=_threads_of_slice,
                                            workers=2)
    assert rows == [("1", "false", 1)] * 3


def test_a_large_dataset_is_cut_into_seeded_slices_and_built_by_worker_processes_in_order(tmp_path):
    args = _dataset_args(1016, 300)
    slices = bench_vit_server.slice_args(args)
    assert [(s.num_prompts, s.seed) for s in slices] == [(128, 1016000), (128, 1016001), (44, 1016002)]
    assert all(s.image_resolution == args.image_resolution for s in slices) and args.num_prompts == 300
    rows = bench_vit_server.build_in_slices(args, str(tmp_path), worker=_rows_of_slice, workers=2)
    assert rows == [(1016000 + k, i, str(tmp_path)) for k, n in enumerate((128, 128, 44)) for i in range(n)]


def test_only_a_dataset_above_the_parallel_threshold_goes_to_the_slice_build():
    made, sliced = [], []
    get_dataset = bench_vit_server._one_build_per_key(lambda args, tok, m: made.append(args.num_prompts) or ["in"],
                                                      lambda args: sliced.append(args.num_prompts) or ["sliced"])
    small = _dataset_args(1, bench_vit_server.PARALLEL_FROM)
    large = _dataset_args(1, bench_vit_server.PARALLEL_FROM + 1)
    assert get_dataset(small, None, "m") == ["in"] and get_dataset(large, None, "m") == ["sliced"]
    assert get_dataset(large, None, "m") == ["sliced"]  # cached, not rebuilt
    assert (made, sliced) == ([bench_vit_server.PARALLEL_FROM], [bench_vit_server.PARALLEL_FROM + 1])


def test_a_slice_worker_builds_with_the_tokenizer_and_model_its_arguments_name(monkeypatch, tmp_path):
    fake = _FakeServing()
    monkeypatch.setattr(bench_vit_server, "_serving_module", lambda workdir: fake)
    args = _dataset_args(7, tokenizer="/models/t", model="/models/m", served_model_name=None)
    assert bench_vit_server._build_slice((args, str(tmp_path))) == []
    assert fake.built == [(8, 7, "/models/m", "tokenizer of /models/t")]


def test_the_unpatched_graphs_on_server_keeps_its_place_under_its_name_before_the_rename():
    """Runs written before the release-neutral names call it 0517-graphs-on: shown as written, in the same row."""
    order = []
    for name in ("upstream-graphs-on", "0517-graphs-on"):
        report = _report()
        report["passes"] += [_row(name, 8, 26.0), _row("ext-no-replay", 8, 20.0), _row("graphs-off-2", 8, 23.0)]
        rows = [x.split()[3] for x in bench_results.vit_server_table(report).splitlines() if "   8 " in x]
        order.append([r.replace(name, "UNPATCHED") for r in rows])
    assert order[0] == order[1] == ["ext", "graphs-off", "graphs-off-2", "UNPATCHED", "ext-no-replay", "vit-free"]


def test_a_kept_run_on_another_release_gets_its_own_section_with_its_kernels(tmp_path, monkeypatch):
    """vit_server.json is 0.5.17; a kept 0.5.23 run renders in full under its release, naming 0.5.17's kernels
    and the stand-ins it ran with; kept 0.5.17 runs stay one line each."""
    import json

    import gen_performance_doc  # scripts/, on the path above

    def run(release, run_id):
        report = _report()
        report.update(run_id=run_id, kernels={"sgl_kernel": "0.4.5", "flashinfer": "0.6.15.post1"}, attention="fa3",
                      accuracy=[], config={"sglang": release, "model": "qwen2_5_vl real-scale random",
                                           "requests": 64, "command": f"bench {release}"})
        report["passes"].append(_row("upstream-graphs-on", 8, 26.0))
        if release == "0.5.23":
            report["config"]["stand_ins"] = ["cutlass", "imageio_ffmpeg"]
        return report

    for name, release, run_id in (("vit_server.json", "0.5.17", "r1"), ("vit_server_old.json", "0.5.17", "r0"),
                                  ("vit_server_sglang_0523.json", "0.5.23", "r2")):
        (tmp_path / name).write_text(json.dumps(run(release, run_id)))
    monkeypatch.setattr(gen_performance_doc, "BENCH_DIR", str(tmp_path))
    text = gen_performance_doc._vit_server_section()
    own = text.split("### On sglang 0.5.23: `docs/bench/vit_server_sglang_0523.json`")[1].split("### Other runs")[0]
    assert "Release: sglang 0.5.23's Python; the kernels were 0.5.17's sgl-kernel 0.4.5" in own
    assert "stand-ins, imported and never called on this device: cutlass, imageio_ffmpeg" in own
    assert "upstream-graphs-on" in own and "Command: `bench 0.5.23`" in own
    others = text.split("### Other runs")[1]
    assert "- fa3: `vit_server_old.json`" in others and "vit_server_sglang_0523.json" not in others


def test_an_accuracy_only_run_is_described_as_such():
    import gen_performance_doc  # scripts/, on the path above

    report = _report()
    report["config"] = {"requests": 64}
    assert {r["pass"] for r in report["passes"]} == {0}
    assert gen_performance_doc._passes_line(report) == "1 pass of 64 requests."
    report["passes"][0]["pass"] = 1
    assert gen_performance_doc._passes_line(report) == "2 passes of 64 requests."
    report["passes"] = []
    assert gen_performance_doc._passes_line(report) == "no timed pass (accuracy only)."


def test_only_a_run_with_timed_passes_warms_up_first():
    assert bench_vit_server.warm_up_slot(3, [1, 8, 64], ["1", "1-4"]) == (64, "1-4", 128, 999)
    assert bench_vit_server.warm_up_slot(3, [1, 8], ["1"]) == (8, "1", 64, 999)
    assert bench_vit_server.warm_up_slot(0, [1, 8, 64], ["1", "1-4"]) is None


def test_a_range_of_image_counts_runs_only_at_the_mixed_at_concurrencies():
    assert bench_vit_server.timed_slots([1, 8, 32], ["1", "1-4"], {8}, 64) == [
        (1, "1", 16, 1001), (8, "1", 64, 1008), (8, "1-4", 64, 1008), (32, "1", 64, 1032)]
    assert bench_vit_server.timed_slots([1, 32], ["1", "1-4"], {8}, 64) == [(1, "1", 16, 1001), (32, "1", 64, 1032)]


def test_a_run_where_nothing_would_be_timed_or_an_unknown_configuration_is_refused_before_anything_starts(capsys):
    never = ["--model-dir", "/nonexistent/never-built"]
    with pytest.raises(SystemExit) as stop:
        bench_vit_server.main(["--concurrencies", "16", "--image-counts", "1-4", "--mixed-at", "8"] + never)
    assert stop.value.code == 2
    assert ("--image-counts 1-4: nothing runs; a range like 1-4 runs only at the --mixed-at concurrencies (8), none "
            "of which is in --concurrencies (16)") in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        bench_vit_server.main(["--configs", "graphs-off,ext-idle-split"] + never)
    assert stop.value.code == 2 and "--configs: 'graphs-off,ext-idle-split'; allowed: names from ext, graphs-off" in (
        capsys.readouterr().err)


def test_the_slice_build_runs_sglangs_image_dataset_in_spawned_workers(tmp_path):
    """Real sglang 0.5.17 bench_serving on a tiny Qwen2.5-VL: the slices come back whole and in order, each the
    dataset an in-process build of its arguments makes."""
    from sglang_ext_testkit import tiny_model

    model = str(tmp_path / "tiny")
    tiny_model.ensure_tiny_model("qwen2_5_vl", model, seed=0, force=True)
    serving = bench_vit_server._serving_module(str(tmp_path))
    argv = bench_vit_server._serving_argv(0, model, 8, "1-2", 300, 1008, "random:224x224-256x256", os.devnull)
    args = bench_vit_server._parsed_args(serving, argv)
    rows = bench_vit_server.build_in_slices(args, str(tmp_path), workers=2)
    assert len(rows) == 300 and all(r.image_data and r.vision_prompt_len > 0 for r in rows)
    first, second = bench_vit_server.slice_args(args)[:2]
    tokenizer = serving.get_tokenizer(model)
    want = [r.image_data for r in serving.get_dataset(first, tokenizer, model)]
    assert [r.image_data for r in rows[:128]] == want
    assert [r.image_data for r in rows[128:256]] != want  # another seed
