"""scripts/bench_pi05.py plumbing on the CPU: accuracy, saved reference actions, weights that do not
depend on projection packing, the graph-fast skip, the table and docs/performance.md's Pi0.5 parts,
and gpu_steps.sh's bench-pi05 sequence."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

import bench_pi05  # noqa: E402
import bench_results  # noqa: E402
import gen_performance_doc  # noqa: E402
from sglang_ext_testkit import pi05_random  # noqa: E402


def _actions(seed: int, n: int = 3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 50, 32, generator=generator) for _ in range(n)]


def test_accuracy_reports_the_worst_request_by_both_measures():
    reference = _actions(0)
    actions = [r.clone() for r in reference]
    scale = float(reference[1].abs().max())
    actions[1][0, 3, 5] += 0.02 * scale  # one element off by 2 % of the reference's largest value
    actions[2] = -reference[2]  # sign flip: cosine -1, difference twice the largest value
    out = bench_pi05.accuracy(actions, reference)
    assert out["requests"] == 3
    assert out["max_rel_diff"] == pytest.approx(2.0, rel=1e-6)
    assert out["min_cosine"] == pytest.approx(-1.0, abs=1e-12)
    only_small = bench_pi05.accuracy(actions[:2], reference[:2])
    assert only_small["max_rel_diff"] == pytest.approx(0.02, rel=1e-3)
    expected_cos = float(torch.nn.functional.cosine_similarity(
        actions[1].double().reshape(1, -1), reference[1].double().reshape(1, -1)))
    assert only_small["min_cosine"] == pytest.approx(expected_cos, abs=1e-12) and expected_cos < 1.0
    assert bench_pi05.accuracy(reference, reference) == {"requests": 3, "max_rel_diff": 0.0, "min_cosine": 1.0}
    with pytest.raises(ValueError, match="2 requests against 3"):
        bench_pi05.accuracy(actions[:2], reference)


def test_cosine_edges():
    x = torch.tensor([1.0, 2.0, -3.0])
    assert pi05_random.cosine(x, x) == 1.0
    assert pi05_random.cosine(x, torch.tensor([2.0, -1.0, 0.0])) == 0.0
    assert pi05_random.cosine(torch.zeros(3), torch.zeros(3)) == 1.0
    assert pi05_random.cosine(torch.zeros(3), x) == 0.0


def _args(**overrides):
    argv = ["--impl", "0517-ext", "--requests", "5", "--prompt-lens", "18,23", *overrides.pop("argv", [])]
    old = sys.argv
    sys.argv = ["bench_pi05.py", *argv]
    try:
        return bench_pi05.parse_args()
    finally:
        sys.argv = old


def _inputs(args):
    return [((layout, n), None, None) for layout in args.layouts for n in args.prompt_lens]


def test_saved_actions_compare_request_by_request_only_for_the_same_inputs_and_weights(tmp_path):
    args = _args()
    keys = bench_pi05.timed_keys(_inputs(args), args)
    assert keys == ["full/18", "full/23", "masked/18", "masked/23", "full/18"]
    signature = bench_pi05.inputs_signature(args)
    digest = [10, 1.5, 7.25]
    saved_actions = _actions(1, n=5)
    path = str(tmp_path / "sub" / "ref.pt")
    bench_pi05.save_actions(path, impl="0517", mode="eager", version="0.5.17", signature=signature, keys=keys,
                            digest=digest, actions=saved_actions)
    record, reason = bench_pi05.load_actions(path, signature=signature, keys=keys, digest=digest)
    assert reason == "" and record["impl"] == "0517" and record["run_id"] == bench_results.RUN_ID
    assert all(torch.equal(a, b) for a, b in zip(record["actions"], saved_actions))

    here = [a.clone() for a in saved_actions]
    here[4][0, 0, 0] += 0.5
    timed = {"eager": [a.clone() for a in saved_actions]}
    out = bench_pi05.compare("graph-fast", here, timed, (record, ""))
    expected = 0.5 / float(saved_actions[4].abs().max())
    assert out["vs_saved"]["reference"] == f"0517 eager (run id {bench_results.RUN_ID})"
    assert out["vs_saved"]["max_rel_diff"] == pytest.approx(expected, rel=1e-6)
    assert out["vs_eager"]["max_rel_diff"] == pytest.approx(expected, rel=1e-6)
    assert "vs_graph" not in out  # no graph mode ran
    assert "vs_eager" not in bench_pi05.compare("eager", here, timed, None)

    other = _args(argv=["--num-steps", "5"])
    _, reason = bench_pi05.load_actions(path, signature=bench_pi05.inputs_signature(other), keys=keys, digest=digest)
    assert "inputs differ: num_steps saved 10, here 5" in reason
    _, reason = bench_pi05.load_actions(path, signature=signature, keys=list(reversed(keys)), digest=digest)
    assert "not this run's requests" in reason
    _, reason = bench_pi05.load_actions(path, signature=signature, keys=keys, digest=[10, 1.5, 7.5])
    assert "weights differ" in reason
    _, reason = bench_pi05.load_actions(str(tmp_path / "absent.pt"), signature=signature, keys=keys, digest=digest)
    assert "no such file" in reason
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    _, reason = bench_pi05.load_actions(str(tmp_path / "junk.pt"), signature=signature, keys=keys, digest=digest)
    assert "unreadable" in reason
    skipped = bench_pi05.compare("graph", here, timed, (None, reason))
    assert skipped["vs_saved"] == {"skipped": reason}


def test_random_weights_do_not_depend_on_projection_packing():
    """0.5.17 keeps q/k/v and gate/up separate, sglang-ext packs them: both must get the same weights,
    or actions of two processes cannot be compared. Real layers: sglang's ReplicatedLinear and ours."""
    from sglang.multimodal_gen.runtime.layers.linear import ReplicatedLinear
    from sglang.multimodal_gen.runtime.models.vlas.pi05_policy import Pi05PolicyModel

    from sglang_ext.pi05.merged_linear import MergedReplicatedLinear

    def layer(packed: bool) -> torch.nn.Module:
        root, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        if packed:
            attn.qkv_proj = MergedReplicatedLinear(16, [8, 4, 4], bias=False, params_dtype=torch.float32)
            mlp.gate_up_proj = MergedReplicatedLinear(16, [24, 24], bias=False, params_dtype=torch.float32)
        else:
            for name, rows in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4)):
                setattr(attn, name, ReplicatedLinear(16, rows, bias=False, params_dtype=torch.float32))
            for name in ("gate_proj", "up_proj"):
                setattr(mlp, name, ReplicatedLinear(16, 24, bias=False, params_dtype=torch.float32))
        attn.o_proj = ReplicatedLinear(16, 16, bias=True, params_dtype=torch.float32)
        root.layers = torch.nn.ModuleList([torch.nn.Module()])
        root.layers[0].self_attn, root.layers[0].mlp = attn, mlp
        return root

    mappings = Pi05PolicyModel._FUSED_WEIGHT_MAPPINGS
    separate, packed = layer(False), layer(True)
    pi05_random._random_fill(separate, 7, 0.02, mappings)
    pi05_random._random_fill(packed, 7, 0.02, mappings)
    s_attn, p_attn = separate.layers[0].self_attn, packed.layers[0].self_attn
    assert torch.equal(p_attn.qkv_proj.weight,
                       torch.cat([s_attn.q_proj.weight, s_attn.k_proj.weight, s_attn.v_proj.weight]))
    s_mlp = separate.layers[0].mlp
    assert torch.equal(packed.layers[0].mlp.gate_up_proj.weight,
                       torch.cat([s_mlp.gate_proj.weight, s_mlp.up_proj.weight]))
    assert torch.equal(p_attn.o_proj.weight, s_attn.o_proj.weight) and not p_attn.o_proj.bias.any()
    assert not torch.equal(s_attn.q_proj.weight[:4], s_attn.k_proj.weight)  # each tensor its own stream
    a, b = pi05_random.weights_digest(separate), pi05_random.weights_digest(packed)
    assert a[0] == b[0] == 16 * 16 * 2 + 48 * 16 + 16 and a[1:] == pytest.approx(b[1:], rel=1e-12)
    other = layer(False)
    pi05_random._random_fill(other, 8, 0.02, mappings)
    assert pi05_random.weights_digest(other)[2] != pytest.approx(a[2], rel=1e-9)


