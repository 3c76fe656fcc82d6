#!/usr/bin/env python3
"""Pi0.5 single-request latency: eager vs CUDA-graph modes, sglang 0.5.17 / +sglang-ext / 0.5.19.

Pi0.5 at its real size with random weights (sglang_ext.testing.pi05_random), one
request at a time, 10 denoise steps, LIBERO-like inputs: two 224x224 cameras, state
dim 8, action horizon 50, action dim 32; full prefixes (both cameras) and masked
prefixes (empty second camera), prompts of mixed lengths (round-robin).

Per mode: p50/p90 latency over --requests timed requests after warm-up (every
(layout, prompt length) combination once, then --warmup more), CUDA API launches
per request (kernel launches and graph launches, torch.profiler), device kernels
per request and their summed time, peak allocated memory, graph-pool growth.

Implementations (one per process; the sglang on PYTHONPATH decides):
  0517      sglang 0.5.17 as released: eager, graph (action graph, full prefixes only)
  0517-ext  0.5.17 + sglang-ext: eager, graph (exact), graph-bucket, graph-fused
  0519      sglang 0.5.19 as released: eager, graph (exact), graph-bucket

On the GPU machine (docs/gpu-harness.md; SGX_SGLANG=0519 for --impl 0519):
  source scripts/gpu_env.sh && python3 scripts/bench_pi05.py --impl 0517-ext --out $OUT/ext.json
The table is printed last; --out writes JSON.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))

import bench_results  # noqa: E402
from sglang_ext.testing import pi05_random  # noqa: E402

MODES = {
    "0517": ("eager", "graph"),
    "0517-ext": ("eager", "graph", "graph-bucket", "graph-fused"),
    "0519": ("eager", "graph", "graph-bucket"),
}
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")


CUDA = torch.cuda.is_available()
ATTENTION = "torch_sdpa"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def reserved_bytes() -> int:
    return torch.cuda.memory_reserved() if CUDA else 0


def log(message: str) -> None:
    print(message, flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=sorted(MODES), required=True)
    ap.add_argument("--modes", default="", help="comma-separated subset of the impl's modes (default: all)")
    ap.add_argument("--requests", type=int, default=50, help="timed requests per mode (>= 50 for the report)")
    ap.add_argument("--warmup", type=int, default=5, help="extra warm-up requests after one of each combination")
    ap.add_argument("--prompt-lens", default="18,23,29,36,44,52,61,70")
    ap.add_argument("--layouts", default="full,masked")
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--buckets", default="32,64,128,200", help="prompt_token_buckets of graph-bucket mode")
    ap.add_argument("--prefix-entries", type=int, default=8, help="prefix graph capacity (0519 / ext)")
    ap.add_argument("--action-entries", type=int, default=8, help="action graph capacity (0519 / ext)")
    ap.add_argument("--profile-requests", type=int, default=4, help="requests profiled per mode (0 = none)")
    ap.add_argument("--quick", action="store_true", help="20 timed requests, 3 prompt lengths, 2 profiled")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--cpu-logic-check", action="store_true",
                    help="run the whole script on the CPU with a one-layer model (checks the script; numbers meaningless)")
    return ap


def parse_args() -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args()
    if args.quick:
        args.requests = min(args.requests, 20)
        args.warmup = min(args.warmup, 2)
        args.prompt_lens = "23,44,61"
        args.profile_requests = min(args.profile_requests, 2)
    args.prompt_lens = [int(v) for v in args.prompt_lens.split(",") if v]
    args.layouts = [v for v in args.layouts.split(",") if v]
    args.buckets = [int(v) for v in args.buckets.split(",") if v]
    modes = [m for m in args.modes.split(",") if m] or list(MODES[args.impl])
    unknown = [m for m in modes if m not in MODES[args.impl]]
    if unknown:
        ap.error(f"--modes: {unknown} not available for --impl {args.impl}; allowed: {', '.join(MODES[args.impl])}")
    args.modes = modes
    return args


def check_impl(impl: str) -> str:
    import sglang

    root = os.path.dirname(os.path.dirname(sglang.__file__))
    from sglang_ext.versions import installed_sglang_version, source_tree_version

    version = installed_sglang_version() or source_tree_version(root)
    expected = "0.5.19" if impl == "0519" else "0.5.17"
    if version is None:
        log(f"[bench] sglang version at {root} unknown; assuming {expected} for --impl {impl}")
        return expected
    if version != expected:
        raise SystemExit(f"--impl {impl} needs sglang {expected} on PYTHONPATH; found {version} at {root}")
    return version


def configure(policy, impl: str, mode: str, args) -> Dict[str, Any]:
    """Rebuild the graph runners for one mode; returns a description of the mode."""
    config = policy.config
    if impl == "0517":
        runner_cls = type(policy.graph_runner)
        policy.graph_runner = runner_cls(enabled=bool(config.enable_action_cuda_graph))
        return {"prefix_graph": False, "action_graph": "full prefixes only, unbounded"}
    cuda_graph = importlib.import_module("sglang.multimodal_gen.runtime.vla.cuda_graph")
    for runner in (policy.prefix_graph_runner, policy.graph_runner):
        runner.clear()
    config.prompt_token_buckets = list(args.buckets) if mode == "graph-bucket" else []
    config.prefix_cuda_graph_max_entries = args.prefix_entries
    config.action_cuda_graph_max_entries = args.action_entries
    if impl == "0517-ext":
        os.environ["SGLANG_EXT_PI05_FUSED_DENOISE"] = "1" if mode == "graph-fused" else "0"
    evict = policy._prompt_token_bucketing_enabled()
    available = getattr(config, "action_cuda_graph_available", None)
    action_enabled = available() if callable(available) else bool(config.enable_action_cuda_graph)
    policy.prefix_graph_runner = cuda_graph.VLAPrefixGraphRunner(
        enabled=policy._prefix_cuda_graph_enabled(), max_entries=args.prefix_entries, evict_on_miss=evict
    )
    policy.graph_runner = cuda_graph.VLADenoiseGraphRunner(
        enabled=action_enabled, max_entries=args.action_entries, evict_on_miss=evict
    )
    sync()
    if CUDA:
        torch.cuda.empty_cache()
    return {
        "prefix_graph": policy.prefix_graph_runner.enabled,
        "action_graph": policy.graph_runner.enabled,
        "bucket_mode": evict,
        "prompt_token_buckets": list(config.prompt_token_buckets),
        "prefix_entries": args.prefix_entries,
        "action_entries": args.action_entries,
        "fused_denoise": mode == "graph-fused",
    }


def combos(args) -> List[tuple]:
    return [(layout, prompt_len) for layout in args.layouts for prompt_len in args.prompt_lens]


def make_inputs(policy, args):
    inputs = []
    for index, (layout, prompt_len) in enumerate(combos(args)):
        observation = pi05_random.make_observation(
            policy, prompt_len=prompt_len, masked_camera=layout == "masked", seed=1000 + index
        )
        inputs.append(((layout, prompt_len), observation, pi05_random.make_noise(policy, 2000 + index)))
    return inputs


def one_request(policy, observation, noise, graph: bool, num_steps: int):
    return pi05_random.run_request(policy, observation, noise, graph=graph, num_steps=num_steps)


_CACHE = bench_results.ANY  # the runner's cache_info() fields
# Every key this script writes to --out (see bench_results.py).
SCHEMA = {
    **dict.fromkeys(("run_id", "impl", "sglang", "device", "torch", "attention")),
    "kernels": bench_results.KERNELS_SCHEMA,
    "sglang_ext": bench_results.ANY,  # patch name -> status
    "settings": {a.dest: None for a in build_parser()._actions if a.dest not in ("help", "out")},
    "results": [{
        **dict.fromkeys(("impl", "mode", "requests", "p50_ms", "p90_ms", "mean_ms", "min_ms", "warmup_s",
                         "peak_allocated_mib", "graph_pool_growth_mib", "max_relative_diff_vs_eager",
                         "profiled_requests", "kernel_launches_per_request", "graph_launches_per_request",
                         "device_kernels_per_request", "kernel_time_ms_per_request")),
        "config": dict.fromkeys(("prefix_graph", "action_graph", "bucket_mode", "prompt_token_buckets",
                                 "prefix_entries", "action_entries", "fused_denoise")),
        "prefix_graph_runner_cache": _CACHE, "graph_runner_cache": _CACHE,
    }],
}


def profile(policy, inputs, graph: bool, args) -> Dict[str, float]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    count = max(0, min(args.profile_requests, len(inputs)))
    if count == 0:
        return {}
    picked = [inputs[i * len(inputs) // count] for i in range(count)]
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _, observation, noise in picked:
            one_request(policy, observation, noise, graph, args.num_steps)
        sync()
    kernel_launches = graph_launches = kernels = 0
    kernel_us = 0.0
    for event in prof.events():
        name = event.name
        if name in LAUNCH_APIS:
            kernel_launches += 1
        elif name in GRAPH_LAUNCH_APIS:
            graph_launches += 1
        if event.device_type == DeviceType.CUDA and not name.startswith(("Memcpy", "Memset")):
            kernels += 1
            kernel_us += float(event.device_time_total)
    return {
        "profiled_requests": count,
        "kernel_launches_per_request": kernel_launches / count,
        "graph_launches_per_request": graph_launches / count,
        "device_kernels_per_request": kernels / count,
        "kernel_time_ms_per_request": kernel_us / 1000.0 / count,
    }


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[index]


def run_mode(policy, impl: str, mode: str, inputs, args, reference: Dict[tuple, torch.Tensor]) -> Dict[str, Any]:
    graph = mode != "eager"
    description = configure(policy, impl, mode, args)
    log(f"[bench] {impl} {mode}: {description}")
    sync()
    reserved_before = reserved_bytes()
    start = time.perf_counter()
    max_diff = 0.0
    for key, observation, noise in inputs:  # every combination once (captures)
        actions = one_request(policy, observation, noise, graph, args.num_steps)
        if key in reference:
            max_diff = max(max_diff, pi05_random.relative_diff(actions, reference[key]))
        else:
            reference[key] = actions.clone()
    for index in range(args.warmup):
        _, observation, noise = inputs[index % len(inputs)]
        one_request(policy, observation, noise, graph, args.num_steps)
    sync()
    warmup_s = time.perf_counter() - start
    graph_pool_growth = reserved_bytes() - reserved_before
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    latencies = []
    for index in range(args.requests):
        _, observation, noise = inputs[index % len(inputs)]
        sync()
        t0 = time.perf_counter()
        one_request(policy, observation, noise, graph, args.num_steps)
        sync()
        latencies.append((time.perf_counter() - t0) * 1000.0)
    peak_allocated = torch.cuda.max_memory_allocated() if CUDA else 0
    result: Dict[str, Any] = {
        "impl": impl,
        "mode": mode,
        "config": description,
        "requests": args.requests,
        "p50_ms": statistics.median(latencies),
        "p90_ms": percentile(latencies, 0.9),
        "mean_ms": statistics.fmean(latencies),
        "min_ms": min(latencies),
        "warmup_s": warmup_s,
        "peak_allocated_mib": peak_allocated / 2**20,
        "graph_pool_growth_mib": graph_pool_growth / 2**20,
        "max_relative_diff_vs_eager": max_diff,
    }
    for name in ("prefix_graph_runner", "graph_runner"):
        runner = getattr(policy, name, None)
        info = getattr(runner, "cache_info", None)
        if callable(info):
            cache = info()
            result[name + "_cache"] = cache.as_dict() if hasattr(cache, "as_dict") else vars(cache)
    result.update(profile(policy, inputs, graph, args))
    log(f"[bench] {impl} {mode}: p50 {result['p50_ms']:.1f} ms p90 {result['p90_ms']:.1f} ms "
        f"launches {result.get('kernel_launches_per_request', float('nan')):.0f} "
        f"graphs {result.get('graph_launches_per_request', float('nan')):.1f} "
        f"diff {max_diff:.2e}")
    return result


def _graph_buffer_mib(result: Dict[str, Any]) -> str:
    """Bytes held by resident graphs' static buffers, as the sglang-ext caches count them ("-": not reported)."""
    counted = [c.get("bytes_resident") for c in (result.get("prefix_graph_runner_cache"),
                                                  result.get("graph_runner_cache")) if isinstance(c, dict)]
    counted = [b for b in counted if b is not None]
    return f"{sum(counted) / 2**20:.0f}" if counted else "-"


