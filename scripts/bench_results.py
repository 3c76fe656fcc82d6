"""Results files of the benchmark scripts (docs/bench/*.json): what they may hold, writing one, and
reading one back into tables (the scripts print them, gen_performance_doc.py renders docs from them).

Each bench script's schema here (`SCHEMA_OF`) holds the keys it writes per level: `{key: None}` a value,
`{key: {...}}` an object, `{key: [{...}]}` a list of objects, `{key: ANY}` an object whose
keys are data (patch names, counter names). `write()` refuses a report with keys its schema
lacks, so the schema is the one the script really uses; `gen_performance_doc.py --check` fails
on a committed file carrying keys no script writes (a hand edit).

Every file records where its numbers come from: `run_id` (one per invocation of the script, or
the SGX_BENCH_RUN_ID a driver such as `gpu_steps.sh bench-pi05` gives the processes it runs one
after another: rows sharing it were measured in one run), `kernels` (the CUDA kernel packages the measuring
process loaded) and `attention` (the attention backend).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

ANY = "any"
RUN_ID = os.environ.get("SGX_BENCH_RUN_ID") or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
KERNELS_SCHEMA = {"sgl_kernel": None, "flashinfer": None}


def kernels() -> dict:
    """Per kernel package: its version, "stand-in" (sglang_ext_testkit.stand_ins), or "not loaded"."""
    out = {}
    for name in KERNELS_SCHEMA:
        module = sys.modules.get(name)
        if module is None:
            out[name] = "not loaded"
        elif getattr(module, "__sgl_stub__", False):
            out[name] = "stand-in"
        else:
            out[name] = str(getattr(module, "__version__", "version unknown"))
    return out


def undeclared(value, schema, where: str = "") -> list:
    """Paths of keys in `value` that `schema` does not declare (list items as `[]`)."""
    if schema is None or schema == ANY or value is None:
        return []
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where} (a list in the schema)"]
        return sorted({p for item in value for p in undeclared(item, schema[0], where + "[]")})
    if not isinstance(value, dict):
        return [f"{where} (an object in the schema)"]
    out = []
    for key, item in value.items():
        path = f"{where}.{key}" if where else key
        out += [path] if key not in schema else undeclared(item, schema[key], path)
    return out


def write(path: str, report: dict, schema: dict, **dump) -> None:
    extra = undeclared(report, schema)
    if extra:
        raise SystemExit(f"{path}: not written, keys missing from the script's schema: {', '.join(extra)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, **dump)
    print(f"wrote {path}")


# Pi0.5 latency (bench_pi05.py): its schema and tables.
_PI05_CACHE = ANY  # the runner's cache_info() fields
_PI05_ACCURACY = dict.fromkeys(("reference", "requests", "max_rel_diff", "min_cosine", "skipped"))
# `kernels`: the packages loaded (kernels()), whether sgl_kernel's compiled ops and FA3
# are really there, and what Pi0.5's custom ops ran (forward_native, or sglang's dispatch).
PI05_KERNELS_SCHEMA = {**KERNELS_SCHEMA, "sgl_kernel_ops": None, "fa3": None, "custom_ops": None}
# Every key bench_pi05.py writes to --out.
PI05_SCHEMA = {
    **dict.fromkeys(("run_id", "impl", "sglang", "device", "torch", "attention", "command")),
    "kernels": PI05_KERNELS_SCHEMA,
    # requested backend; per attention module kind (backend:impl class) how many; per request how many
    # calls took LocalAttention's masked path (torch SDPA whatever the backend) or the backend's own
    "attention_ran": {"requested": None, "modules": ANY, "calls_per_request": ANY, "error": None},
    "sglang_ext": ANY,  # patch name -> status
    "settings": dict.fromkeys(("impl", "modes", "requests", "warmup", "prompt_lens", "layouts", "num_steps", "buckets",
                               "prefix_entries", "action_entries", "profile_requests", "quick", "attention",
                               "custom_ops", "save_actions", "save_mode", "compare_actions", "cpu_logic_check")),
    "reference_actions": dict.fromkeys(("saved_to", "saved_mode", "compared_with", "status")),
    "work": ANY,  # pi05_roofline.measure(): one full-layout request's FLOPs and bytes per phase
    "results": [{
        **dict.fromkeys(("impl", "mode", "requests", "p50_ms", "p90_ms", "mean_ms", "min_ms", "warmup_s",
                         "prefix_p50_ms", "denoise_p50_ms",
                         "peak_allocated_mib", "graph_pool_growth_mib",
                         "max_relative_diff_vs_eager",  # files from before `accuracy`
                         "profiled_requests", "kernel_launches_per_request", "graph_launches_per_request",
                         "device_kernels_per_request", "kernel_time_ms_per_request", "skipped", "error", "note")),
        "phase_kernels_per_request": ANY,  # phase -> kernel class -> [kernels, us] per request
        "config": dict.fromkeys(("prefix_graph", "action_graph", "bucket_mode", "prompt_token_buckets",
                                 "prefix_entries", "action_entries", "fused_denoise", "fast", "fp8_expert",
                                 "fused_vision", "fold_norms")),  # fold_norms, fp8_expert: files from before their removal
        "accuracy": {"vs_eager": _PI05_ACCURACY, "vs_graph": _PI05_ACCURACY, "vs_saved": _PI05_ACCURACY},
        "p50_ms_by_layout": ANY,  # layout (full, masked) -> p50 of its timed requests
        "attention_kernels_per_request": ANY,  # device kernel name -> count
        "top_kernels_per_request": ANY,  # device kernel name -> [count, us], by time
        "prefix_graph_runner_cache": _PI05_CACHE, "graph_runner_cache": _PI05_CACHE,
    }],
}


def _graph_buffer_mib(result: Dict[str, Any]) -> str:
    """Bytes held by resident graphs' static buffers, as the sglang-ext caches count them ("-": not reported)."""
    counted = [c.get("bytes_resident") for c in (result.get("prefix_graph_runner_cache"),
                                                  result.get("graph_runner_cache")) if isinstance(c, dict)]
    counted = [b for b in counted if b is not None]
    return f"{sum(counted) / 2**20:.0f}" if counted else "-"