def test_graph_fast_is_skipped_with_a_reason_where_the_tree_lacks_it(monkeypatch):
    import importlib.util

    from sglang_ext import knobs

    assert bench_pi05.unavailable("0517-ext", "graph-fused") == ""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "no package sglang_ext.kernels" in bench_pi05.unavailable("0517-ext", "graph-fast")
    assert "no package sglang_ext.kernels" in bench_pi05.unavailable("0517-ext", "graph-fast-nopdl")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert bench_pi05.unavailable("0517-ext", "graph-fast") == ""
    monkeypatch.setattr(knobs, "KNOBS", tuple(k for k in knobs.KNOBS if k.name != "pi05_fast"))
    assert "knob pi05_fast" in bench_pi05.unavailable("0517-ext", "graph-fast")
    row = bench_pi05.run_or_report(None, "0517-ext", "graph-fast", [], None, {}, None)
    assert row == {"impl": "0517-ext", "mode": "graph-fast",
                   "skipped": "knob pi05_fast is not in this tree's sglang_ext.knobs"}


def test_a_failing_mode_becomes_a_row_and_the_bench_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(bench_pi05, "run_mode", broken)
    row = bench_pi05.run_or_report(None, "0517", "graph", [], None, {}, None)
    assert row == {"impl": "0517", "mode": "graph", "error": "RuntimeError: capture failed"}


