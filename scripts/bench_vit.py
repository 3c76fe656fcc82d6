"""ViT CUDA-graph benchmark: sglang 0.5.17's runner vs the vit_cuda_graph patch.

sglang's real Qwen2.5-VL vision tower (Qwen2.5-VL-7B's vision config, random weights, bf16)
on the vision attention backend sglang picks on the machine (--backend auto: fa3 on SM90, the
FlashAttention-3 of sgl_kernel's flash_ops, else triton_attn) is fed a stream of requests of
1-4 images at common photo resolutions. Every request runs through the graph runner AND
sglang's eager path; the outputs are compared. Modes:

  eager        sglang's eager tower (the baseline timings, measured on the same requests in every
               mode's process, interleaved with the graph runs)
  eager-only   a process that runs only sglang's eager tower (no graph runner): a second baseline,
               free of any interference between graph and eager runs in one process
  0.5.17       the runner as shipped: graphs keyed by token count, unbounded
  0.5.19       upstream's runner (layout keys, unbounded, private pools); needs --upstream-root
  ext-layout   the patch: graphs keyed by (tokens, attention layout), LRU capacity --capacity
  ext-class    the patch in layout-class mode: graphs shared by layouts with the same token
               count, sequence-count class and max-length class, boundaries refreshed per replay
  ext-bucket   layout-class mode with token counts padded to the default 16-size ladder (512 x
               1.26^k; padding is its own attention sequence): on fa3 one graph per bucket, the
               ladder captured at the runner's first run

Each mode runs in its own process, which first runs an untimed warm-up (8 eager requests of
another stream, then one graph-path request: kernel JIT/autotune, and the fa3 ladder capture,
land there); counters and timings cover the timed stream only. A request is a hit when it
replays a graph that existed before it. After the timed stream, --profile-requests requests
spread over it rerun untimed under torch.profiler (CUDA activity) to measure the launch-free
bound: a graph removes launch and host overhead only, so no mode beats eager's device time
(bound = eager wall / eager device ms per request; for modes that replayed every request, the
graph path's own device time, padding rows included; see profile_bound and
bench_results.vit_bound_table). Each result records the kernels its process really ran (detected
at run time) and the run id it belongs to. Rewrites the JSON (--out) after every mode, refusing
keys its schema (bench_results.VIT_SCHEMA) lacks, and prints the tables last. On the GPU machine
(docs/gpu-harness.md):

    source scripts/gpu_env.sh && python3 scripts/bench_vit.py --upstream-root $SGX_ROOT/sgl0519 --out $OUT/vit.json
    (every mode, 1,000 requests: about 7 minutes on one H200 with fa3; --quick, 300 requests and 100
    for 0.5.17 / 0.5.19: 193 s measured without 0.5.19; the ext modes alone, 1,000 requests:
    --modes 0.5.17,0.5.19,eager-only,bucket, about 4 minutes, estimated from the --quick run)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

import bench_results  # noqa: E402
from sglang_ext_testkit import qwen_vit_kit as kit  # noqa: E402

# (width px, height px, weight): Qwen2.5-VL resizes to multiples of 28 px = 2 patches.
RESOLUTIONS = [(448, 448, 8), (640, 480, 6), (336, 336, 4), (1024, 768, 2), (800, 600, 3), (224, 224, 2),
               (560, 420, 2), (1280, 720, 1)]
IMAGES_PER_REQUEST = ([1, 2, 3, 4], [60, 25, 10, 5])


def patches_per_side(px: int) -> int:
    return max(2, round(px / 28) * 2)


def request_stream(n: int, seed: int):
    """n requests as (tokens, grid_thw rows, pixel seed)."""
    rng = random.Random(seed)
    for _ in range(n):
        count = rng.choices(*IMAGES_PER_REQUEST)[0]
        grid = []
        for _ in range(count):
            w, h, _ = rng.choices(RESOLUTIONS, [r[2] for r in RESOLUTIONS])[0]
            grid.append([1, patches_per_side(h), patches_per_side(w)])
        tokens = sum(t * h * w for t, h, w in grid)
        yield tokens, grid, rng.randrange(2**31)


def pixels_for(tokens: int, seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 3 * 2 * 14 * 14, generator=g).to(dtype)


def kernels_now(backend: str) -> dict:
    """This process's `kernels` record (see bench_results.VIT_KERNELS_SCHEMA)."""
    ran = kit.kernel_report(backend)  # first: it imports the packages it probes
    return {**bench_results.kernels(), **ran}


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def warm_up(vit, dtype, seed: int, *, graph: bool) -> None:
    """Untimed: eager over 8 requests of another stream, then one graph-path request."""
    warm = list(request_stream(8, seed + 10_000))
    for tokens, grid, pixel_seed in warm:
        kit.forward(vit, pixels_for(tokens, pixel_seed, dtype), torch.tensor(grid, dtype=torch.int64), graph=False)
    if graph:
        tokens, grid, pixel_seed = warm[0]
        kit.forward(vit, pixels_for(tokens, pixel_seed, dtype), torch.tensor(grid, dtype=torch.int64), graph=True)
    torch.cuda.synchronize()