def print_table(results: List[Dict[str, Any]]) -> None:
    header = ("impl", "mode", "p50 ms", "p90 ms", "launches/req", "graph launches/req", "kernels/req",
              "kernel ms/req", "peak MiB", "pool +MiB", "graph buf MiB", "max rel diff")
    rows = [header]
    for r in results:
        rows.append((
            r["impl"], r["mode"], f"{r['p50_ms']:.1f}", f"{r['p90_ms']:.1f}",
            f"{r.get('kernel_launches_per_request', float('nan')):.0f}",
            f"{r.get('graph_launches_per_request', float('nan')):.1f}",
            f"{r.get('device_kernels_per_request', float('nan')):.0f}",
            f"{r.get('kernel_time_ms_per_request', float('nan')):.1f}",
            f"{r['peak_allocated_mib']:.0f}", f"{r['graph_pool_growth_mib']:.0f}", _graph_buffer_mib(r),
            f"{r['max_relative_diff_vs_eager']:.1e}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print()
    for index, row in enumerate(rows):
        print(" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)))
        if index == 0:
            print("-+-".join("-" * w for w in widths))


def main() -> int:
    args = parse_args()
    if not CUDA and not args.cpu_logic_check:
        raise SystemExit("bench_pi05 needs a CUDA device (or --cpu-logic-check)")
    version = check_impl(args.impl)
    statuses = {}
    if args.impl == "0517-ext":
        statuses = {name: str(s) for name, s in pi05_random.activate_sglang_ext().items()}
        log(f"[bench] sglang-ext: {statuses}")
    t0 = time.perf_counter()
    policy = pi05_random.build_random_pi05(
        device="cuda" if CUDA else "cpu", dtype=torch.bfloat16, seed=0, reduced=not CUDA, log=log,
        attention_backend=ATTENTION,
    )
    log(f"[bench] model built in {time.perf_counter() - t0:.1f} s; sglang {version}")
    inputs = make_inputs(policy, args)
    reference: Dict[tuple, torch.Tensor] = {}
    modes = args.modes
    if "eager" in modes:  # eager first: graph modes are compared with it
        modes = ["eager"] + [m for m in modes if m != "eager"]
    results = [run_mode(policy, args.impl, mode, inputs, args, reference) for mode in modes]
    payload = {
        "run_id": bench_results.RUN_ID,
        "impl": args.impl,
        "sglang": version,
        "device": torch.cuda.get_device_name() if CUDA else "cpu (logic check)",
        "torch": torch.__version__,
        "kernels": bench_results.kernels(),
        "attention": ATTENTION,
        "sglang_ext": statuses,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }
    if args.out:
        bench_results.write(args.out, payload, SCHEMA, default=str)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