def _row(mode, p50, **extra):
    return {"impl": "0517-ext", "mode": mode, "requests": 32, "p50_ms": p50, "p90_ms": p50 + 1, "mean_ms": p50,
            "min_ms": p50, "warmup_s": 1.0, "peak_allocated_mib": 7000.0, "graph_pool_growth_mib": 10.0,
            **extra}


def _fast_row(p50, rel, cos):
    acc = {"reference": "0517 eager (run id r1)", "requests": 32, "max_rel_diff": rel, "min_cosine": cos}
    return _row("graph-fast", p50, prefix_p50_ms=5.0, denoise_p50_ms=p50 - 5.0,
                attention_kernels_per_request={"pytorch_flash::flash_fwd_kernel": 63.0},
                accuracy={"vs_graph": {**acc, "reference": "this process's graph"}, "vs_saved": acc})


def test_table_shows_phases_accuracy_and_why_a_mode_is_missing(capsys):
    rows = [_row("eager", 190.0), _fast_row(14.0, 4e-3, 0.99995),
            {"impl": "0517-ext", "mode": "graph-bucket", "error": "RuntimeError: boom"},
            _row("graph-fused", 30.0, accuracy={"vs_saved": {"skipped": "--compare-actions x: no such file"}})]
    bench_results.print_pi05_table(rows)
    out = capsys.readouterr().out
    fast = next(line for line in out.splitlines() if "graph-fast" in line and "|" in line)
    cells = [c.strip() for c in fast.split("|")]
    assert cells[2:6] == ["14.0", "15.0", "5.0", "9.0"]
    assert cells[-3:] == ["-", "4.0e-03/0.999950", "4.0e-03/0.999950"]
    assert "0517-ext graph-bucket: FAILED: RuntimeError: boom" in out
    assert "0517-ext graph-fused: vs saved skipped: --compare-actions x: no such file" in out
    assert "vs saved = 0517 eager (run id r1): 0517-ext graph-fast" in out
    report = {"run_id": "r1", "impl": "0517-ext", "kernels": {"sgl_kernel": "0.4.5", "sgl_kernel_ops": "real",
              "fa3": "not available", "custom_ops": "dispatch"}, "attention_ran": {"requested": "torch_sdpa",
              "modules": {"torch_sdpa:sdpaimpl": 2}, "calls_per_request": {"unmasked: torch_sdpa:sdpaimpl": 3}},
              "results": rows}
    assert bench_results.undeclared(report, bench_results.PI05_SCHEMA) == []


