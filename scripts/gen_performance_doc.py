#!/usr/bin/env python3
"""Write docs/performance.md from the benchmark results in docs/bench/*.json.

The numbers come only from the JSON the benchmark scripts wrote (never typed in):
    scripts/bench_pi05.py        -> docs/bench/pi05_<impl>.json  (GPU; one file per implementation)
    scripts/bench_vit.py         -> docs/bench/vit.json          (GPU)
    scripts/bench_vit_server.py  -> docs/bench/vit_server.json   (GPU, real launch_server processes)
    scripts/bench_prefill_cp.py  -> docs/bench/prefill_cp.json   (CPU)
    scripts/bench_pi05_server.py -> docs/bench/server_pi05.json  (GPU; Pi0.5 through the server)
Each table is rendered by the benchmark script's own table function, so the doc
and the script's console output agree, and says which kernels and attention backend
ran and whether its rows come from one run (the `run_id`, `kernels` and `attention`
the scripts record; "not recorded" where a file predates them). `--check` fails when
the doc is stale or when a results file carries keys its script's SCHEMA lacks (a
hand edit); the doc marks such a file as pending regeneration.

It also writes README.md's "what you get" lines (between `<!-- what-you-get:begin -->` and
`<!-- what-you-get:end -->`): a few headline numbers from the same files, each linking its
table here, so the README never carries a typed-in measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO, "docs", "bench")
DOC = os.path.join(REPO, "docs", "performance.md")
COMMITTED = (BENCH_DIR, DOC)  # main() repoints BENCH_DIR / DOC; these stay what the repository holds
README = os.path.join(REPO, "README.md")
README_BEGIN, README_END = "<!-- what-you-get:begin -->", "<!-- what-you-get:end -->"
PI05_HEADING = "Pi0.5 latency (`scripts/bench_pi05.py`)"
PI05_SERVER_HEADING = "Pi0.5 through the server (`scripts/bench_pi05_server.py`)"
VIT_HEADING = "ViT graphs (`scripts/bench_vit.py`)"
VIT_SERVER_HEADING = "ViT graphs in the server (`scripts/bench_vit_server.py`)"
CP_HEADING = "Prefill context-parallel bucket choice (`scripts/bench_prefill_cp.py`)"

import bench_results  # noqa: E402

PI05_MEANING = """\
One request at a time, 10 denoise steps, LIBERO-like inputs (two 224x224 cameras, state 8,
horizon 50, action dim 32), full and masked (empty second camera) prefixes, prompts of mixed
lengths, random weights at the real size (3.35 B parameters, bf16). p50/p90: wall-clock
latency per request after warm-up. launches/req: CUDA kernel launch API calls per request
(torch.profiler; graph replays count as graph launches instead). kernels/req and kernel
ms/req: device kernels executed and their summed time. peak MiB: peak allocated memory.
pool +MiB: growth of reserved memory while graph modes ran (graph intermediates included).
graph buf MiB: static buffers of the resident graphs, as sglang-ext's bounded caches count them
(upstream's caches do not report it). prefix / denoise ms: p50 of the two phases (CUDA events).
vs eager / vs graph / vs saved rel/cos: the worst timed request's max|action - ref| / max|ref|
(0 = bit-identical) and smallest cosine against the same process's eager and exact graph modes,
and against the actions another process saved (0.5.17 eager; the note under the table names
it), on the same observations, noise and weights ("-": not measured; `x/-`: a file from before
cosines were recorded, its difference taken over the warm-up pass).
Modes: `graph` = exact mode (first N signatures captured, later ones eager), `graph-bucket` =
prompt buckets + LRU, `graph-fused` = one graph for all denoise steps, `graph-fast` = knob
`pi05_fast` (fused kernels inside the fused denoise graph; sglang-ext only), `graph-fast-nopdl` =
the same without programmatic dependent launch (a diagnostic: with PDL a kernel's profiled time
includes its wait for the kernel before, so only this mode's kernel table shows each kernel's own),
`graph-fast-fp8` = the fast path with row-scaled FP8 expert weights (slower than bf16 here: not a setting).
`0517-ext` includes `pi05_fused_norms` (fewer, fused norm kernels in every mode); its actions
match 0.5.17's norm math within bf16 rounding (checked on the GPU by
`test_pi05_graphs_cuda.py::test_fused_norms_change_actions_only_within_rounding`)."""

VIT_MEANING = """\
sglang's real Qwen2.5-VL-7B vision tower (random weights, bf16) fed a stream of requests of 1-4
images at common resolutions; every request also runs eager for comparison. attn/ops: what that
row's process really ran, detected at run time: the vision attention backend (`fa3(flash_ops)` =
sgl_kernel's real FlashAttention-3; `NOT flash_ops` = something else answered) / norms and
activations on sgl_kernel's compiled ops or sglang's native torch code (`-`: a run from before
this was recorded: triton_attn with stand-in kernels, no warm-up). Runs that record it first run,
in every process, an untimed warm-up (8 eager requests of another stream, one graph-path request:
JIT compiles and ext-bucket's fa3 ladder capture land there); counters and timings then cover the
timed stream only.
graph/eager req/s: throughput of the graph runner and of sglang's eager tower on the same
requests, interleaved request by request in one process; `eager-only` runs sglang's eager tower
alone in its own process (a second baseline, free of graph/eager interference; eager timings
also differ between processes). hit_rate: requests that replayed an existing graph (captures and eager fallbacks are
misses). resident_graphs: graphs alive at the end (0.5.17 and 0.5.19 are unbounded).
peak_graph_bytes_mib: most bytes held by resident graphs' own buffers (ext modes; their budget is
sglang-ext's default unless --max-bytes says otherwise). peak_cuda_reserved_mib: peak reserved memory. padding: padding tokens / real
tokens (bucket mode). wrong_outputs: requests whose graph output differs from eager by more than
0.05 (bf16; 0.5.17 replays stale layouts, off by O(1)). bitwise_equal: requests equal to eager
bit for bit (bucket mode changes GEMM row counts, so it is only guaranteed equal within rounding).
Modes: `ext-layout` = one graph per exact layout; `ext-class` = layout-class mode, bitwise exact,
token counts unpadded; `ext-bucket` = layout-class mode with token counts padded to the default
ladder of the run (`--ext-vit-graph-mode bucket`; now 16 sizes, on fa3 one graph per size,
captured at the first run; before: 12.5 % steps). Targets: graph count, mismatches and
memory for every ext mode."""

CP_MEANING = """\
CPU only. Decision: time to choose the replay bucket for one batch (sglang-ext decides once
at admission; upstream 0.5.18+ runs its loop twice, at admission and at replay). Admission:
random multi-request zigzag batches against sglang's default prefill capture sizes; `0.5.17
crash` = batches whose live CP-local rows exceed the bucket 0.5.17 pads to (a replay
RuntimeError on 0.5.17), which sglang-ext replays in a larger captured bucket or runs eager."""


def _load(path):
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def _target(label: str, value: float, op: str, bound: float, fmt: str = "{:.2f}", *,
            lower_bound: bool = False) -> str:
    """One target row. A lower bound of the true value can show a floor met, never a ceiling."""
    met = value <= bound if op == "<=" else value >= bound
    verdict = "not known (lower bound)" if lower_bound and op == "<=" else ("met" if met else "NOT met")
    measured = ("≥ " if lower_bound else "") + fmt.format(value)
    return f"| {label} | {measured} | {op} {fmt.format(bound)} | {verdict} |"


def _provenance(sources) -> list:
    """Which kernels and attention backend ran, and whether the rows are one run.

    sources: [(label, record)]; a record holds the `run_id` / `kernels` / `attention` its script
    recorded (absent in files written before the scripts recorded them)."""
    def summary(field, fmt):
        values = {label: fmt(record.get(field)) for label, record in sources}
        if len(set(values.values())) == 1:
            return next(iter(values.values()))
        return "; ".join(f"{label}: {value}" for label, value in values.items())

    kernels = summary("kernels", lambda k: ", ".join(f"{n} {v}" for n, v in k.items()) if k else "not recorded")
    attention = summary("attention", lambda a: a or "not recorded")
    run_ids = {record.get("run_id") for _, record in sources}
    if len(run_ids) == 1 and None not in run_ids:
        runs = f"one run (run id {run_ids.pop()})"
    else:
        runs = "not shown to be one run: " + summary("run_id", lambda r: f"run {r}" if r else "run id not recorded")
    return [f"Kernels: {kernels}. Attention backend: {attention}. Runs: {runs}.", ""]


def _release_line(sglang, kernels, stand_ins) -> list:
    """For a run on another sglang release than the main tables: which release, on whose kernels, what stood in."""
    line = f"sglang {sglang}"
    kernel = (kernels or {}).get("sgl_kernel")
    if sglang == "0.5.23" and kernel == "0.4.5":  # 0.5.23 pins sglang-kernel 0.4.10, which needs torch 2.14
        line += "'s Python; the kernels were 0.5.17's sgl-kernel 0.4.5 (SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1)"
    if stand_ins:
        line += f"; stand-ins, imported and never called on this device: {', '.join(stand_ins)} (docs/gpu-harness.md)"
    return [f"Release: {line}.", ""]


def schema_problems() -> list:
    """"<file>: <keys>" for every results file carrying keys its script does not write."""
    problems = []
    for pattern, schema in bench_results.SCHEMA_OF.items():
        for path in sorted(glob.glob(os.path.join(BENCH_DIR, pattern))):
            extra = bench_results.undeclared(_load(path), schema)
            if extra:
                problems.append(f"docs/bench/{os.path.basename(path)}: {', '.join(extra)}")
    return problems


def _stale(name: str, script: str) -> list:
    extra = [p for p in schema_problems() if p.startswith(f"docs/bench/{name}:")]
    if not extra:
        return []
    return [f"**Pending regeneration.** {extra[0].split(': ', 1)[0]} carries fields `scripts/{script}` does not "
            f"write ({extra[0].split(': ', 1)[1]}): edited by hand or written by an older version of the "
            f"script, so these numbers are not vouched for until the script rewrites the file.", ""]


TARGET_HEAD = ["| target | measured | bound | |", "|---|---|---|---|"]
# Modes that never lead a comparison of the defaults: a diagnostic and an opt-in that is not exact.
NOT_COMPARED = ("graph-fast-nopdl", "graph-fast-fp8")


def _pi05_targets(results) -> list:
    results = [r for r in results if "p50_ms" in r]  # skipped or failed modes have no numbers
    by = {(r["impl"], r["mode"]): r for r in results}
    ext_graph = [r for r in results
                 if r["impl"] == "0517-ext" and r["mode"].startswith("graph") and r["mode"] not in NOT_COMPARED]
    if not ext_graph or ("0519", "graph") not in by or ("0517", "eager") not in by:
        return []
    best = min(ext_graph, key=lambda r: r["p50_ms"])
    rows = [_target(f"best ext graph p50 ({best['mode']}) / 0.5.19 exact graph p50",
                    best["p50_ms"] / by[("0519", "graph")]["p50_ms"], "<=", 0.90),
            _target(f"best ext graph p50 ({best['mode']}) / 0.5.17 eager p50",
                    best["p50_ms"] / by[("0517", "eager")]["p50_ms"], "<=", 0.17)]
    if ("0517-ext", "eager") in by and all("kernel_launches_per_request" in by[(impl, "eager")]
                                           for impl in ("0517", "0517-ext")):
        rows.append(_target("ext eager launches / 0.5.17 eager launches",
                            by[("0517-ext", "eager")]["kernel_launches_per_request"]
                            / by[("0517", "eager")]["kernel_launches_per_request"], "<=", 0.85))
    return ["", *TARGET_HEAD, *rows]


FAST_HEAD = ["| target (fast path: latency, accuracy) | measured | bound | |", "|---|---|---|---|"]


def _pi05_fast_targets(results) -> list:
    """p50 <= 15 ms and accuracy of the fast path (vs the exact path and vs 0.5.17 eager)."""
    fast = next((r for r in results
                 if r["impl"] == "0517-ext" and r["mode"] == "graph-fast" and "p50_ms" in r), None)
    if fast is None:
        return []
    rows = [_target("graph-fast p50 ms", fast["p50_ms"], "<=", 15.0, "{:.1f}")]
    rows += [_target(f"graph-fast p50 ms, {layout} prefixes", ms, "<=", 15.0, "{:.1f}")
             for layout, ms in (fast.get("p50_ms_by_layout") or {}).items()]  # files from before: none
    for name, label in (("vs_graph", "exact graph path"), ("vs_saved", "saved reference")):
        entry = (fast.get("accuracy") or {}).get(name) or {}
        if "max_rel_diff" in entry:
            where = f"{label}: {entry['reference']}, {entry['requests']} requests"
            rows += [_target(f"graph-fast max rel diff vs {where}", entry["max_rel_diff"], "<=", 1e-2, "{:.1e}"),
                     _target(f"graph-fast min cosine vs {where}", entry["min_cosine"], ">=", 0.9999, "{:.6f}")]
    return ["", *FAST_HEAD, *rows]


def _pi05_fast_kernel_targets(results) -> list:
    """The fast path's targets: the bf16 fast path p50 <= 11 ms; the FP8 mode p50 <= 8 ms, cosine >= 0.999 vs the exact path."""
    rows = {r["mode"]: r for r in results if r["impl"] == "0517-ext" and "p50_ms" in r}
    out = []
    if "graph-fast" in rows:
        out.append(_target("bf16 fast path (graph-fast) p50 ms", rows["graph-fast"]["p50_ms"], "<=", 11.0, "{:.1f}"))
    if "graph-fast-fp8" in rows:
        fp8 = rows["graph-fast-fp8"]
        out.append(_target("FP8 mode (graph-fast-fp8) p50 ms", fp8["p50_ms"], "<=", 8.0, "{:.1f}"))
        entry = (fp8.get("accuracy") or {}).get("vs_graph") or {}
        if "min_cosine" in entry:
            out.append(_target(f"FP8 mode min cosine vs the exact graph path, {entry['requests']} requests",
                               entry["min_cosine"], ">=", 0.999, "{:.6f}"))
    return ["", "| target (fast path kernels, FP8) | measured | bound | |", "|---|---|---|---|", *out] if out else []


def _pi05_attention_kernels(results) -> list:
    """The attention kernels the profiler saw per request, per row that recorded them."""
    lines = [f"- {r['impl']} {r['mode']}: " + ", ".join(f"`{name}` x{count:g}" for name, count in
                                                        r["attention_kernels_per_request"].items())
             for r in results if r.get("attention_kernels_per_request")]
    return ["", "Attention kernels per request (device kernels named like attention, torch.profiler):", *lines] \
        if lines else []


def _pi05_processes(runs) -> list:
    run_ids = {run.get("run_id") for run in runs}
    if len(runs) < 2 or len(run_ids) != 1 or None in run_ids:
        return []
    return [f"One process per implementation ({', '.join(run['impl'] for run in runs)}), one after another on "
            "the same GPU in one invocation of `scripts/gpu_steps.sh bench-pi05`, which gives them its run id.", ""]


def _pi05_commands(runs) -> list:
    lines = ["Commands (GPU machine, one process per implementation, run one after another):", "", "```"]
    for run in runs:
        if run.get("command"):
            lines.append(run["command"])
            continue
        tag = "0519" if run["impl"] == "0519" else "0517"  # runs from before the script recorded it
        lines.append(f"source .carry/device_env.sh {tag} && python3 .carry/with_stubs.py scripts/bench_pi05.py "
                     f"--impl {run['impl']} --out docs/bench/pi05_{run['impl']}.json")
    return lines + ["```", ""]


def _pi05_section():
    paths = sorted(glob.glob(os.path.join(BENCH_DIR, "pi05_*.json")))
    if not paths:
        return None
    order = {"0517": 0, "0519": 1, "0517-ext": 2}  # the baselines first, as gpu_steps.sh bench-pi05 runs them
    runs = sorted((_load(p) for p in paths), key=lambda run: order.get(run.get("impl"), 3))
    results = [r for run in runs for r in run["results"]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_results.print_pi05_table(results)
    device = ", ".join(sorted({run.get("device", "?") for run in runs}))
    torch_versions = ", ".join(sorted({run.get("torch", "?") for run in runs}))
    settings = runs[0].get("settings", {})
    stale = [line for path in paths for line in _stale(os.path.basename(path), "bench_pi05.py")]
    lines = [f"## {PI05_HEADING}", "", *stale, PI05_MEANING, "",
             *_provenance([(run["impl"], run) for run in runs]), *_pi05_processes(runs),
             f"Device: {device}; torch {torch_versions}; timed requests per mode: {settings.get('requests')}; "
             f"prompt lengths {settings.get('prompt_lens')}; graph capacities prefix/action "
             f"{settings.get('prefix_entries')}/{settings.get('action_entries')}; buckets {settings.get('buckets')}.",
             "", "```", out.getvalue().strip("\n"), "```", *_pi05_roofline(runs, results), *_pi05_phases(runs, results),
             *_pi05_kernel_table(results),
             *_pi05_attention_kernels(results),
             *_pi05_targets(results), *_pi05_fast_targets(results), *_pi05_fast_kernel_targets(results), "",
             *_pi05_commands(runs)]
    return "\n".join(lines)


def _pi05_roofline(runs, results) -> list:
    """The per-phase floor: the work one request asks for (scripts/pi05_roofline.py) against each mode."""
    work = next((run["work"] for run in runs if run.get("work")), None)
    if work is None:
        return []
    import pi05_roofline

    return ["", "How far each mode is from the floor (`scripts/pi05_roofline.py`: FLOPs and unavoidable HBM bytes "
            f"counted on one eager request of the full layout, prompt {work.get('prompt_len')} tokens; floor = "
            "max(FLOPs / peak, bytes / bandwidth) per phase):", "", "```", pi05_roofline.table(work, results), "```"]


def _pi05_phases(runs, results) -> list:
    """The per-phase kernel table of graph-fast-nopdl (each kernel's own time; with PDL a kernel's time
    includes its wait for the one before) and of the FP8 mode (its own target)."""
    work = next((run["work"] for run in runs if run.get("work")), None)
    profiled = [r for r in results if r.get("phase_kernels_per_request") and r.get("mode", "").startswith("graph-fast")]
    if work is None or not profiled:
        return []
    import pi05_roofline

    picked = [r for r in profiled if r["mode"] == "graph-fast-nopdl"]
    for r in (r for r in profiled if r["mode"] == "graph-fast-fp8"):
        picked += [r] if r not in picked else []
    lines = []
    for r in picked:
        lines += ["", f"Per phase, {r['impl']} {r['mode']} (p50 {r['p50_ms']:.2f} ms: prefix {r['prefix_p50_ms']:.2f}, "
                  f"denoise {r['denoise_p50_ms']:.2f}); per request, by class: kernels, copies and the device's idle gaps; rates: the phase's "
                  "counted work over the class's time (gemm: matrix FLOPs and weights, attention: its FLOPs and "
                  "the prefix K/V" + ("; weights counted in bf16, FP8 reads half" if r["mode"].endswith("fp8") else "")
                  + "):", "", "```", pi05_roofline.phase_table(work, r), "```"]
    return lines


def _pi05_kernel_table(results) -> list:
    """The profile: where the fast path's device time goes, kernel by kernel, from the mode whose
    kernel times are their own (graph-fast-nopdl)."""
    row = next((r for r in results if r.get("mode") == "graph-fast-nopdl" and r.get("top_kernels_per_request")),
               None)
    if row is None:
        return []
    total_us = 1000.0 * row["kernel_time_ms_per_request"]
    lines = [f"{'kernel':<64} {'launches':>8} {'us':>8} {'share':>6}"]
    for name, (count, us) in row["top_kernels_per_request"].items():
        lines.append(f"{name[:64]:<64} {count:>8.1f} {us:>8.1f} {us / total_us:>6.1%}")
    return ["", f"Where the fast path's device time goes (graph-fast-nopdl: p50 {row['p50_ms']:.1f} ms; per request "
            f"{row['device_kernels_per_request']:.0f} kernels, {row['kernel_time_ms_per_request']:.2f} ms of kernel "
            "time; the costliest kernels, per request):", "", "```", *lines, "```"]


PI05_SERVER_MEANING = """\
Pi0.5 through the real server, as a robot sees it: one process per server, one request at a time
(the next when the answer is back), random weights at the real size, two 224x224 cameras, state 8,
noise given, 10 steps. Every request is a new control step (`motion`): `random` draws a new state
every step, `smooth` moves every joint on a slow sine, both switch task (prompt) and camera set
(both cameras, or one) every 50 steps; `fixed` holds one state, one task and both cameras (one
prompt length). p50/p90/p99/max: the client's latency from the payload ready to the actions as a
numpy array (its encode and decode included; base64 PNG encoding of the JSON cameras is not:
`client_png_encode_ms` above the table). stages: sum of sglang's stage timings in the answers
(preprocess, prefix, denoise, postprocess); outside: latency minus stages, p50. captures after
start: CUDA graphs captured after the server reported healthy (its log); eager after load: requests
that no load-time graph held (a lower bound: logged at the 1st, 2nd, 4th, ...). The breakdown
(p50 per part, ms; the server's hops only in runs that recorded them, `-` elsewhere): transport = the client's round trip minus the server's span (sockets,
uvicorn, encoding the answer), http_parse = JSON / msgpack parsing (the JSON body read included),
http_decode = image decoding and request building, to_worker / from_worker = the ZMQ hops with
pickling, worker_queue = the scheduler before the worker, worker_other = the worker around the
stages. rel vs exact: worst max|a - ref| / max|ref|
over every answer, against the ext-exact server's openpi answer to the same observation. Servers:
`upstream` (`0517` in runs before 0.5.23 ones) = unpatched `sglang serve` of the release named
above the table; `ext-no-transport` = sglang-ext with the transport patches off (sglang's request
path); `ext-exact`; `ext-fast` = --ext-pi05-fast. Wire
`sglang` = sglang's own bench_pi05_openpi.py (openpi_ws). Unpatched 0.5.17 ends in a CUDA
device-side assert at the first observation without the first camera (its prefix's rotary gather
reads position -1; sglang-ext clamps it), and is unusable after: runs with the unpatched server keep
the first camera in every observation."""


def _pi05_server_run(run) -> list:
    """One bench_pi05_server.py run: provenance, table, targets, command."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_results.print_pi05_server_table(run["results"])
    head = ["| target (a moving robot) | measured | bound | |", "|---|---|---|---|"]
    rows = [_target(label, value, op, bound, "{:.1e}" if "relative" in label else "{:.2f}")
            for label, value, op, bound in bench_results.pi05_server_targets(run["results"])]
    if not rows:
        rows = ["", "No moving-robot rows in this run (the targets are for the random and smooth motions): "
                "the fixed-state rows above measure one prompt length only."]
        head = []
    failed = [f"- {name}: {entry['error']}" for name, entry in run.get("servers", {}).items() if entry.get("error")]
    settings = run.get("settings", {})
    return [
        *_provenance([("server", run)]),
        f"Device: {run.get('device')}; torch {run.get('torch')}; sglang {run.get('sglang')}; "
        f"{settings.get('requests')} timed requests after {settings.get('warmup')} per server and wire; "
        f"client_png_encode_ms {run.get('client_png_encode_ms', 0):.2f} per camera.", "",
        "```", out.getvalue().strip("\n"), "```", *(["", "Servers that did not run:", *failed] if failed else []),
        *(["", *head, *rows] if rows else []), "", f"Command: `{run.get('command')}`", ""]


def _pi05_server_section():
    path = os.path.join(BENCH_DIR, "server_pi05.json")
    if not os.path.exists(path):
        return None
    others = []  # runs on other releases, kept as server_pi05_<name>.json: one section each
    for other in sorted(glob.glob(os.path.join(BENCH_DIR, "server_pi05_*.json"))):
        run, name = _load(other), os.path.basename(other)
        others += [f"### On sglang {run.get('sglang')}: `docs/bench/{name}`", "",
                   *_stale(name, "bench_pi05_server.py"),
                   *_release_line(run.get("sglang"), run.get("kernels"), run.get("stand_ins")), *_pi05_server_run(run)]
    return "\n".join([
        f"## {PI05_SERVER_HEADING}", "",
        *_stale("server_pi05.json", "bench_pi05_server.py"), PI05_SERVER_MEANING, "",
        *_pi05_server_run(_load(path)), *others])


def _vit_targets(results, capacity) -> list:
    """The targets of ext-bucket and ext-class (0.5.17 / 0.5.19 are the baselines)."""
    rows = []
    eager_only = next((r for r in results if bench_results.vit_mode_key(r["mode"]) == "eager-only"
                       and "eager_req_per_s" in r), None)
    for r in results:
        if r.get("hit_rate") is None or not r["mode"].startswith("ext-"):
            continue
        mode = bench_results.vit_mode_key(r["mode"])
        if mode in ("class", "bucket"):
            hits, speed = (0.99, 2.0) if mode == "bucket" else (0.90, 1.5)
            rows += [_target(f"{r['mode']}: hit rate", r["hit_rate"], ">=", hits),
                     _target(f"{r['mode']}: throughput vs eager (same process, interleaved)",
                             r["speedup_vs_eager"], ">=", speed)]
            if eager_only is not None:
                rows.append(_target(f"{r['mode']}: throughput vs the eager-only process",
                                    r["graph_req_per_s"] / eager_only["eager_req_per_s"], ">=", speed))
        rows += [_target(f"{r['mode']}: resident graphs", r["resident_graphs"], "<=", capacity, "{:.0f}"),
                 _target(f"{r['mode']}: mismatches vs eager", r["wrong_outputs"], "<=", 0, "{:.0f}")]
        if r.get("peak_graph_bytes_mib") is not None and r.get("graph_bytes_budget_mib"):
            rows.append(_target(f"{r['mode']}: peak resident graph MiB (budget)", r["peak_graph_bytes_mib"], "<=",
                                r["graph_bytes_budget_mib"], "{:.0f}",
                                lower_bound=not r.get("peak_graph_bytes_every_request")))
    head = ["| target | measured | bound | |", "|---|---|---|---|"]
    return ["", *head, *rows] if rows else []


# Runs recorded before bench_vit.py stored its own command line.
_VIT_LEGACY_COMMAND = ("source .carry/device_env.sh 0519 && source .carry/device_env.sh 0517 && python3 "
                       ".carry/with_stubs.py scripts/bench_vit.py --upstream-root .carry/run/sgl0519 "
                       "--requests {requests} --capacity {capacity} --out docs/bench/vit.json")


def _vit_section():
    path = os.path.join(BENCH_DIR, "vit.json")
    if not os.path.exists(path):
        return None
    run = _load(path)
    cfg = run["config"]
    sources = [(r["mode"], {**r, "attention": cfg.get("attention")}) for r in run["results"]]
    return "\n".join([
        f"## {VIT_HEADING}", "", *_stale("vit.json", "bench_vit.py"), VIT_MEANING, "",
        *_provenance(sources),
        f"Device: {cfg.get('device')}; tower: {cfg.get('tower')}; {cfg.get('requests')} requests; "
        f"capacity {cfg.get('capacity')}; {cfg.get('seconds')} s in all.", "",
        "```", bench_results.vit_table(run["results"]), "```",
        *_vit_targets(run["results"], cfg.get("capacity") or 32), "",
        *_vit_bound(run["results"]), *_vit_timeline(run["results"]),
        f"Command: `{cfg.get('command') or _VIT_LEGACY_COMMAND.format(**cfg)}` "
        "(0.5.17 and 0.5.19 run the first `--unpatched-requests` of the same stream, their graphs being "
        "unbounded; each mode in its own process). "
        "`crashed_at_request`: the request at which that implementation's process died.",
        *_merged_note(run["results"]), ""])


VIT_BOUND_MEANING = """\
How far each mode is from the launch-free bound. A CUDA graph removes kernel-launch and host
overhead only, never device work, so no graph mode can beat the eager path's device time. Over
`profiled` requests spread over the stream, rerun untimed after the timed stream under
torch.profiler (CUDA activity; kernels inside graph replays are recorded one by one), per request:
wall ms = the timed stream's (unprofiled) wall time of the same requests; kernel ms = summed device
kernel time; device ms = time the device was busy (kernels, copies and memsets, overlaps counted
once); GPU busy = device ms / wall ms. bound = eager wall / eager device ms: the speedup a
launch-free eager would reach. graph bound = eager wall / graph device ms: the same for the graph
path's own device work (padding rows included); the graph path's GPU busy is the share of its
bound it reaches. The graph path is profiled only in modes that replayed every timed request
(ext-bucket on fa3), so nothing is captured under the profiler."""


def _vit_bound(results) -> list:
    text = bench_results.vit_bound_table(results)
    if not text:
        return []
    return [VIT_BOUND_MEANING, "", "```", text, "```", ""]


def _vit_timeline(results, points: int = 6) -> list:
    """Graph memory over time: resident graphs / graph-buffer MiB / reserved MiB at evenly spaced requests."""
    rows = [r for r in results if r.get("timeline")]
    if not rows:
        return []
    lines = ["Memory over the stream (resident graphs / MiB held by graph buffers / MiB reserved by the "
             "CUDA caching allocator, eager runs included), sampled at the request shown:", "",
             "| mode | " + " | ".join(f"sample {i + 1}" for i in range(points)) + " |",
             "|---|" + "---|" * points]
    for r in rows:
        timeline = r["timeline"]
        picks = [timeline[round(i * (len(timeline) - 1) / (points - 1))] for i in range(points)]
        cells = []
        for t in picks:
            graph_mib = "-" if t["graph_bytes_resident"] is None else f"{t['graph_bytes_resident'] / 2**20:.0f}"
            cells.append(f"#{t['request']}: {t['resident_graphs']} / {graph_mib} / {t['cuda_reserved_mib']:.0f}")
        lines.append(f"| {r['mode']} | " + " | ".join(cells) + " |")
    return lines + [""]


def _merged_note(results) -> list:
    lines = []
    merged = [r["mode"] for r in results if r.get("merged_later")]
    if merged:
        lines += ["", f"Merged into the file by a later invocation (`--modes ... --merge`), so not the same run as "
                  f"the other rows: {', '.join(merged)}."]
    sampled = [r["mode"] for r in results
               if r.get("peak_graph_bytes_mib") is not None and not r.get("peak_graph_bytes_every_request")]
    if sampled:
        lines += ["", f"peak_graph_bytes_mib of {', '.join(sampled)}: not recorded as tracked at every request, "
                  "so only a lower bound of the peak (≥)."]
    return lines


VIT_SERVER_MEANING = """\
Real `launch_server` processes on one GPU, all configurations resident at once and measured in
interleaved passes (`sglang.bench_serving`, image dataset, random images, 32 input / 8 output
tokens; a varied warm-up pass first). req/s: median over passes (min-max); vs off: the median's
ratio to graphs-off in the same slot; per pass: the median of each pass's ratio to graphs-off's run in
that pass (the configurations of a pass run back to back, so the machine's drift between passes
cancels); TTFT p50 / p99: medians over passes (ms). `ext` is
sglang-ext's default ViT graph mode (bucket: ladder captured at load and ended where eager wins,
calls above it eager; the multimodal embedding without its device sync); `upstream-graphs-on`
(`0517-graphs-on` in runs before 0.5.23 ones) is unpatched sglang, the release the run names, with its own ViT graphs; `ext-split` is `ext` with calls above the break-even split
into whole-image chunks that replay (knob `vit_graph_above_ladder=split`; `ext-idle-split`: only while the
ViT's stream has caught up with the host, a knob value since removed); `ext-full-ladder` is `ext` with every budget up to the server's largest call captured and replayed (no probe); `ext-no-replay` is sglang-ext's path with no graph replayed
(a diagnostic: every call eager through the sync-free tower); `vit-free` is graphs-off with a vision
tower that answers zeros without running (the tower's cost: about what a ViT change can give; it
keeps the embedding's device syncs, which ext removes, so ext can pass it slightly). With `--trace`, where each scheduler's time went. Counters from `/metrics` (sglang-ext only): captures after start (must be 0), hits,
eager fallbacks, calls split into chunks ("-": not published then), padding tokens, resident graph MiB
and reserved MiB at the end (with `--trace`, every server's reserved MiB from the trace), the share of
eligible calls replayed (the load-time gate's deliberate eager calls left out), and how much reserved
memory grew from the end of the warm-up to the end; KV tokens: each server's KV pool, the same for
all (`--kv-tokens`; "-": a run from before the cap, see its note). Accuracy:
input-token logprobs of a mixed-size stream (each target names it: layout sizes, the tiny-server tests'
13 layouts with 9 patch counts, all multiples of 64; random sizes, 1-2 images of 224-896 px sides,
`--accuracy-sizes`) against graphs-off at concurrency 1, and at 16 next
to the floor (batch composition alone moves logprobs): a second graphs-off process where the run had
one ("floor from"), else graphs-off against itself in later passes."""


def _vit_server_targets(run) -> list:
    lines = ["| target | measured | bound | |", "|---|---|---|---|"]
    floors = {1: 1.3, 8: 1.15, 32: 1.3, 64: 1.3}
    mode = " (deterministic inference)" if _deterministic(run) else ""  # a diagnostic run, not the servers
    ceilings = bench_results.ratios(run, "vit-free")
    paired = bench_results.paired_ratios(run)
    for slot, ratio in bench_results.ratios(run).items():
        backend, c, images = slot
        notes = [f"median of per-pass ratios {paired[slot]:.2f}"] if slot in paired else []
        notes += [f"ceiling {ceilings[slot]:.2f}: vit-free"] if slot in ceilings else []
        lines.append(_target(f"{backend}{mode} c={c} img={images}: ext / graphs-off req/s"
                             + (f" ({'; '.join(notes)})" if notes else ""), ratio, ">=", floors.get(c, 1.0)))
    off_p99 = bench_results.ttft_p99(run, "graphs-off")
    for slot, p99 in bench_results.ttft_p99(run, "ext").items():
        if slot in off_p99:
            backend, c, images = slot
            lines.append(_target(f"{backend}{mode} c={c} img={images}: ext TTFT p99, ms (median over passes), against "
                                 "graphs-off's", p99, "<=", off_p99[slot], "{:.1f}"))
    for server in run["servers"]:  # a server that died keeps its last counters: no verdict from them
        if server["config"] == "ext" and server.get("captures_after_start") is not None and not server.get("error"):
            lines.append(_target(f"{server['backend']}{mode}: ViT captures after start-up",
                                 server["captures_after_start"], "<=", 0, "{:.0f}"))
            share = bench_results.eligible_replayed(server)
            if share is not None:
                lines.append(_target(f"{server['backend']}{mode}: eligible ViT calls replayed", share, ">=", 0.95))
            growth = bench_results.reserved_growth(run, server)
            if growth is not None:
                off_server = bench_results.server_of(run, "graphs-off", server["backend"])
                off = None if off_server is None else bench_results.reserved_growth(run, off_server)
                baseline = "" if off is None else f"; graphs-off {off[0]:+.0f} MiB"
                against = bench_results.reserved_against(run, server)
                if against is not None:
                    baseline += f"; ext ends {against[0]:+.0f} MiB from graphs-off, {against[1]:+.0f} at start-up"
                series = server.get("reserved_mib_after_pass") or []
                if len(series) > 1:
                    baseline += "; after each pass " + ", ".join(
                        "?" if None in (a, b) else f"{b - a:+d}" for a, b in zip(series, series[1:]))
                lines.append(_target(f"{server['backend']}{mode}: reserved memory growth after warm-up, MiB "
                                     f"({growth[1]} requests{baseline})", growth[0], "<=", 64, "{:.0f}"))
    # runs before --accuracy-sizes used the layouts
    stream = {"random": "random sizes"}.get((run.get("config") or {}).get("accuracy_sizes"), "layout sizes")
    for row in run.get("accuracy") or []:
        if row["config"] != "ext" or row.get("max_abs") is None:
            continue
        if row["concurrency"] == 1:
            lines.append(_target(f"{row['backend']}{mode} c=1: requests beyond 0.05 of graphs-off ({stream})",
                                 row["beyond_0_05"], "<=", 0, "{:.0f}"))
        elif row.get("floor_max_abs") is not None:
            each = f", largest of {row['samples']} passes each" if (row.get("samples") or 1) > 1 else ""
            source = bench_results.floor_source(row)
            floor = f"{source}'s{' own' if source == 'graphs-off' else ''} (floor){each}"
            lines.append(_target(f"{row['backend']}{mode} c={row['concurrency']}: max abs logprob difference from "
                                 f"graphs-off ({stream}), against {floor}", row["max_abs"], "<=",
                                 row["floor_max_abs"], "{:.4f}"))
            if row.get("floor_beyond_0_05") is not None:
                lines.append(_target(f"{row['backend']}{mode} c={row['concurrency']}: requests beyond 0.05 of "
                                     f"graphs-off ({stream}), against {floor}", row["beyond_0_05"], "<=",
                                     row["floor_beyond_0_05"], "{:.0f}"))
    return lines + [""]


# The first run id after which `ext` has the one-kernel rotary (knob vit_triton_rotary on by default).
ROTARY_KERNEL_DEFAULT_FROM = "20261202T170000Z"


def _vit_server_notes(run) -> list:
    """What a run's table cannot say by itself: defaults and conditions that changed after it."""
    notes = []
    if not any(s.get("kv_tokens") for s in run["servers"]):
        notes.append("KV pools not capped in this run: sglang sized each from the memory free when that server "
                     "started, so the pools may have differed and ratios at concurrency 32-64 may partly reflect "
                     "batching.")
    if (run.get("run_id") or "") < ROTARY_KERNEL_DEFAULT_FROM:
        notes.append("`ext` here ran sglang's rotary functions (the default then); `ext-triton-rotary`, where "
                     "present, is today's default (the one-kernel rotary).")
    if _deterministic(run):
        notes.append("every server ran with `--enable-deterministic-inference` (sglang's batch-invariant GEMMs and "
                     "log-softmax, so batching no longer moves logprobs): a diagnostic of the ViT path's own numerics; "
                     "the targets are for servers without it.")
    return [f"Note: {n}" for n in notes] + ([""] if notes else [])


def _deterministic(run) -> bool:
    return "--enable-deterministic-inference" in ((run.get("config") or {}).get("command") or "")


def _vit_server_section():
    path = os.path.join(BENCH_DIR, "vit_server.json")
    if not os.path.exists(path):
        return None
    run = _load(path)
    cfg = run["config"]
    return "\n".join([
        f"## {VIT_SERVER_HEADING}", "",
        *_stale("vit_server.json", "bench_vit_server.py"), VIT_SERVER_MEANING, "", *_provenance([("vit_server", run)]),
        f"Device: {cfg.get('device')}; model: {cfg.get('model')} ({cfg.get('parameters_b')} B parameters); "
        f"sglang {cfg.get('sglang')}; {len({r['pass'] for r in run['passes']})} of {cfg.get('passes')} passes "
        f"completed, {cfg.get('requests')} requests each "
        f"(concurrency 1: a quarter); images {cfg.get('resolution')}; {cfg.get('seconds')} s in all.", "",
        *_vit_server_notes(run), "```", bench_results.vit_server_table(run), "```", *_vit_server_targets(run),
        f"Command: `{cfg.get('command')}`", "", *_vit_server_other_runs()])


def _passes_line(run) -> str:
    passes = len({r["pass"] for r in run["passes"]})
    if not passes:
        return "no timed pass (accuracy only)."
    return f"{passes} pass{'es' if passes > 1 else ''} of {run['config'].get('requests')} requests."


def _vit_server_run(run, name) -> list:
    """One bench_vit_server.py run's table, targets and command (`--show` prints it)."""
    return [f"### `docs/bench/{name}`", "", *_provenance([(name, run)]),
            f"Device: {run['config'].get('device')}; {run['config'].get('model')} "
            f"({run['config'].get('parameters_b')} B); " + _passes_line(run), "",
            *_vit_server_notes(run), "```", bench_results.vit_server_table(run), "```", *_vit_server_targets(run),
            f"Command: `{run['config'].get('command')}`", ""]


def _vit_server_other_runs() -> list:
    """Other bench_vit_server.py runs kept in docs/bench (vit_server_<name>.json), newest first: one line each;
    runs on another sglang release than vit_server.json's in full, one section per release."""
    main = _load(os.path.join(BENCH_DIR, "vit_server.json"))["config"].get("sglang")
    runs = [(_load(path), os.path.basename(path)) for path in glob.glob(os.path.join(BENCH_DIR, "vit_server_*.json"))]
    releases = sorted({run["config"].get("sglang") for run, _ in runs} - {main}, key=str)
    out = []
    for release in releases:
        for run, name in sorted(runs, key=lambda pair: pair[0].get("run_id") or ""):
            if run["config"].get("sglang") == release:
                out += [f"### On sglang {release}: `docs/bench/{name}`", "",
                        *_release_line(release, run.get("kernels"), run["config"].get("stand_ins")),
                        *_vit_server_run(run, name)[2:]]
    runs = [(run, name) for run, name in runs if run["config"].get("sglang") == main]
    if not runs:
        return out
    by_attention = {}
    for run, name in sorted(runs, key=lambda pair: pair[0].get("run_id") or "", reverse=True):
        attention = run.get("attention") or run["config"].get("mm_attention_backend") or "-"
        by_attention.setdefault(attention, []).append(f"`{name}`")
    lines = ["### Other runs", "", "Kept in `docs/bench/` (newest first); a run's table, targets and command: "
             "`python scripts/gen_performance_doc.py --show docs/bench/<file>`.", ""]
    lines += [f"- {attention}: {', '.join(names)}" for attention, names in by_attention.items()]
    return out + lines + [""]


def show(path: str) -> str:
    """A kept bench_vit_server.py run, rendered as the doc once showed it."""
    return "\n".join(_vit_server_run(_load(path), os.path.basename(path)))


def _cp_section():
    path = os.path.join(BENCH_DIR, "prefill_cp.json")
    if not os.path.exists(path):
        return None
    run = _load(path)
    return "\n".join([
        f"## {CP_HEADING}", "",
        *_stale("prefill_cp.json", "bench_prefill_cp.py"), CP_MEANING, "", *_provenance([("prefill_cp", run)]),
        f"Machine: {run.get('machine')} x{run.get('cpus')} (1-min load {run.get('load_average_1m')}); "
        f"sglang {run.get('sglang')}.", "",
        "```", bench_results.prefill_cp_table(run["decision"], run["admission"]), "```", "", *TARGET_HEAD,
        _target("slowest per-batch decision (median us)", max(r["ext_decision_us"] for r in run["decision"]),
                "<=", 10.0), "",
        f"Command: `{run.get('command')}`", ""])


def render() -> str:
    sections = [s for s in (_pi05_section(), _pi05_server_section(), _vit_server_section(), _vit_section(),
                            _cp_section()) if s]
    head = ["# Performance", "",
            "Generated by `scripts/gen_performance_doc.py` from `docs/bench/*.json`; do not edit by hand.",
            "Each table says which kernels and attention backend ran and whether its rows are one run.", ""]
    return "\n".join(head + sections).rstrip("\n") + "\n"


def _anchor(heading: str) -> str:
    """The link to a heading of docs/performance.md, as GitHub renders its anchor."""
    slug = "".join(c for c in heading.lower() if c.isalnum() or c in " -_").replace(" ", "-")
    return f"docs/performance.md#{slug}"


def _pi05_headline():
    runs = [_load(p) for p in sorted(glob.glob(os.path.join(BENCH_DIR, "pi05_*.json")))]
    rows = {(r["impl"], r["mode"]): r for run in runs for r in run["results"] if "p50_ms" in r}
    ext = [r for (impl, mode), r in rows.items()
           if impl == "0517-ext" and mode.startswith("graph") and mode not in NOT_COMPARED]
    if not ext or ("0517", "eager") not in rows:
        return None
    best = min(ext, key=lambda r: r["p50_ms"])
    flag = {"graph-fast": " (`--ext-pi05-fast`)", "graph-fused": " (`--ext-pi05-fused-denoise`)"}.get(best["mode"], "")
    before = [f"{rows[('0517', 'eager')]['p50_ms']:.1f} ms on sglang 0.5.17 without graphs"]
    if ("0517", "graph") in rows:
        graph = rows[("0517", "graph")]
        before.append(f"{graph['p50_ms']:.1f} ms with its graphs (p90 {graph['p90_ms']:.1f} ms)")
    if ("0519", "graph") in rows:
        before.append(f"{rows[('0519', 'graph')]['p50_ms']:.1f} ms on 0.5.19")
    accuracy = ((best.get("accuracy") or {}).get("vs_graph") or {}).get("max_rel_diff")
    close = f", within {accuracy:.1e} of exact" if accuracy else ""
    device = ", ".join(sorted({run.get("device", "?") for run in runs}))
    graph = rows.get(("0517", "graph"))
    unpatched = f"{rows[('0517', 'eager')]['p50_ms']:.1f} ms" + (f" ({graph['p50_ms']:.1f} with its graphs)" if graph else "")
    return (f"Pi0.5 latency, one prompt length, {device}", unpatched, f"{best['p50_ms']:.1f} ms{flag}{close}",
            PI05_HEADING)


def _pi05_server_headline():
    """The moving robot through the server: the fast and exact paths' openpi p50 on random states."""
    path = os.path.join(BENCH_DIR, "server_pi05.json")
    if not os.path.exists(path):
        return None
    run = _load(path)
    rows = {(r["server"], r["wire"], r["motion"]): r for r in run["results"]}
    fast, exact = rows.get(("ext-fast", "openpi", "random")), rows.get(("ext-exact", "openpi", "random"))
    if not fast or fast.get("p50_ms") is None:
        return None
    unpatched = next((rows[(name, "openpi", "random")] for name in bench_results.UPSTREAM_PI05_SERVERS
                      if (name, "openpi", "random") in rows), {})
    if unpatched.get("p50_ms") is not None:
        before = f"{unpatched['p50_ms']:.1f} ms, {unpatched.get('captures_after_start', '?')} captures while serving"
    else:
        before = "failed: " + ("device-side assert" if "device-side assert" in unpatched.get("error", "")
                               else unpatched.get("error", "not run").splitlines()[0])
    ext = f"{fast['p50_ms']:.1f} ms fast (p99 {fast['p99_ms']:.1f})"
    if exact and exact.get("p50_ms") is not None:
        ext += f", {exact['p50_ms']:.1f} ms exact"
    ext += f"; {fast.get('captures_after_start', '?')} captures while serving"
    return (f"Pi0.5 server, robot state moving every step, {run.get('device', '?')}", before, ext,
            PI05_SERVER_HEADING)


def _vit_server_headline():
    path = os.path.join(BENCH_DIR, "vit_server.json")
    if not os.path.exists(path):
        return None
    run = _load(path)
    one_image = {c: ratio for (_, c, images), ratio in bench_results.ratios(run).items() if images == "1"}
    if not one_image:
        return None
    captures = [s["captures_after_start"] for s in run["servers"] if s["config"] == "ext"]
    below = sorted(f"{c}" + ("" if images == "1" else f" ({images} images)")
                   for (_, c, images) in bench_results.below_graphs_off(run))
    return (f"Qwen2.5-VL server, {run.get('attention')} ViT attention", "ViT graphs off: 1.00x",
            f"{' / '.join(f'{r:.2f}x' for r in one_image.values())} at concurrency "
            f"{' / '.join(map(str, one_image))}; {'0' if captures and not any(captures) else 'some'} captures while "
            f"serving" + (f"; below graphs off at {', '.join(below)}" if below else ""), VIT_SERVER_HEADING)


def _vit_headline():
    path = os.path.join(BENCH_DIR, "vit.json")
    if not os.path.exists(path):
        return None
    run = _load(path)
    by_mode = {r["mode"]: r for r in run["results"]}
    ext = [r for r in run["results"] if r["mode"].startswith("ext-") and r.get("graph_req_per_s")]
    if not ext:
        return None
    best = max(ext, key=lambda r: r["graph_req_per_s"])
    mode = bench_results.vit_mode_key(best["mode"])
    before = []
    old = by_mode.get("0.5.17", {})
    if old.get("crashed_at_request") is not None:
        before.append(f"sglang 0.5.17 with ViT graphs died at request {old['crashed_at_request']} "
                      f"({old['crashed'].split(': ', 1)[-1]})")
    elif old.get("wrong_outputs"):
        before.append(f"sglang 0.5.17 with ViT graphs answered {old['wrong_outputs']} of {old['requests']} wrong")
    upstream = by_mode.get("0.5.19", {})
    if upstream.get("resident_graphs") is not None:
        before.append(f"0.5.19 held {upstream['resident_graphs']} graphs after {upstream['requests']} requests "
                      "(its cache has no bound)")
    cfg = run["config"]
    crash = (f"died at request {old['crashed_at_request']}" if old.get("crashed_at_request") is not None
             else f"{old.get('wrong_outputs', '?')}/{old.get('requests', '?')} answers wrong")
    return (f"Qwen2.5-VL image encoder, {cfg.get('device')}", crash,
            f"{mode} mode: {best['bitwise_equal']}/{best['requests']} equal to eager, at most {best['resident_graphs']} graphs "
            f"({best['peak_graph_bytes_mib']:.0f} MiB), {best['speedup_vs_eager']:.2f}x eager's requests/s", VIT_HEADING)


def _cp_headline():
    path = os.path.join(BENCH_DIR, "prefill_cp.json")
    if not os.path.exists(path):
        return None
    rows = _load(path)["admission"]
    sizes = "/".join(str(r["cp"]) for r in rows)
    crashes = "/".join(str(r["unpatched"]["crash"]) for r in rows)
    eager = "/".join(str(r["ext"]["eager"] + r["ext"]["eager_no_fit"]) for r in rows)
    batches = "/".join(sorted({str(r["batches"]) for r in rows}))
    # every batch is counted in one of sglang-ext's outcomes, none of which is an error
    none_fail = " and none failing" if all(sum(r["ext"].values()) == r["batches"] for r in rows) else ""
    return (f"Prefill CP, {batches} random batches per CP size {sizes}", f"{crashes} fail at replay",
            ("/".join("0" for _ in rows) + " fail, " if none_fail else "") + f"{eager} run eager", CP_HEADING)


def render_readme_block() -> str:
    """The README's headline table (between README_BEGIN and README_END)."""
    rows = [row for row in (_vit_headline(), _vit_server_headline(), _pi05_headline(), _pi05_server_headline(),
                                         _cp_headline()) if row]
    lines = ["| | sglang 0.5.17 | with sglang-ext | |", "|---|---|---|---|"]
    lines += [f"| {what} | {without} | {ext} | [details]({_anchor(heading)}) |"
              for what, without, ext, heading in rows]
    note = ("Generated by `scripts/gen_performance_doc.py` from `docs/bench/*.json`; every number, the kernels and "
            "the commands: [docs/performance.md](docs/performance.md).")
    return "\n".join([*lines, "", note]) + "\n"


def readme_text(current: str) -> str:
    if README_BEGIN not in current or README_END not in current:
        raise SystemExit(f"README.md lacks the markers {README_BEGIN} / {README_END}")
    head, rest = current.split(README_BEGIN, 1)
    return head + README_BEGIN + "\n" + render_readme_block() + README_END + rest.split(README_END, 1)[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if docs/performance.md is stale")
    ap.add_argument("--bench-dir", default=COMMITTED[0], help="results files to render (default docs/bench)")
    ap.add_argument("--doc", default=COMMITTED[1], help="where to write the doc (default docs/performance.md)")
    ap.add_argument("--readme", help="whose what-you-get lines to write (default: README.md, but only when "
                                     "--bench-dir and --doc are the defaults: other results never reach it)")
    ap.add_argument("--show", metavar="FILE", help="print one kept docs/bench/vit_server_*.json run and exit")
    args = ap.parse_args(argv)
    if args.show:
        print(show(args.show))
        return 0
    readme = args.readme
    if readme is None and (os.path.abspath(args.bench_dir), os.path.abspath(args.doc)) == COMMITTED:
        readme = README
    globals().update(BENCH_DIR=os.path.abspath(args.bench_dir), DOC=os.path.abspath(args.doc))
    wanted = {DOC: render()}
    if readme is not None:
        wanted[os.path.abspath(readme)] = readme_text(open(readme, encoding="utf-8").read())
    if args.check:
        failed = False
        for problem in schema_problems():
            print(f"results file carries keys no bench script writes (hand edit?): {problem}", file=sys.stderr)
            failed = True
        for path, text in wanted.items():
            current = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
            if current != text:
                print(f"{os.path.relpath(path, REPO)} is stale: run `python scripts/gen_performance_doc.py`",
                      file=sys.stderr)
                failed = True
        return 1 if failed else 0
    for path, text in wanted.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