_COUNTED = ("hits", "misses", "captures", "evictions", "fallbacks", "padding_tokens", "real_tokens")


def _engine(runner):
    """The sglang-ext engine of a runner (None for sglang's own runners)."""
    return getattr(runner, "engine", None)


def _resident(runner) -> int:
    engine = _engine(runner)
    return len(engine.store.graphs) if engine is not None else len(runner.block_graphs)


def run_mode(name: str, vit, requests, *, dtype, tol: float, sample_every: int, progress=None, walls=None):
    """The timed stream through the graph runner and eager; `walls` gets each request's seconds per path."""
    runner = vit.cuda_graph_runner
    progress = {} if progress is None else progress
    walls = {} if walls is None else walls
    walls.update(graph=[], eager=[])
    # Counters after the warm-up: the timed stream's own are the differences.
    engine = _engine(runner)
    after_warm_up = {k: engine.info()[k] for k in _COUNTED} if engine is not None else {}
    graph_s = eager_s = 0.0
    tokens_total = wrong = bitwise = 0
    new_graphs = 0  # unbounded runners: a request that added a graph was a miss
    ext_cache = engine.cache if engine is not None else None
    peak_graph_bytes = 0
    worst = 0.0
    timeline = []
    for i, (tokens, grid, seed) in enumerate(requests):
        pixels = pixels_for(tokens, seed, dtype)
        grid_thw = torch.tensor(grid, dtype=torch.int64)
        progress["requests_done"] = i
        progress["wrong_outputs_so_far"] = wrong
        before = _resident(runner)
        graphed, dt_graph = timed(lambda: kit.forward(vit, pixels, grid_thw, graph=True))
        new_graphs += _resident(runner) > before
        if ext_cache is not None:
            peak_graph_bytes = max(peak_graph_bytes, ext_cache.info().bytes_resident)
        eager, dt_eager = timed(lambda: kit.forward(vit, pixels, grid_thw, graph=False))
        graph_s += dt_graph
        eager_s += dt_eager
        walls["graph"].append(dt_graph)
        walls["eager"].append(dt_eager)
        tokens_total += tokens
        diff = (graphed.float() - eager.float()).abs().max().item() if graphed.shape == eager.shape else float("inf")
        worst = max(worst, diff)
        wrong += diff > tol
        bitwise += bool(graphed.shape == eager.shape and torch.equal(graphed, eager))
        if i % sample_every == 0 or i == len(requests) - 1:
            resident = _resident(runner)
            ext = engine.info() if engine is not None else None
            timeline.append({"request": i + 1, "resident_graphs": resident,
                             "graph_bytes_resident": ext["bytes_resident"] if ext else None,
                             "cuda_reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1)})
    n = len(requests)
    result = {
        "mode": name, "requests": n, "tokens": tokens_total,
        "graph_req_per_s": n / graph_s, "eager_req_per_s": n / eager_s, "speedup_vs_eager": eager_s / graph_s,
        "wrong_outputs": wrong, "bitwise_equal": bitwise, "max_abs_diff": worst,
        "resident_graphs": _resident(runner),
        "peak_cuda_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1),
        "peak_graph_bytes_mib": round(peak_graph_bytes / 2**20, 1) if ext_cache is not None else None,
        "peak_graph_bytes_every_request": ext_cache is not None,  # else the peak is a lower bound
        "timeline": timeline,
    }
    if engine is not None:
        info = engine.info()
        timed_counts = {k: info[k] - after_warm_up.get(k, 0) for k in _COUNTED}
        lookups = timed_counts["hits"] + timed_counts["misses"]
        result.update(hit_rate=timed_counts["hits"] / lookups if lookups else 0.0, captures=timed_counts["captures"],
                      captures_before_timing=info["captures"] - timed_counts["captures"],
                      evictions=timed_counts["evictions"], fallbacks=timed_counts["fallbacks"],
                      graph_bytes_resident=info["bytes_resident"], graph_bytes_budget_mib=round(
                          engine.cache.max_bytes / 2**20, 1) if engine.cache.max_bytes else None,
                      counters=info, timed_counters=timed_counts)
    else:  # unbounded runner (0.5.17 / 0.5.19): graphs are never evicted
        result.update(hit_rate=1 - new_graphs / n if n else 0.0, captures=len(runner.block_graphs))
    return result


def device_time(activities) -> dict:
    """Summed kernel time and device-busy time (union of kernel, memcpy and memset intervals), in ms.

    activities: (name, start_ns, end_ns) of every device activity (integers: epoch nanoseconds
    would lose sub-microsecond precision as floats). Busy time is what no launch overhead can
    hide: a launch-free run of the same work takes at least that long.
    """
    kernel_ns = busy_ns = 0
    reach = None
    for name, start, end in sorted(activities, key=lambda a: a[1]):
        if not name.startswith(("Memcpy", "Memset")):
            kernel_ns += end - start
        if reach is None or end > reach:
            busy_ns += end - (start if reach is None else max(start, reach))
            reach = end
    return {"kernel_ms": kernel_ns / 1e6, "device_ms": busy_ns / 1e6}


def _device_activities(prof):
    """(name, start_ns, end_ns) of the device activities torch.profiler recorded (kernels in graphs too)."""
    from torch.autograd import DeviceType

    try:
        events = prof.profiler.kineto_results.events()  # raw records: fast, no FunctionEvent tree
        return [(e.name(), e.start_ns(), e.start_ns() + e.duration_ns()) for e in events
                if e.device_type() == DeviceType.CUDA and e.activity_type() != "gpu_user_annotation"]
    except AttributeError:  # another torch: the parsed events (microseconds since the profile began)
        return [(e.name, round(e.time_range.start * 1000), round(e.time_range.end * 1000)) for e in prof.events()
                if e.device_type == DeviceType.CUDA]


def profile_device(run_request, indices) -> dict:
    """Device time per request of `run_request(i)` over `indices` (torch.profiler, CUDA activity only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in indices:
            run_request(i)
        torch.cuda.synchronize()
    activities = _device_activities(prof)
    if not activities:
        raise RuntimeError("the profiler recorded no device activity (CUPTI not loaded?)")
    return {k: v / len(indices) for k, v in device_time(activities).items()}


def _misses(vit):
    """Graph misses of an sglang-ext runner so far (None for other runners)."""
    engine = _engine(getattr(vit, "cuda_graph_runner", None))
    return None if engine is None else engine.info()["misses"]


def profile_bound(vit, requests, walls, count: int, *, dtype, graph: bool) -> dict:
    """The launch-free bound, measured on `count` requests spread over the stream (untimed reruns).

    A CUDA graph removes launch and host overhead only, so no graph mode beats the eager path's
    device-busy time: launch_free_bound = eager wall / eager device time. For the graph path
    (`graph`: only where every replay hits, so nothing is captured under the profiler) its own
    device time, padding rows included: graph_bound = eager wall / graph device time, and
    graph_gpu_busy = how much of that bound the graph path reaches. Walls are the timed stream's
    (unprofiled) seconds of the same requests.
    """
    count = min(count, len(requests))
    if count <= 0:
        return {}
    indices = [i * len(requests) // count for i in range(count)]

    def request(i, graph_path):
        tokens, grid, seed = requests[i]
        kit.forward(vit, pixels_for(tokens, seed, dtype), torch.tensor(grid, dtype=torch.int64), graph=graph_path)

    out = {"profiled_requests": count}
    paths = ("eager", "graph") if graph else ("eager",)
    try:
        for path in paths:
            misses = _misses(vit)
            timing = profile_device(lambda i: request(i, path == "graph"), indices)
            if path == "graph" and _misses(vit) != misses:
                raise RuntimeError("the graph path missed during its profile")
            wall_ms = 1000.0 * sum(walls[path][i] for i in indices) / count
            out.update({f"{path}_wall_ms": wall_ms, f"{path}_kernel_ms": timing["kernel_ms"],
                        f"{path}_device_ms": timing["device_ms"], f"{path}_gpu_busy": timing["device_ms"] / wall_ms})
    except Exception as exc:  # noqa: BLE001 - the throughput result stands without the bound
        out["profile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if out.get("eager_device_ms"):
        out["launch_free_bound"] = out["eager_wall_ms"] / out["eager_device_ms"]
        if out.get("graph_device_ms"):
            out["graph_bound"] = out["eager_wall_ms"] / out["graph_device_ms"]
    return out


def activate_patch(capacity: int, mode: str, max_bytes: int) -> None:
    """The patch, strict, alone; max_bytes -1 = its default budget (a quarter of free memory, <= 4 GiB)."""
    from sglang_ext import activation
    from sglang_ext.registry import PATCH_NAMES
    from sglang_ext.versions import installed_sglang_version

    os.environ["SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES"] = str(capacity)
    os.environ["SGLANG_EXT_VIT_GRAPH_MAX_BYTES"] = str(max_bytes)
    os.environ["SGLANG_EXT_VIT_GRAPH_MODE"] = mode  # read when a runner is first used
    os.environ["SGLANG_EXT_DISABLE"] = ",".join(n for n in PATCH_NAMES if n != "vit_cuda_graph")
    os.environ["SGLANG_EXT_STRICT"] = "1"
    if installed_sglang_version() is None:
        os.environ.setdefault("SGLANG_EXT_ASSUME_SGLANG", "0.5.17")
    statuses = activation.activate(force=True, eager=True)
    assert statuses["vit_cuda_graph"].state == "applied", statuses["vit_cuda_graph"]


MODES = ("0.5.17", "0.5.19", "eager-only", "layout", "class", "bucket")


def _child_env(args, mode: str) -> dict:
    """The 0.5.19 mode imports upstream's sglang tree in place of the installed one."""
    env = dict(os.environ)
    if mode == "0.5.19":
        import sglang

        installed = os.path.dirname(os.path.dirname(os.path.abspath(sglang.__file__)))
        upstream = os.path.abspath(args.upstream_root)
        parts = [upstream if os.path.abspath(p) == installed else p
                 for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(parts if upstream in parts else [upstream] + parts)
        env.pop("SGLANG_EXT", None)  # upstream as released: the plugin stays off
    return env


def _child_command(args, mode: str, part_out: str) -> list:
    """Re-run this script for one mode, through the stand-in fallback if this process runs under it."""
    cmd = [sys.executable]
    if any(type(f).__name__ == "StandInFinder" for f in sys.meta_path):  # python3 -m sglang_ext_testkit.stand_ins
        cmd += ["-m", "sglang_ext_testkit.stand_ins"]
    cmd += [os.path.abspath(__file__), "--mode", mode, "--part-out", part_out, "--requests", str(args.requests),
            "--unpatched-requests", str(args.unpatched_requests), "--capacity", str(args.capacity),
            "--max-bytes", str(args.max_bytes), "--seed", str(args.seed), "--backend", args.backend,
            "--profile-requests", str(args.profile_requests)]
    return cmd


def run_eager_only(args, config, requests, dtype) -> None:
    """sglang's eager tower alone in this process, on the same requests (second eager baseline)."""
    vit = kit.build_qwen2_5_tower(config, dtype=dtype, seed=1, graphs=False)
    warm_up(vit, dtype, args.seed, graph=False)
    walls = {"eager": []}
    for tokens, grid, seed in requests:
        pixels = pixels_for(tokens, seed, dtype)
        _, dt = timed(lambda: kit.forward(vit, pixels, torch.tensor(grid, dtype=torch.int64), graph=False))
        walls["eager"].append(dt)
    result = {"mode": "eager-only", "requests": len(requests), "tokens": sum(r[0] for r in requests),
              "eager_req_per_s": len(requests) / sum(walls["eager"]),
              "peak_cuda_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1),
              "kernels": kernels_now(args.backend)}
    _write_part(args, result)
    result.update(profile_bound(vit, requests, walls, args.profile_requests, dtype=dtype, graph=False))
    _write_part(args, result)


def _write_part(args, result) -> None:
    """This mode's result for the parent; written before the profile too, so a profiler crash loses only the bound."""
    with open(args.part_out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


def run_one_mode(args) -> None:
    """One mode in this process. A crash (0.5.17 can replay a stale layout into an illegal
    memory access, which kills the CUDA context) is recorded instead of lost."""
    config = kit.QWEN2_5_VL_7B_CONFIG
    n = args.requests
    dtype = torch.bfloat16
    tol = 5e-2  # bf16; a stale layout is off by O(1)
    requests = list(request_stream(n, args.seed))
    os.environ["SGLANG_VIT_ENABLE_CUDA_GRAPH"] = "1"
    kit.publish_runtime(args.backend)
    kit.init_single_rank_parallel_state()
    if args.mode == "eager-only":
        run_eager_only(args, config, requests, dtype)
        return
    if args.mode in ("0.5.17", "0.5.19"):  # unbounded runners: fewer requests
        import sglang

        name, requests = args.mode, requests[: min(n, args.unpatched_requests)]
        sglang_path = os.path.dirname(os.path.abspath(sglang.__file__))
    else:
        activate_patch(args.capacity, args.mode, args.max_bytes)
        name = f"ext-{args.mode} (cap {args.capacity})"
        sglang_path = None
    progress: dict = {}
    try:
        vit = kit.build_qwen2_5_tower(config, dtype=dtype, seed=1)
        assert vit.blocks[0].attn.qkv_backend_name == args.backend, vit.blocks[0].attn.qkv_backend_name
        warm_up(vit, dtype, args.seed, graph=True)
        walls: dict = {}
        result = run_mode(name, vit, requests, dtype=dtype, tol=tol,
                          sample_every=max(1, len(requests) // 20), progress=progress, walls=walls)
        if sglang_path and args.mode == "0.5.19":
            result["sglang_path"] = sglang_path
        counters = result.get("timed_counters") or {}
        if counters.get("real_tokens"):
            result["padding"] = counters["padding_tokens"] / counters["real_tokens"]
    except Exception as exc:  # noqa: BLE001 - the crash is the measurement
        result = {"mode": name, "requests": len(requests), "crashed": f"{type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}",
                  "crashed_at_request": progress.get("requests_done", 0) + 1,
                  "wrong_outputs": progress.get("wrong_outputs_so_far", 0)}
    result["kernels"] = kernels_now(args.backend)  # crashed runs too
    _write_part(args, result)
    if "crashed" not in result:
        # The graph path is profiled only where the timed stream replayed every request (ext runner, no
        # capture, no fallback): nothing is then captured under the profiler.
        all_hits = _misses(vit) is not None and result.get("captures") == 0 and result.get("fallbacks") == 0
        result.update(profile_bound(vit, requests, walls, args.profile_requests, dtype=dtype, graph=all_hits))
        _write_part(args, result)


def _run_child(args, mode: str, part: str) -> dict:
    """One mode's process and its result; a crash, a kill or a missing upstream tree becomes a row."""
    import subprocess

    if mode == "0.5.19" and not os.path.isfile(os.path.join(args.upstream_root, "sglang", "__init__.py")):
        return {"mode": mode, "crashed": f"not run: no sglang package under --upstream-root {args.upstream_root}"}
    try:
        status = "exit status {}".format(subprocess.run(
            _child_command(args, mode, part), env=_child_env(args, mode), timeout=args.mode_timeout or None).returncode)
    except subprocess.TimeoutExpired:  # killed; a result it wrote before its profile still counts
        status = f"killed after --mode-timeout {args.mode_timeout} s"
    if not os.path.exists(part):
        return {"mode": mode, "crashed": f"{status}, no result"}
    with open(part, encoding="utf-8") as f:
        result = json.load(f)
    if status.startswith("killed"):
        result["profile_error"] = status
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--unpatched-requests", type=int, default=300,
                        help="requests for the 0.5.17 and 0.5.19 modes (their graphs are unbounded)")
    parser.add_argument("--capacity", type=int, default=16)
    parser.add_argument("--max-bytes", type=int, default=-1,
                        help="ext modes: byte budget of resident graphs (--ext-vit-graph-max-bytes; -1 = its default, "
                             "sized from free memory)")
    parser.add_argument("--backend", default="auto", choices=("auto", "fa3", "triton_attn"),
                        help="vision attention backend; auto = what sglang picks: fa3 on SM90, else triton_attn")
    parser.add_argument("--upstream-root", help="directory holding upstream sglang 0.5.19's `sglang` package; "
                        "without it the 0.5.19 mode is skipped")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode-timeout", type=int, default=300,
                        help="seconds one mode's process may run before it is killed and recorded as such (0 = none)")
    parser.add_argument("--profile-requests", type=int, default=50,
                        help="requests spread over the stream rerun untimed under torch.profiler for the launch-free "
                             "bound (device time per request); 0 = no profile")
    parser.add_argument("--quick", action="store_true",
                        help="300 requests (100 for 0.5.17 / 0.5.19): about 3.5 minutes on one H200")
    parser.add_argument("--out", default=os.path.join(HERE, "..", "docs", "bench", "vit.json"))
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other modes' results already in --out (same stream and settings required)")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # internal: one mode per process
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_vit.py needs a CUDA device")
    if args.quick:
        args.requests, args.unpatched_requests = 300, 100
    if args.backend == "auto":
        args.backend = "fa3" if torch.cuda.get_device_capability()[0] == 9 else "triton_attn"
    if args.backend == "fa3" and not kit.fa3_loaded():
        raise SystemExit("--backend fa3: FlashAttention-3 (sgl_kernel.flash_attn / flash_ops) does not import here; "
                         "allowed: install sgl_kernel with flash_ops, or --backend triton_attn")
    if args.mode:
        run_one_mode(args)
        return

    import tempfile

    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: {unknown} not allowed; allowed: {', '.join(MODES)}")
    if "0.5.19" in modes and not args.upstream_root:
        print("bench_vit: no --upstream-root, so the 0.5.19 mode is skipped")
        modes.remove("0.5.19")
    n = args.requests
    config = {"tower": "qwen2.5-vl-7b vision", "dtype": "torch.bfloat16",
              "attention": args.backend, "requests": n, "capacity": args.capacity,
              "max_bytes_arg": args.max_bytes, "seed": args.seed,
              "command": "python3 " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
              "unpatched_requests": args.unpatched_requests, "profile_requests": args.profile_requests,
              "resolutions_px": RESOLUTIONS, "images_per_request": IMAGES_PER_REQUEST,
              "device": torch.cuda.get_device_name()}
    kept = []
    if args.merge and os.path.exists(args.out):  # checked before any GPU time is spent
        with open(args.out, encoding="utf-8") as f:
            previous = json.load(f)
        extra = bench_results.undeclared(previous, bench_results.VIT_SCHEMA)
        if extra:
            raise SystemExit(f"--merge: {args.out} carries keys this script does not write ({', '.join(extra)}); "
                             "rerun every mode without --merge")
        unrelated = ("command", "profile_requests")  # not part of the measured stream
        same = {k: previous["config"].get(k) for k in config if k not in unrelated}
        now = {k: v for k, v in json.loads(json.dumps(config)).items() if k not in unrelated}  # tuples as lists
        if same != now:
            raise SystemExit(f"--merge: {args.out} was measured with {same}; this run has {now}")
        kept = [r for r in previous["results"] if bench_results.vit_mode_key(r["mode"]) not in modes]
        config["seconds"] = previous["config"].get("seconds")
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:  # one process per mode: fresh CUDA context, no cross-talk
            results.append(_run_child(args, mode, os.path.join(tmp, f"{mode}.json")))
            results[-1]["run_id"] = bench_results.RUN_ID
            if args.merge:  # measured in a later run than the results it joins
                results[-1]["merged_later"] = True
            # After every mode, so a run killed from outside keeps what it measured (seconds: so far).
            report = {"config": {**config, "seconds": config.get("seconds", round(time.perf_counter() - started, 1))},
                      "results": sorted(kept + results,
                                        key=lambda r: MODES.index(bench_results.vit_mode_key(r["mode"])))}
            bench_results.write(args.out, report, bench_results.VIT_SCHEMA)
    print(bench_results.vit_table(results))
    print(bench_results.vit_bound_table(results))


if __name__ == "__main__":
    main()