def _write_run(directory, impl, run_id, results):
    record = {"run_id": run_id, "impl": impl, "sglang": "0.5.17", "device": "NVIDIA H200", "torch": "2.11",
              "attention": "torch_sdpa requested", "command": f"python3 scripts/bench_pi05.py --impl {impl}",
              "kernels": {"sgl_kernel": "0.4.5"}, "settings": {"requests": 32}, "results": results}
    bench_results.write(str(directory / f"pi05_{impl}.json"), record, bench_results.PI05_SCHEMA)


@pytest.mark.parametrize("p50,rel,cos,verdicts", [(14.0, 4e-3, 0.99995, ["met"] * 5),
                                                  (16.0, 2e-2, 0.999, ["NOT met"] * 5)])
def test_performance_doc_checks_the_fast_targets_and_says_one_run_only_for_one_run_id(tmp_path, monkeypatch, p50,
                                                                                     rel, cos, verdicts):
    for name in ("BENCH_DIR", "DOC"):  # main() points them at its arguments; restored after the test
        monkeypatch.setattr(gen_performance_doc, name, getattr(gen_performance_doc, name))
    _write_run(tmp_path, "0517", "r1", [{**_row("eager", 260.0), "impl": "0517"}])
    _write_run(tmp_path, "0517-ext", "r1", [_row("eager", 190.0), _fast_row(p50, rel, cos)])
    doc = tmp_path / "performance.md"
    assert gen_performance_doc.main(["--bench-dir", str(tmp_path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    fast_rows = [line for line in text.splitlines() if line.startswith("| graph-fast")]
    assert [line.rsplit("|", 2)[-2].strip() for line in fast_rows] == verdicts
    assert "Runs: one run (run id r1)." in text and "One process per implementation (0517, 0517-ext)" in text
    assert "python3 scripts/bench_pi05.py --impl 0517-ext" in text
    assert "- 0517-ext graph-fast: `pytorch_flash::flash_fwd_kernel` x63" in text
    _write_run(tmp_path, "0517", "r0", [{**_row("eager", 260.0), "impl": "0517"}])
    assert gen_performance_doc.main(["--bench-dir", str(tmp_path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "not shown to be one run: 0517: run r0; 0517-ext: run r1" in text and "One process per" not in text


def test_kernel_table_from_the_run_without_pdl_targets_and_a_headline_of_the_default(tmp_path, monkeypatch):
    for name in ("BENCH_DIR", "DOC"):  # main() points them at its arguments; restored after the test
        monkeypatch.setattr(gen_performance_doc, name, getattr(gen_performance_doc, name))
    kernels = {"_skinny_gemm_kernel": [560.0, 3000.0], "_ada_rms_norm_kernel": [405.0, 1000.0]}
    pdl = _row("graph-fast", 14.0, top_kernels_per_request=kernels, kernel_time_ms_per_request=18.0,
               device_kernels_per_request=2088.0)
    _write_run(tmp_path, "0517", "r1", [{**_row("eager", 260.0), "impl": "0517"}])
    _write_run(tmp_path, "0517-ext", "r1", [_row("eager", 190.0), pdl])
    doc = tmp_path / "performance.md"
    assert gen_performance_doc.main(["--bench-dir", str(tmp_path), "--doc", str(doc)]) == 0
    assert "Where the fast path's device time goes" not in doc.read_text()  # PDL-inflated times: no table
    nopdl = {**pdl, "mode": "graph-fast-nopdl", "p50_ms": 13.0, "kernel_time_ms_per_request": 8.0}
    _write_run(tmp_path, "0517-ext", "r1", [_row("eager", 190.0), pdl, nopdl])
    assert gen_performance_doc.main(["--bench-dir", str(tmp_path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "graph-fast-nopdl: p50 13.0 ms; per request 2088 kernels, 8.00 ms of kernel time" in text
    row = next(line for line in text.splitlines() if line.startswith("_skinny_gemm_kernel"))
    assert row.split()[1:] == ["560.0", "3000.0", "37.5%"]
    assert "| bf16 fast path (graph-fast) p50 ms | 14.0 | <= 11.0 | NOT met |" in text
    fp8 = {**_row("graph-fast-fp8", 7.5), "accuracy": {"vs_graph": {"reference": "this process's graph",
                                                                     "requests": 32, "max_rel_diff": 0.02,
                                                                     "min_cosine": 0.9995}}}
    _write_run(tmp_path, "0517-ext", "r1", [_row("eager", 190.0), pdl, nopdl, fp8])
    assert gen_performance_doc.main(["--bench-dir", str(tmp_path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| FP8 mode (graph-fast-fp8) p50 ms | 7.5 | <= 8.0 | met |" in text
    assert "| FP8 mode min cosine vs the exact graph path, 32 requests | 0.999500 | >= 0.999000 | met |" in text
    monkeypatch.setattr(gen_performance_doc, "BENCH_DIR", str(tmp_path))  # neither diagnostic nor opt-in FP8 leads
    assert "14.0 ms (`--ext-pi05-fast`)" in gen_performance_doc._pi05_headline()


def test_kernels_split_by_phase_marks_and_the_phase_table_charges_each_class_its_work():
    """The profile's marker kernels (three per request) split the device events into prefix and denoise:
    kernels by class, copies, and the idle gaps between them (short: launches, long: the host); the table
    charges GEMMs the matrix FLOPs and weights, attention its FLOPs and the K/V, and shows the rest."""
    import pi05_roofline

    mark = "spin_kernel(long)"
    # (start, end, name) in us: prefix from 2 to 600, denoise from 602 to 1000
    events = [(0, 2, mark), (40, 140, "Memcpy HtoD (Pageable -> Device)"), (141, 541, "nvjet_sm90_tst_128x272"),
              (543, 593, "_add_layer_norm_kernel"), (593, 600, "cudnn_generated_fort_native_sdpa"), (600, 602, mark),
              (603, 903, "_skinny_gemm_kernel"), (890, 970, "_split_attention_kernel"),  # overlaps (PDL)
              (971, 991, "_combine_kernel"), (992, 997, "triton_poi_fused_add"), (998, 1000, mark)]
    second = [(t + 2000, e + 2000, name) for t, e, name in events]  # a second request: per request = the mean
    phases = bench_pi05.phase_kernels(second[::-1] + events, requests=2)  # ordered by start, not by arrival
    assert phases == {
        "prefix": {"idle >= 10 us": [1.0, 38.0], "copy": [1.0, 100.0], "idle < 10 us": [2.0, 3.0],
                   "gemm": [1.0, 400.0], "norm": [1.0, 50.0], "attention": [1.0, 7.0]},
        "denoise": {"idle < 10 us": [4.0, 4.0], "gemm": [1.0, 300.0], "attention": [2.0, 100.0],
                    "other": [1.0, 5.0]}}
    assert bench_pi05.phase_kernels(events[1:], requests=1) == {}  # a missing mark: no split at all
    work = {"peak_tflops": 1000.0, "peak_tb_s": 5.0,
            "prefix": {"tflop": 2.1, "matrix_tflop": 2.0, "attention_tflop": 0.1, "gb": 4.0, "kv_gb": 0.0},
            "denoise": {"tflop": 0.3, "matrix_tflop": 0.3, "attention_tflop": 0.0, "gb": 1.5, "kv_gb": 0.5}}
    table = pi05_roofline.phase_table(work, {"phase_kernels_per_request": phases, "prefix_p50_ms": 0.6,
                                             "denoise_p50_ms": 0.4})
    lines = table.splitlines()[1:]
    rows = {(line[:8].strip(), line[9:24].strip()): line[24:].split() for line in lines}
    assert [label for phase, label in rows if phase == "prefix"] == [
        "gemm", "norm", "attention", "copy", "idle >= 10 us", "idle < 10 us", "rest"]  # kernels, copies, idle
    assert rows[("prefix", "gemm")] == ["1.0", "0.40", "66.7%", "5000", "500.0%", "10000", "200.0%"]
    assert rows[("denoise", "gemm")][5] == "3333"  # 1.0 GB of weights (the K/V charged to attention) in 0.3 ms
    assert rows[("denoise", "attention")][5:7] == ["5000", "100.0%"]  # 0.5 GB of K/V in 0.1 ms
    assert rows[("prefix", "norm")] == ["1.0", "0.05", "8.3%"]  # no counted work: no rate
    assert float(rows[("prefix", "rest")][0]) == pytest.approx(0.6 - 0.598, abs=0.006)
    assert float(rows[("denoise", "rest")][0]) == pytest.approx(0.4 - 0.409, abs=0.006)  # PDL overlap: below 0


def test_committed_pi05_results_still_pass_the_schema():
    """Files written by the older script (no accuracy, phases, attention record) stay valid."""
    import glob

    assert os.path.samefile(gen_performance_doc.BENCH_DIR, os.path.join(REPO, "docs", "bench"))
    assert glob.glob(os.path.join(gen_performance_doc.BENCH_DIR, "pi05_*.json"))
    assert [p for p in gen_performance_doc.schema_problems() if "pi05" in p] == []


def test_gpu_step_runs_every_implementation_even_after_failures(tmp_path):
    """bench-pi05 with a stand-in python3 that logs its arguments and fails for 0.5.17: the 0.5.19
    process (its environment cannot be set up here) and the sglang-ext process still run, in order,
    with the reference file and one run id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    (bin_dir / "python3").write_text(
        "#!/bin/bash\n"
        f'echo "$SGX_BENCH_RUN_ID $*" >> {log}\n'
        f'[ -f "{tmp_path}/out/bench-pi05.log" ] && touch {tmp_path}/log-seen-mid-run\n'
        'case "$*" in *"--impl 0517 "*) exit 1 ;; esac\n'
        "exit 0\n")
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    repo = tmp_path / "repo"  # the two scripts alone: no .carry/ for gpu_env.sh to unpack
    (repo / "scripts").mkdir(parents=True)
    for name in ("gpu_steps.sh", "gpu_env.sh"):
        shutil.copy(os.path.join(REPO, "scripts", name), repo / "scripts" / name)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "SGX_STEP_STAGGER": "0",
           "SGX_ROOT": str(tmp_path / "sgx"), "SGX_BENCH_RUN_ID": "r42"}
    done = subprocess.run(["bash", str(repo / "scripts" / "gpu_steps.sh"), "bench-pi05"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    impls = [c.split("--impl ")[1].split()[0] for c in calls if "--impl" in c]
    assert impls == ["0517", "0517-ext"], calls  # 0.5.19's environment failed before its process
    assert all(c.startswith("r42 ") for c in calls)
    assert "--save-actions" in calls[0] and "pi05_0517_eager_actions.pt" in calls[0] and "--requests 32" in calls[0]
    assert "--compare-actions" in calls[1] and "graph-fast" in calls[1]
    assert "gen_performance_doc.py --bench-dir" in calls[2]
    assert "rc=1" in done.stdout and "0517-ext rc=0" in done.stdout and "0519 rc=" in done.stdout
    assert (out / "bench-pi05.tgz").exists()
    assert (tmp_path / "log-seen-mid-run").exists()  # the step's log is in $OUT while it runs, not only after
    assert "step bench-pi05 rc=0" in (out / "bench-pi05.log").read_text()