def _pi05_num(r: Dict[str, Any], key: str, fmt: str) -> str:
    value = r.get(key)
    return "-" if value is None else fmt.format(value)


def _pi05_acc(r: Dict[str, Any], name: str) -> str:
    """max rel diff / cosine against one reference ("-": not measured; "skip": see the notes)."""
    entry = (r.get("accuracy") or {}).get(name)
    if entry is None and name == "vs_eager" and "accuracy" not in r and r.get("mode") != "eager":
        legacy = r.get("max_relative_diff_vs_eager")  # files from before accuracy was recorded
        return "-" if legacy is None else f"{legacy:.1e}/-"
    if entry is None:
        return "-"
    if "skipped" in entry:
        return "skip"
    return f"{entry['max_rel_diff']:.1e}/{entry['min_cosine']:.6f}"


def print_pi05_table(results: List[Dict[str, Any]]) -> None:
    header = ("impl", "mode", "p50 ms", "p90 ms", "prefix ms", "denoise ms", "launches/req", "graph launches/req",
              "kernels/req", "kernel ms/req", "peak MiB", "pool +MiB", "graph buf MiB", "vs eager rel/cos",
              "vs graph rel/cos", "vs saved rel/cos")
    rows = [header]
    notes, compared = [], {}  # compared: the saved run -> the modes compared with it
    for r in results:
        if "p50_ms" not in r:
            notes.append(f"{r['impl']} {r['mode']}: " + (f"skipped: {r['skipped']}" if "skipped" in r
                                                         else f"FAILED: {r.get('error')}"))
            continue
        rows.append((
            r["impl"], r["mode"], f"{r['p50_ms']:.1f}", f"{r['p90_ms']:.1f}",
            _pi05_num(r, "prefix_p50_ms", "{:.1f}"), _pi05_num(r, "denoise_p50_ms", "{:.1f}"),
            _pi05_num(r, "kernel_launches_per_request", "{:.0f}"), _pi05_num(r, "graph_launches_per_request", "{:.1f}"),
            _pi05_num(r, "device_kernels_per_request", "{:.0f}"), _pi05_num(r, "kernel_time_ms_per_request", "{:.1f}"),
            f"{r['peak_allocated_mib']:.0f}", f"{r['graph_pool_growth_mib']:.0f}", _graph_buffer_mib(r),
            _pi05_acc(r, "vs_eager"), _pi05_acc(r, "vs_graph"), _pi05_acc(r, "vs_saved"),
        ))
        saved = (r.get("accuracy") or {}).get("vs_saved") or {}
        if saved.get("skipped"):
            notes.append(f"{r['impl']} {r['mode']}: vs saved skipped: {saved['skipped']}")
        elif saved.get("reference"):
            compared.setdefault(saved["reference"], []).append(f"{r['impl']} {r['mode']}")
        if r.get("note"):
            notes.append(f"{r['impl']} {r['mode']}: {r['note']}")
    notes += [f"vs saved = {reference}: {', '.join(names)}" for reference, names in compared.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print()
    for index, row in enumerate(rows):
        print(" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if index == 0:
            print("-+-".join("-" * w for w in widths))
    for note in dict.fromkeys(notes):
        print(note)


# Pi0.5 through the server (bench_pi05_server.py): its schema and tables.
# Targets for a moving robot (H200, fast path; the exact path against unpatched 0.5.17)
TARGET_OPENPI_P50_MS, TARGET_JSON_P50_MS, TARGET_OUTSIDE_MS, TARGET_P99_OVER_P50 = 17.0, 21.0, 2.5, 1.2
TARGET_FAST_VS_EXACT = 5e-3
PI05_SERVER_SCHEMA = {
    **dict.fromkeys(("run_id", "device", "torch", "sglang", "attention", "command", "client_png_encode_ms",
                     "stand_ins")),
    "kernels": KERNELS_SCHEMA,
    "settings": ANY,
    "servers": ANY,  # server name -> {argv, start_s, log, error}
    "results": [{
        **dict.fromkeys(("server", "wire", "motion", "client", "requests", "p50_ms", "p90_ms", "p99_ms", "mean_ms",
                         "max_ms", "p99_over_p50", "stage_sum_p50_ms", "outside_pipeline_p50_ms",
                         "max_rel_diff_vs_exact", "checked_requests", "captures_after_start", "eager_after_load",
                         "error", "note")),
        "breakdown_p50_ms": ANY,  # part of the path -> p50 (ms)
    }],
}


def motion_of(row) -> str:
    """A row's motion; rows written before motions were recorded held the state fixed (sglang's own bench:
    its observations)."""
    return str(row.get("motion") or ("sglang's" if row.get("wire") == "sglang" else "fixed"))


def format_or_dash(value, fmt="{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


PI05_SERVER_BREAKDOWN = ("client_encode", "transport", "http_parse", "http_decode", "to_worker", "worker_queue",
                     "worker_other", "pipeline", "from_worker", "client_decode")


def print_pi05_server_table(results: List[Dict[str, Any]]) -> None:
    head = ["server", "wire", "motion", "n", "p50", "p90", "p99", "max", "p99/p50", "stages", "outside",
            "captures after start", "eager after load", "rel vs exact"]
    print(" | ".join(head))
    for r in results:
        if r.get("error"):
            lines = [line.strip() for line in r["error"].splitlines() if line.strip()]
            # the exception's own line and the last line of the output behind it (a child's traceback)
            print(f"{r['server']} | {r['wire']} | {motion_of(r)} | error: {lines[0][:100]} ... {lines[-1][:160]}")
            continue
        print(" | ".join([r["server"], r["wire"], motion_of(r), str(r.get("requests")),
                          *(format_or_dash(r.get(k)) for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms", "p99_over_p50",
                                                                "stage_sum_p50_ms", "outside_pipeline_p50_ms")),
                          str(r.get("captures_after_start", "-")), str(r.get("eager_after_load", "-")),
                          format_or_dash(r.get("max_rel_diff_vs_exact"), "{:.1e}")]))
    rows = [r for r in results if r.get("breakdown_p50_ms")]
    if rows:
        print("\nbreakdown, p50 ms: " + ", ".join(PI05_SERVER_BREAKDOWN) + " (- = not measured: no hop times)")
        for r in rows:
            b = r["breakdown_p50_ms"]
            stages = ", ".join(f"{k} {b[k]:.2f}" for k in ("preprocess", "prefix", "action_denoise", "postprocess")
                               if k in b)
            print(f"{r['server']:>16} {r['wire']:>6} {motion_of(r):>6}: "
                  + " ".join(format_or_dash(b.get(k)) for k in PI05_SERVER_BREAKDOWN)
                  + f"  [{stages}]")


def pi05_server_targets(results: List[Dict[str, Any]]) -> List[tuple]:
    """(label, measured, op, bound) rows of the targets for a moving robot: the fast server's latency, tail,
    captures and accuracy; the exact server never slower than unpatched sglang on the same loop."""
    rows = []
    own = [r for r in results if r.get("client") == "own" and r.get("p50_ms") is not None
           and r.get("motion") in ("random", "smooth")]
    for r in own:
        where = f"{r['server']} {r['wire']} {r['motion']}"
        if r["server"] == "ext-fast":
            bound = TARGET_OPENPI_P50_MS if r["wire"] == "openpi" else TARGET_JSON_P50_MS
            rows.append((f"{where}: client p50 ms", r["p50_ms"], "<=", bound))
            if r["wire"] == "openpi":
                rows.append((f"{where}: p99 / p50", r["p99_over_p50"], "<=", TARGET_P99_OVER_P50))
                if r.get("outside_pipeline_p50_ms") is not None:
                    rows.append((f"{where}: p50 outside the pipeline ms", r["outside_pipeline_p50_ms"], "<=",
                                 TARGET_OUTSIDE_MS))
            if r.get("max_rel_diff_vs_exact") is not None:
                rows.append((f"{where}: max relative difference from exact", r["max_rel_diff_vs_exact"], "<=",
                             TARGET_FAST_VS_EXACT))
        if r["server"].startswith("ext") and r.get("captures_after_start") is not None:
            rows.append((f"{where}: graphs captured after start", r["captures_after_start"], "<=", 0))
        if r["server"] == "ext-exact":
            unpatched = next((u for u in own if u["server"] in UPSTREAM_PI05_SERVERS and u["wire"] == r["wire"]
                              and u["motion"] == r["motion"]), None)
            if unpatched is not None:
                for q in ("p50_ms", "p99_ms"):
                    rows.append((f"{where}: {q[:-3]} ms vs unpatched {unpatched['server']}", r[q], "<=", unpatched[q]))
    return rows


# ViT graphs (bench_vit.py): its schema and tables.
# Every key bench_vit.py writes to --out.
_VIT_CONFIG_KEYS = ("tower", "dtype", "attention", "requests", "capacity", "max_bytes_arg", "seed", "command",
                    "unpatched_requests", "profile_requests", "resolutions_px", "images_per_request", "device",
                    "seconds")
_VIT_ROW_KEYS = ("mode", "run_id", "merged_later", "kernels", "requests", "tokens", "graph_req_per_s",
                 "eager_req_per_s", "speedup_vs_eager", "wrong_outputs", "bitwise_equal", "max_abs_diff",
                 "resident_graphs",
                 "peak_cuda_reserved_mib", "peak_graph_bytes_mib", "peak_graph_bytes_every_request", "timeline",
                 "hit_rate", "captures", "captures_before_timing", "evictions", "fallbacks", "graph_bytes_resident",
                 "counters", "timed_counters", "graph_bytes_budget_mib", "sglang_path", "padding", "crashed",
                 "crashed_at_request") + (
                 # The launch-free bound (profile_bound): device time of a sample of the stream, per request.
                 "profiled_requests", "eager_wall_ms", "eager_kernel_ms", "eager_device_ms", "eager_gpu_busy",
                 "launch_free_bound", "graph_wall_ms", "graph_kernel_ms", "graph_device_ms", "graph_gpu_busy",
                 "graph_bound", "profile_error")
# `kernels`: the packages loaded (kernels(): version / stand-in / not loaded) and what the
# tower really ran (kit.kernel_report(): attention backend, sgl_kernel ops or native torch, FA3 status).
VIT_KERNELS_SCHEMA = {**KERNELS_SCHEMA, "attention_backend": None, "sgl_kernel_ops": None, "fa3": None}
VIT_SCHEMA = {
    "config": dict.fromkeys(_VIT_CONFIG_KEYS),
    "results": [{**dict.fromkeys(_VIT_ROW_KEYS), "kernels": VIT_KERNELS_SCHEMA, "counters": ANY,
                 "timed_counters": ANY,
                 "timeline": [dict.fromkeys(("request", "resident_graphs", "graph_bytes_resident",
                                             "cuda_reserved_mib"))]}],
}


def vit_table(results) -> str:
    cols = ["mode", "attn/ops", "requests", "crashed_at_request", "graph_req_per_s", "eager_req_per_s", "speedup_vs_eager", "hit_rate", "captures",
            "resident_graphs", "peak_graph_bytes_mib", "peak_cuda_reserved_mib", "padding", "wrong_outputs",
            "bitwise_equal", "max_abs_diff"]
    rows = [cols] + [[_vit_cell(r.get(c) if c != "attn/ops" else _kernels_cell(r)) for c in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


VIT_BOUND_COLUMNS = (("mode", "mode"), ("profiled_requests", "profiled"), ("eager_wall_ms", "eager wall ms"),
                     ("eager_kernel_ms", "eager kernel ms"), ("eager_device_ms", "eager device ms"),
                     ("eager_gpu_busy", "eager GPU busy"), ("launch_free_bound", "bound (eager wall/device)"),
                     ("graph_wall_ms", "graph wall ms"), ("graph_kernel_ms", "graph kernel ms"),
                     ("graph_device_ms", "graph device ms"), ("graph_gpu_busy", "graph GPU busy"),
                     ("speedup", "speedup (sample)"), ("graph_bound", "graph bound (eager wall/graph device)"),
                     ("profile_error", "profile error"))


def vit_bound_table(results) -> str:
    """How far each mode is from the launch-free bound (per request, over the profiled sample)."""
    rows = [[label for _, label in VIT_BOUND_COLUMNS]]
    for r in results:
        if not r.get("profiled_requests"):
            continue
        speedup = r["eager_wall_ms"] / r["graph_wall_ms"] if r.get("graph_wall_ms") and r.get("eager_wall_ms") else None
        rows.append([_vit_cell(speedup if key == "speedup" else r.get(key)) for key, _ in VIT_BOUND_COLUMNS])
    if len(rows) == 1:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _kernels_cell(result) -> str:
    """What ran in that process: attention backend (fa3: real flash_ops or not) / sgl_kernel ops or torch."""
    k = result.get("kernels")
    if not k:
        return "-"
    attn = k.get("attention_backend", "?")
    if attn == "fa3":
        attn += "(flash_ops)" if "real flash_ops" in k.get("fa3", "") else "(NOT flash_ops)"
    return f"{attn}/{'sgl_kernel' if k.get('sgl_kernel_ops') == 'real' else 'torch'}"


def _vit_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def vit_mode_key(name: str) -> str:
    """The MODES entry of a result's display name ("ext-bucket (cap 32)" -> "bucket"; "0.5.19" stays)."""
    head = name.split(" ")[0]
    return head[len("ext-"):] if head.startswith("ext-") else head


# ViT graphs in the server (bench_vit_server.py): its schema and tables.
VIT_SERVER_CONFIGS = {  # name -> (launcher module, ViT graphs on, sglang-ext knobs)
    "ext": ("sglang_ext.launch_server", True, {}),
    "graphs-off": ("sglang.launch_server", False, {}),
    # The accuracy floor at concurrency 16: a second graphs-off process, with batches of its own timing
    # (without it, graphs-off's own further passes, which may repeat its batches).
    "graphs-off-2": ("sglang.launch_server", False, {}),
    "upstream-graphs-on": ("sglang.launch_server", True, {}),  # the release the run records (config.sglang)
    # Diagnostic: sglang-ext's sync-free tower and embedding path with no graph replayed (every call
    # eager), which splits ext's difference from graphs-off into the eager path's part and the replays'.
    "ext-no-replay": ("sglang_ext.launch_server", True, {"SGLANG_EXT_VIT_GRAPH_REPLAY_MAX_TOKENS": "0"}),
    # Diagnostic: calls above the load-time break-even split into whole-image chunks that replay instead of
    # one eager call (knob vit_graph_above_ladder=split): fewer host launches, more device time for padding.
    "ext-split": ("sglang_ext.launch_server", True, {"SGLANG_EXT_VIT_GRAPH_ABOVE_LADDER": "split"}),
    # Diagnostic: the whole ladder captured (up to the server's largest call, cut by the graph byte budget) and
    # every call replayed, no probe: an eager call costs the scheduler's thread 20-30 ms of launches (the probe's
    # eager times of small calls), a replay almost none, which may pay for the padding where the host bounds.
    "ext-full-ladder": ("sglang_ext.launch_server", True, {"SGLANG_EXT_VIT_GRAPH_REPLAY_MAX_TOKENS": str(1 << 20)}),
    # Diagnostic: sglang-ext with knob vit_triton_rotary off (sglang's own rotary functions), which gives the
    # one-kernel rotary's share. Runs recorded before the knob existed name this "ext".
    "ext-eager-rotary": ("sglang_ext.launch_server", True, {"SGLANG_EXT_VIT_TRITON_ROTARY": "0"}),
    # Ceiling: graphs off with a vision tower that answers zeros without running (scripts/server_trace.py),
    # so its req/s is what no ViT change (graphs, kernels) can take a slot past.
    "vit-free": ("sglang.launch_server", False, {"SGX_SERVER_VIT_FREE": "1"}),
}
# Names in results files written before the release-neutral ones: shown as written, ordered as the new name.
LEGACY_NAMES = {"0517-graphs-on": "upstream-graphs-on", "0517": "upstream"}
UPSTREAM_PI05_SERVERS = ("upstream", "0517")  # unpatched `sglang serve` (bench_pi05_server.py)


def _in_config_order(names) -> list:
    order = {name: i for i, name in enumerate(VIT_SERVER_CONFIGS)}
    known = sorted((n for n in names if LEGACY_NAMES.get(n, n) in order), key=lambda n: order[LEGACY_NAMES.get(n, n)])
    return known + sorted(set(names) - set(known))


def stand_ins() -> list:
    """The packages this environment replaces with stand-ins (scripts/gpu_env.sh's SGX_STANDINS), sorted."""
    return sorted({n.strip() for n in os.environ.get("SGX_STANDINS", "").split(",") if n.strip()})


VIT_SERVER_SCHEMA = {
    "run_id": None, "kernels": KERNELS_SCHEMA, "attention": None,
    "config": {"device": None, "model": None, "parameters_b": None, "requests": None, "passes": None,
               "concurrencies": None, "image_counts": None, "resolution": None, "command": None, "seconds": None,
               "sglang": None, "accuracy_sizes": None, "stand_ins": None},
    "servers": [{"backend": None, "config": None, "startup_s": None, "error": None, "metrics_start": ANY,
                 "metrics_warm": ANY, "metrics_after_passes": ANY,
                 "metrics_end": ANY, "vit_calls": None, "captures_after_start": None,
                 "warmup_syncs": ANY, "kv_tokens": None, "reserved_mib_after_pass": None}],
    "passes": [{"backend": None, "config": None, "pass": None, "concurrency": None, "images": None,
                "req_s": None, "ttft_p50_ms": None, "ttft_p99_ms": None, "completed": None, "error": None,
                "trace": ANY}],
    "accuracy": [{"backend": None, "config": None, "concurrency": None, "requests": None, "samples": None,
                  "max_abs": None, "beyond_0_05": None, "floor_max_abs": None, "floor_beyond_0_05": None,
                  "floor_server": None, "error": None}],
}


def _spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def _by_slot(report: dict, field: str = "req_s") -> Dict[tuple, Dict[str, List[float]]]:
    """{(backend, concurrency, images): {config: `field` of each completed pass}}."""
    slots: Dict[tuple, Dict[str, List[float]]] = {}
    for row in report["passes"]:
        if row.get(field) is not None:
            slots.setdefault((row["backend"], row["concurrency"], row["images"]), {}).setdefault(
                row["config"], []).append(row[field])
    return dict(sorted(slots.items()))


def ratios(report: dict, config: str = "ext") -> Dict[tuple, float]:
    """{(backend, concurrency, images): median req/s of `config` / median of graphs-off} over the passes."""
    out = {}
    for slot, by in _by_slot(report).items():
        off = statistics.median(by["graphs-off"]) if "graphs-off" in by else 0.0
        if config in by and off > 0:
            out[slot] = statistics.median(by[config]) / off
    return out


def ttft_p99(report: dict, config: str) -> Dict[tuple, float]:
    """{(backend, concurrency, images): `config`'s TTFT p99 in ms, the median over the passes}."""
    return {slot: statistics.median(by[config]) for slot, by in _by_slot(report, "ttft_p99_ms").items()
            if config in by}


def paired_ratios(report: dict, config: str = "ext") -> Dict[tuple, float]:
    """{(backend, concurrency, images): median over the passes of `config`'s req/s / graphs-off's in the same
    pass}. The configurations of a pass run back to back, so this cancels the machine's drift between passes."""
    by_pass: Dict[tuple, Dict[str, float]] = {}
    for row in report["passes"]:
        if row["req_s"] is not None:
            by_pass.setdefault((row["backend"], row["concurrency"], row["images"], row["pass"]), {})[
                row["config"]] = row["req_s"]
    per_slot: Dict[tuple, List[float]] = {}
    for (*slot, _), by in sorted(by_pass.items()):
        if config in by and by.get("graphs-off"):
            per_slot.setdefault(tuple(slot), []).append(by[config] / by["graphs-off"])
    return {slot: statistics.median(values) for slot, values in per_slot.items()}


def below_graphs_off(report: dict, config: str = "ext") -> List[tuple]:
    """Slots where `config`'s median req/s is below the slowest graphs-off pass: slower than graphs-off by
    more than graphs-off's own pass-to-pass spread (a median a hair under graphs-off's is noise here)."""
    return [slot for slot, by in _by_slot(report).items()  # one graphs-off pass has no spread
            if config in by and "graphs-off" in by and statistics.median(by[config]) < min(by["graphs-off"])]


def eligible_replayed(server: dict) -> float:
    """Share of the calls a graph may serve that replayed, from the end of the warm-up (else the start) to the
    end: calls the load-time gate sends eager on purpose (above the break-even) are not eligible. None
    without counters."""
    end, start = server.get("metrics_end") or {}, server.get("metrics_warm") or server.get("metrics_start") or {}
    if "graph_gate_fallbacks_total" not in end:
        return None
    delta = {k: end.get(k, 0) - start.get(k, 0) for k in ("graph_hits_total", "graph_eager_fallbacks_total",
                                                        "graph_gate_fallbacks_total")}
    eligible = delta["graph_hits_total"] + delta["graph_eager_fallbacks_total"] - delta["graph_gate_fallbacks_total"]
    return delta["graph_hits_total"] / eligible if eligible > 0 else None


def accuracy_requests(report: dict, backend: str, config: str) -> int:
    """Requests `config` served in the accuracy comparison: its rows' passes (the floor's row is its floor
    passes), and graphs-off's reference pass at each concurrency (with its floor passes where it was the floor)."""
    rows = [a for a in report.get("accuracy") or [] if a["backend"] == backend]
    served = sum(a["requests"] * (a.get("samples") or 1) for a in rows if a["config"] == config and not a.get("error"))
    if config == "graphs-off":
        by_c = {a["concurrency"]: a for a in rows}
        served += sum(a["requests"] * (1 + ((a.get("samples") or 1) if floor_source(a) == "graphs-off" else 0))
                      for a in by_c.values())
    return served


def reserved_growth(report: dict, server: dict):
    """(MiB the server's reserved memory grew from the end of its warm-up to the end of its timed passes,
    else to the end of the run, requests it served in between), or None without both readings
    (sglang-ext's /metrics; with --trace any server's)."""
    warm, end = (server.get("metrics_warm") or {}).get("cuda_memory_reserved_bytes"), _reserved_at_end(server)
    if not warm or not end:
        return None
    mine = (server["backend"], server["config"])
    served = sum(r.get("completed") or 0 for r in report["passes"] if (r["backend"], r["config"]) == mine)
    if not server.get("metrics_after_passes"):  # judged to the end of the run: the accuracy requests too
        served += accuracy_requests(report, *mine)
    return (end - warm) / 2**20, served


def _reserved_at_end(server: dict):
    """The server's reserved bytes at the end of its timed passes, else of the run (None: no reading)."""
    return (server.get("metrics_after_passes") or server.get("metrics_end") or {}).get("cuda_memory_reserved_bytes")


def server_of(report: dict, config: str, backend: str):
    """The record of `config`'s server on `backend` in the run, or None."""
    return next((s for s in report["servers"] if s["config"] == config and s["backend"] == backend), None)


def reserved_against(report: dict, server: dict, config: str = "graphs-off"):
    """(MiB `server` reserved beyond `config`'s server of its backend at the end of the timed passes, else of
    the run; the same at start-up), or None without both servers' readings or where either one failed."""
    other = server_of(report, config, server["backend"])
    if other is None or server.get("error") or other.get("error"):  # a dead server's last reading is older
        return None

    ends = [_reserved_at_end(r) for r in (server, other)]
    starts = [(r.get("metrics_start") or {}).get("cuda_memory_reserved_bytes") for r in (server, other)]
    if not all(ends + starts):
        return None
    return (ends[0] - ends[1]) / 2**20, (starts[0] - starts[1]) / 2**20


def unequal_kv_pools(report: dict) -> Dict[str, Dict[str, int]]:
    """{backend: {config: KV tokens}} where that backend's servers hold KV pools of different sizes (their
    req/s at high concurrency then differ by batching, not by the ViT). Runs before kv_tokens: none."""
    pools: Dict[str, Dict[str, int]] = {}
    for s in report["servers"]:
        if s.get("kv_tokens"):
            pools.setdefault(s["backend"], {})[s["config"]] = s["kv_tokens"]
    return {b: by for b, by in pools.items() if len(set(by.values())) > 1}


def vit_server_table(report: dict) -> str:
    """Medians (min-max) per backend, concurrency and image count; ratios against graphs-off (of the medians,
    and the median of each pass's own ratio)."""
    lines = [f"{'backend':<12} {'c':>3} {'img':>4} {'config':<18} {'req/s median (min-max)':>26} {'vs off':>7} "
             f"{'per pass':>8} {'TTFT p50':>9} {'TTFT p99':>9}"]
    paired = {name: paired_ratios(report, name) for name in {r["config"] for r in report["passes"]}}
    groups = {}
    for row in report["passes"]:
        groups.setdefault((row["backend"], row["concurrency"], row["images"]), {}).setdefault(row["config"], []).append(row)
    for (backend, c, images), by_config in sorted(groups.items()):
        off = _spread(r["req_s"] for r in by_config.get("graphs-off", []))[0]
        for name in _in_config_order(by_config):
            rows = by_config.get(name, [])
            med, lo, hi = _spread(r["req_s"] for r in rows)
            if med is None:
                lines.append(f"{backend:<12} {c:>3} {images:>4} {name:<18} {'failed':>26}")
                continue
            p50 = _spread(r["ttft_p50_ms"] for r in rows)[0]
            p99 = _spread(r["ttft_p99_ms"] for r in rows)[0]
            ratio = f"{med / off:.2f}x" if off else "-"
            per_pass = paired[name].get((backend, c, images))
            per_pass = "-" if per_pass is None else f"{per_pass:.2f}x"
            lines.append(f"{backend:<12} {c:>3} {images:>4} {name:<18} {f'{med:.2f} ({lo:.2f}-{hi:.2f})':>26} "
                         f"{ratio:>7} {per_pass:>8} {p50:>9.1f} {p99:>9.1f}")
    lines.append("")
    lines.append(f"{'backend':<12} {'config':<18} {'start s':>8} {'ViT calls':>9} {'captures after start':>21} "
                 f"{'hits':>6} {'fallbacks':>9} {'chunked':>7} {'padding':>8} {'graph MiB':>9} {'reserved MiB':>12} "
                 f"{'eligible replayed':>17} {'reserved +MiB after warm-up':>27} {'KV tokens':>9}")
    for s in report["servers"]:
        end, start_m = s.get("metrics_end") or {}, s.get("metrics_start") or {}
        if s.get("error"):
            lines.append(f"{s['backend']:<12} {s['config']:<18} error: {s['error'][:80]}")
            continue
        lines.append(f"{s['backend']:<12} {s['config']:<18} {s['startup_s'] or 0:>8.0f} {s['vit_calls'] or 0:>9.0f} "
                     f"{s['captures_after_start'] or 0:>21.0f} {end.get('graph_hits_total', 0):>6.0f} "
                     f"{end.get('graph_eager_fallbacks_total', 0) - start_m.get('graph_eager_fallbacks_total', 0):>9.0f}"
                     f" {_chunked_cell(end):>7}"
                     f" {end.get('graph_padding_tokens_total', 0):>8.0f} "
                     f"{end.get('graph_resident_bytes', 0) / 2**20:>9.1f} "
                     f"{end.get('cuda_memory_reserved_bytes', 0) / 2**20:>12.0f} "
                     f"{_share_cell(s):>17} {_growth_cell(report, s):>27} {s.get('kv_tokens') or '-':>9}")
    for backend, by in unequal_kv_pools(report).items():
        lines.append(f"WARNING {backend}: the servers' KV pools differ ("
                     + ", ".join(f"{n} {t}" for n, t in by.items()) + "): req/s are not comparable")
    lines += trace_table(report)
    if report.get("accuracy"):
        lines.append("")
        lines.append(f"{'backend':<12} {'config':<18} {'c':>3} {'requests':>8} {'max |dlogprob|':>15} "
                     f"{'> 0.05':>7} {'floor (off vs off)':>19} {'samples':>7} floor from")
        for a in report["accuracy"]:
            if a.get("error"):
                lines.append(f"{a['backend']:<12} {a['config']:<18} {a['concurrency']:>3} error: {a['error'][:70]}")
                continue
            floor = "-" if a["floor_max_abs"] is None else f"{a['floor_max_abs']:.4f}" + (
                "" if a.get("floor_beyond_0_05") is None else f" ({a['floor_beyond_0_05']} > 0.05)")
            lines.append(f"{a['backend']:<12} {a['config']:<18} {a['concurrency']:>3} {a['requests']:>8} "
                         f"{a['max_abs']:>15.4f} {a['beyond_0_05']:>7} {floor:>19} {a.get('samples') or 1:>7} "
                         f"{floor_source(a) or '-'}")
    return "\n".join(lines)


def floor_source(row: dict):
    """The server whose passes gave `row`'s floor (runs before graphs-off-2 existed: graphs-off), or None."""
    if row.get("floor_max_abs") is None:
        return None
    return row.get("floor_server") or "graphs-off"


def _chunked_cell(end: dict) -> str:
    """Calls split into chunks, to the end ("-": a run from before the counter was published)."""
    return "-" if "graph_chunked_calls_total" not in end else f"{end['graph_chunked_calls_total']:.0f}"


def _share_cell(server: dict) -> str:
    share = eligible_replayed(server)
    return "-" if share is None else f"{share:.1%}"


def _growth_cell(report: dict, server: dict) -> str:
    growth = reserved_growth(report, server)
    return "-" if growth is None else f"{growth[0]:+.0f} ({growth[1]} req)"


def trace_table(report: dict) -> List[str]:
    """Where each server's scheduler spent its time (--trace), medians over the passes.

    Per request: the scheduler's host time launching batches (run_batch: the ViT runs inside it) and
    its forwards' device span. Per ViT call: tokens, host time, device span (for a replay: its device
    time; for eager: about its host time, which the launches bound).
    """
    groups = {}
    for row in report["passes"]:
        trace, done = row.get("trace"), row.get("completed")
        if not trace or not done:
            continue
        calls = max(trace.get("vit_host_ms", [0, 0])[1], 1)
        per = dict(launch=trace.get("run_batch_host_ms", [0, 0])[0] / done,
                   span=trace.get("forward_device_ms", [0, 0])[0] / done,
                   calls=trace.get("vit_host_ms", [0, 0])[1], tokens=trace.get("vit_tokens", [0, 0])[0] / calls,
                   vit_host=trace.get("vit_host_ms", [0, 0])[0] / calls,
                   vit_span=trace.get("vit_device_ms", [0, 0])[0] / calls)
        groups.setdefault((row["backend"], row["concurrency"], row["images"], row["config"]), []).append(per)
    if not groups:
        return []
    lines = ["", "scheduler (median over passes): per request, host ms launching batches and forward device span; "
             "per ViT call: tokens, host ms, device span ms",
             f"{'backend':<12} {'c':>3} {'img':>4} {'config':<18} {'launch/req':>10} {'span/req':>9} {'ViT calls':>9} "
             f"{'tok/call':>8} {'ViT host':>8} {'ViT span':>8}"]
    for (backend, c, images, name), rows in sorted(groups.items()):
        m = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        lines.append(f"{backend:<12} {c:>3} {images:>4} {name:<18} {m['launch']:>10.1f} {m['span']:>9.1f} "
                     f"{m['calls']:>9.0f} {m['tokens']:>8.0f} {m['vit_host']:>8.1f} {m['vit_span']:>8.1f}")
    syncs = [(s["config"], s["warmup_syncs"]) for s in report["servers"] if s.get("warmup_syncs")]
    for name, sites in syncs:
        lines.append(f"device syncs inside forwards during {name}'s warm-up: " + "; ".join(
            f"{site.split(' < ')[0]} x{count}" for site, count in sorted(sites.items(), key=lambda kv: -kv[1])))
    return lines


# Prefill context-parallel bucket choice (bench_prefill_cp.py): its schema and tables.
def prefill_cp_table(decision_rows, rate_rows) -> str:
    out = ["Per-batch decision, median us (target <= 10 us); upstream = its loop, run twice per batch"]
    out.append(f"{'cp':>3} {'bs':>3} {'tokens':>6} {'ext us':>8} {'(best)':>7} {'upstream x2 us':>15} {'(best)':>7}")
    for r in decision_rows:
        out.append(f"{r['cp']:>3} {r['bs']:>3} {r['num_tokens']:>6} {r['ext_decision_us']:>8.2f} "
                   f"{r['ext_decision_best_us']:>7.2f} {r['upstream_twice_us']:>15.2f} "
                   f"{r['upstream_twice_best_us']:>7.2f}")
    out.append("")
    out.append("Admission over random multi-request batches (rates of all batches)")
    out.append(f"{'cp':>3} {'0.5.17 graph':>12} {'0.5.17 crash':>12} {'ext graph':>10} {'ext larger':>10} "
               f"{'ext eager(no fit)':>17} {'pad rows 0.5.17/ext':>20}")
    for r in rate_rows:
        n = r["batches"]
        out.append(f"{r['cp']:>3} {r['unpatched_graph_rate']:>12.3f} {r['unpatched_crash_rate']:>12.3f} "
                   f"{r['ext_graph_rate']:>10.3f} {r['ext_larger_bucket_rate']:>10.3f} "
                   f"{r['ext']['eager_no_fit'] / n:>17.3f} "
                   f"{r['unpatched_mean_padding_rows']:>9.1f}/{r['ext_mean_padding_rows']:.1f}")
    return "\n".join(out)


# Every key bench_prefill_cp.py writes to --out.
PREFILL_CP_SCHEMA = {
    **dict.fromkeys(("run_id", "bench", "sglang", "python", "machine", "cpus", "load_average_1m", "max_tokens",
                     "align", "command", "attention")),
    "kernels": KERNELS_SCHEMA,
    "decision": [dict.fromkeys(("cp", "bs", "num_tokens", "buckets", "ext_decision_us", "ext_decision_best_us",
                                "upstream_twice_us", "upstream_twice_best_us"))],
    "admission": [{**dict.fromkeys(("cp", "batches", "unpatched_crash_rate", "unpatched_graph_rate", "ext_graph_rate",
                                    "ext_larger_bucket_rate", "ext_mean_padding_rows",
                                    "unpatched_mean_padding_rows")),
                   "unpatched": dict.fromkeys(("graph", "crash", "eager")),
                   "ext": dict.fromkeys(("graph", "graph_larger", "eager_no_fit", "eager"))}],
}
# The results files (docs/bench) each schema declares.
SCHEMA_OF = {"pi05_*.json": PI05_SCHEMA, "vit.json": VIT_SCHEMA, "vit_server*.json": VIT_SERVER_SCHEMA,
             "prefill_cp.json": PREFILL_CP_SCHEMA, "server_pi05*.json": PI05_SERVER_SCHEMA}
